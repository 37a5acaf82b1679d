"""Where a socket's owner task parks, and how other tasks wake it (see `_Waker`)."""

from __future__ import annotations

import os
import select
from typing import Any

import trio

__all__ = ["_Waker"]


class _Waker:
    """Where the owner parks, and how other tasks wake it. Why it exists: trio cannot wait on
    an FD *or* a channel at once, so the owner parks on one FD and a sender that queued a
    message must interrupt that wait.

    On Linux the owner parks on a private epoll set holding the ZeroMQ FD and an eventfd, and a
    poke writes the eventfd (about a microsecond). Elsewhere the owner parks on the ZeroMQ FD in
    a cancel scope and a poke cancels it (several times dearer: trio raises and catches
    `Cancelled`). Either way the epoll set or FD only *wakes* the owner; only the owner waits
    on ZeroMQ (a direct send pokes it if it consumed a signal the owner needs).
    """

    def __init__(self, zmq_fd: int, *, use_epoll: bool | None = None):
        if use_epoll is None:
            use_epoll = hasattr(select, "epoll") and hasattr(os, "eventfd")
        self._zmq_fd = zmq_fd
        self._parked = self._poked = False
        self._scope: trio.CancelScope | None = None
        self._epoll: Any = None
        self._epoll_fd = self._event_fd = -1
        if use_epoll:
            self._event_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
            self._epoll = select.epoll()
            self._epoll_fd = self._epoll.fileno()
            self._epoll.register(zmq_fd, select.EPOLLIN)
            self._epoll.register(self._event_fd, select.EPOLLIN)

    async def park(self) -> None:
        """Wait until ZeroMQ's FD signals or `poke` is called."""
        if self._epoll is None:
            with trio.CancelScope() as self._scope:
                await trio.lowlevel.wait_readable(self._zmq_fd)
            self._scope = None
            return
        self._parked = True
        try:
            await trio.lowlevel.wait_readable(self._epoll_fd)
        finally:
            self._parked = False
        if self._poked:
            self._poked = False
            os.eventfd_read(self._event_fd)

    def poke(self) -> None:
        """Wake the owner if it is parked (cheap, and idempotent until it wakes)."""
        if self._parked:
            if not self._poked:
                self._poked = True
                os.eventfd_write(self._event_fd, 1)
        elif self._scope is not None:
            self._scope.cancel()

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()
            os.close(self._event_fd)
            self._epoll = None
