"""Following the cluster's KV stores: what a driver (for KV-aware balancing) and a worker (to
fetch pages from its peers) both do.

Each keeps a `KVDirectory` of which member holds which pages, fed by the members' event
publishers, and a client to every member with a store (for snapshots and page fetches). The
roster says who the members are; a member that leaves or restarts (new endpoints) is dropped
from the directory and followed again.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from omni.cluster.kv.directory import KVDirectory, KVSnapshot, request_snapshot
from omni.cluster.membership import ClientSet, Roster
from omni.cluster.protocol import MemberView, endpoint_for
from omni.transport.credentials import Credentials

__all__ = ["follow_members", "kv_directory"]


@asynccontextmanager
async def kv_directory(creds: Credentials, clients: ClientSet) -> AsyncIterator[KVDirectory]:
    """A running `KVDirectory` that asks `clients` for a member's snapshot when it resyncs."""

    async def snapshot(member: str) -> KVSnapshot:
        client = clients.get(member)
        if client is None:
            raise LookupError(f"no worker '{member}'")
        return await request_snapshot(client, timeout=5.0)

    async with KVDirectory(creds, snapshot) as directory:
        yield directory


async def follow_members(roster: Roster, clients: ClientSet, directory: KVDirectory, *,
                         skip: str | None = None, drop_gone: bool = False,
                         task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
    """Keep `directory` and `clients` in step with `roster`'s members that have a store (all
    but `skip`), until cancelled; `task_status.started()` once the roster's current members
    are followed. With `drop_gone`, a member no longer followed loses its client too."""
    followed: dict[str, tuple[str, str]] = {}  # name -> (endpoint, KV event endpoint)

    async def on_change(members: dict[str, MemberView]) -> None:
        wanted = {name: (endpoint_for(view.info), view.info.kv_events)
                  for name, view in members.items() if name != skip and view.info.kv_events}
        for name in [n for n in followed if wanted.get(n) != followed[n]]:
            directory.remove_member(name)
            del followed[name]
            if drop_gone:
                clients.drop(name)
        for name, (endpoint, events) in wanted.items():
            if name not in followed:
                await clients.connect(name, endpoint)
                directory.add_member(name, events)
                followed[name] = (endpoint, events)

    await on_change(roster.members)
    task_status.started()
    await roster.run(on_change)
