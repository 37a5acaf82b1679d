"""Reclaiming the shared memory of this host's dead processes as soon as a death is known.

Why here: a process killed outright (SIGKILL, the OOM killer) cannot unlink its shared memory,
and a store that starts on the host reclaims it only if one ever starts there again. The
cluster is the first to know of a death: the head loses a member, the driver sees one leave
its roster, Ray restarts an actor. Each calls `reclaim_dead_owners` then, and the driver once
more as it ends, so a run with a killed worker ends with nothing of it left on the hosts it
knows. What is removed is only what `omni._shm.reclaim_dead` allows: files in Omni's own
shared-memory folder, of this user, whose owner process is gone (a live one keeps its own).
"""

from __future__ import annotations

import logging

from omni.kv.leases import reclaim_dead_stores
from omni.transport.movers import reclaim_dead_segments

__all__ = ["reclaim_dead_owners"]

log = logging.getLogger("omni.cluster")


def reclaim_dead_owners(why: str) -> int:
    """Unlink the KV stores' arenas and lease tables and the stage values' segments that
    processes of this host which are gone left behind; how many files. `why` (the death
    that prompted it) goes in the one log line said when anything was removed. Never raises:
    it runs where a death or an ending is being handled, whose own error must not be hidden
    (a folder it cannot read is logged, and left to the next store that starts)."""
    try:
        stores = reclaim_dead_stores()
        segments = reclaim_dead_segments()
    except OSError as exc:
        log.warning("%s: cannot reclaim the shared memory of dead processes: %s", why, exc)
        return 0
    if stores or segments:
        names = sorted({name.rsplit("-", 1)[0] for name in stores})
        log.warning("%s: removed the shared memory of dead processes (%d KV store file(s)%s, "
                    "%d value segment(s))", why, len(stores),
                    f": {', '.join(names)}" if names else "", segments)
    return len(stores) + segments
