"""The root of Omni's error families.

Each layer defines its own small family under `OmniError` (the graph layer in
`omni.graph.errors`, later the KV store and the transport in theirs), so that
an application can catch everything Omni raises with one `except OmniError`.
"""

from __future__ import annotations

__all__ = ["OmniError"]


class OmniError(Exception):
    """Base class of every error Omni raises on purpose."""
