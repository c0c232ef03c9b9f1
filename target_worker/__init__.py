"""Target worker: the large model that verifies drafted tokens losslessly."""
