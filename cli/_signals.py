"""How a command ends on Ctrl-C (SIGINT) or SIGTERM: the same way for both.

The first signal cancels the command's work, which unwinds as on any cancellation: requests
in flight are cancelled, leases released, arenas unlinked, disk-tier files that are not meant
to persist removed. Then `Stopped` is raised for the caller to report (one line; exit 130 for
SIGINT, 143 for SIGTERM). A second signal while that cleanup runs ends the process at once,
as the signal's default would have.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import trio

from cli._errors import Stopped
from omni.transport.trio_zmq import background_nursery

__all__ = ["SIGNALS", "stopped_by_signals"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@asynccontextmanager
async def stopped_by_signals(stop: Callable[[], None] | None = None) -> AsyncIterator[None]:
    """The block, until it ends or a signal arrives; then `Stopped` once it has unwound.

    Args:
        stop: how to end the block gently (a server's own stop); the default cancels it.
    """
    received: list[int] = []
    with trio.CancelScope() as scope:
        with trio.open_signal_receiver(*SIGNALS) as signals:

            async def watch() -> None:
                async for signum in signals:
                    if received:  # a second signal: stop waiting for the cleanup
                        signal.signal(signum, signal.SIG_DFL)
                        os.kill(os.getpid(), signum)
                        return
                    received.append(signum)
                    (stop or scope.cancel)()

            async with background_nursery() as nursery:
                nursery.start_soon(watch)
                yield
    if received:
        raise Stopped(received[0])
