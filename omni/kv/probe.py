"""Check that tiers can be made before a store needs them: what `omni cluster join` does with
its ``--kv-*`` flags, since a worker builds its store only when the first deployment brings the
pages' layout, long after the user who mistyped a flag has walked away."""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from omni.kv.errors import KVTierError
from omni.kv.layout import KVLayout, parse_size

if TYPE_CHECKING:
    from omni.kv.store import TierConfig

__all__ = ["check_tiers", "tier_error"]

# A small page, so any capacity a flag accepts holds at least one; nothing per slot is built.
_PROBE_LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, page_size=4,
                         dtype=torch.float32)


def tier_error(name: str, exc: BaseException) -> KVTierError:
    """`exc`, raised while making the tier `name`, as the one-line error a user reads."""
    why = exc.args[1] if isinstance(exc, OSError) and len(exc.args) == 2 \
        and isinstance(exc.args[1], str) else str(exc)
    why = why.removeprefix(f"{name} tier: ")
    return KVTierError(name, f"the {name} tier cannot be made: {why}")


def check_tiers(tiers: Sequence[TierConfig]) -> None:
    """Make each tier of `tiers` as a store would, at its full capacity, and
    remove it again: a disk tier's folder and sparse page file, a host tier's (or a CPU device
    tier's) shared-memory arena with its first reservation. A device tier on a GPU is not
    allocated (it would take the GPU's memory for the time of the check).

    Raises:
        KVTierError: a tier that cannot be made, naming it and the cause.
    """
    from omni.kv.tiers.device import DeviceTier
    from omni.kv.tiers.disk import DiskTier
    from omni.kv.tiers.host import HostTier
    from omni.kv.tiers.memory import slots_for

    for config in tiers:
        name = config.name
        if name == "device" and torch.cuda.is_available():
            continue
        probe_id = secrets.token_hex(8)
        try:
            capacity = parse_size(config.capacity)
            if name == "disk":
                slots = slots_for(capacity, DiskTier.slot_bytes_for(_PROBE_LAYOUT), name)
                tier = DiskTier.create(_PROBE_LAYOUT, slots, config.path, probe_id)
            else:
                slots = slots_for(capacity, _PROBE_LAYOUT.page_bytes, name)
                make = HostTier.create if name == "host" else DeviceTier.create
                tier = make(_PROBE_LAYOUT, slots, probe_id)
        except (OSError, ValueError, OverflowError) as exc:
            raise tier_error(name, exc) from exc
        tier.close()
