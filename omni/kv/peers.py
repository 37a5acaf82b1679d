"""The store's hook for pages held by other workers: the `PeerSource` protocol.

Why a protocol here and not the implementation: `omni.kv` is below the Wire layer and must not
import it. The transport (`omni.cluster.kv.peers.PeerFetcher`) implements this protocol and
is plugged into a store with ``store.peers = fetcher``; `KVStore.prefetch` then asks it for the
pages it lacks before the engine recomputes them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from omni.kv.store import KVStore

__all__ = ["PeerSource"]


@runtime_checkable
class PeerSource(Protocol):
    """Somewhere a store can get pages it lacks from (other workers' stores)."""

    async def fetch(self, store: KVStore, keys: Sequence[bytes], *,
                    recompute_page_s: float | None) -> int:
        """Bring as many *leading* `keys` as it can into `store`.

        Args:
            store: the store to put the pages into.
            keys: the keys wanted, in prefix order (only a leading run is useful: a page
                after a missing one cannot be used without recomputing the missing one).
            recompute_page_s: what recomputing one page costs the caller, in seconds, so
                that a fetch slower than that is not made (None: unknown, fetch).

        Returns how many leading keys are in `store` afterwards. It must fail closed: a
        transfer that broke or did not verify is a miss (fewer keys), never wrong pages and
        never an exception.
        """
        ...
