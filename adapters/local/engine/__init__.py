"""Requests into steps: the LLMEngine, its scheduler, KV blocks, sequences, sampling,
token speculation, the PRM scorer, calibration."""
