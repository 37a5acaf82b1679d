"""Tests of the Data Flow layer (`omni.kv`): keys, policies, layout, tiers and the store."""
