"""Draft worker: the small model that proposes k tokens per round."""
