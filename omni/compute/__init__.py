"""Compute Flow: prompts, multimodal prefix keys, sampling, engines (filled in as it lands)."""
