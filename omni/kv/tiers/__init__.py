"""Page storage by tier: device memory, the host shared-memory arena, disk."""
