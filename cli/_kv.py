"""The KV store of ``omni run``: the graph file's `KV_LAYOUT` and the ``--kv-*`` tier sizes.

A graph file that uses the KV store declares the page layout its models need as a
module-level ``KV_LAYOUT = omni.kv.KVLayout(...)``; the options only size the tiers.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from cli._errors import CliError

__all__ = ["kv_config"]


def kv_config(module: ModuleType, path: str, *, device: str | None, host: str | None,
              disk: str | None) -> Any:
    """The `KVConfig` to give the runtime, or None when the file uses no KV store.

    Raises:
        CliError: a --kv-* option without a KV_LAYOUT in the file, or a size that is not one.
    """
    layout = getattr(module, "KV_LAYOUT", None)
    asked = any(v is not None for v in (device, host, disk))
    if layout is None:
        if asked:
            raise CliError(f"{path} defines no KV_LAYOUT, so --kv-device/--kv-host/--kv-disk "
                           "have nothing to size; add KV_LAYOUT = omni.kv.KVLayout(...)")
        return None
    from omni.kv import KVConfig, KVLayout, TierConfig
    from omni.kv.store import DEFAULT_TIERS

    if not isinstance(layout, KVLayout):
        raise CliError(f"{path}: KV_LAYOUT must be an omni.kv.KVLayout, got {layout!r}")
    if not asked:
        return KVConfig(layout)
    tiers = []
    try:
        if device is not None:
            tiers.append(TierConfig("device", device))
        if host is not None:
            tiers.append(TierConfig("host", host))
        if disk is not None:
            size, _, folder = disk.partition(":")
            tiers.append(TierConfig("disk", size, path=folder or None))
        if device is None and host is None:  # keep the default memory tiers above a disk tier
            tiers = [*DEFAULT_TIERS, *tiers]
        config = KVConfig(layout, tuple(tiers))
        config.check()
    except ValueError as exc:
        raise CliError(f"bad KV tier size: {exc}") from None
    return config
