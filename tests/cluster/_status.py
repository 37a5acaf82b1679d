"""What the tests read of a cluster's state: each member as ``omni cluster status --json``
prints it (`cli._cluster_status.member_row`), by name, asked of the head over RPC from this
process (no ``omni cluster status`` process per look)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cli._cluster_status import member_row
from omni.cluster import MemberView
from omni.transport.credentials import Credentials
from omni.transport.rpc import RPCClient
from omni.transport.security import load_token

__all__ = ["ask_members", "rows"]

Rows = dict[str, dict[str, Any]]


def rows(views: Iterable[MemberView]) -> Rows:
    """Members (up first, then lost) as status rows, by name."""
    return {view.info.name: member_row(view) for view in views}


async def ask_members(address: str, token: Path) -> Rows:
    """The head at `address`'s members, asked as ``omni cluster status`` asks."""
    creds = Credentials(load_token(token))  # a client only: no authenticator to run
    try:
        async with RPCClient(address, ctx=creds.ctx, options=creds.client_options(),
                             heartbeat_interval=None, timeout=10.0) as client:
            return rows(await client.call("cluster.members", None,
                                          result_type=list[MemberView]))
    finally:
        creds.close()
