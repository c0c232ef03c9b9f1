"""Tools around the services: benchmark, demo, load test, k-policy tuning (trace simulator), client CLI.

The top layer: tools may import the orchestrator and the workers; nothing below imports them.
"""
