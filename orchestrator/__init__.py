"""Orchestrator: public Generate API, admission control, the round loop, adaptive k."""
