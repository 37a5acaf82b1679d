"""The root of Omni's error families.

Each layer defines its own small family under `OmniError` (the graph layer in
`omni.graph.errors`, later the KV store and the transport in theirs), so that
an application can catch everything Omni raises with one `except OmniError`.
"""

from __future__ import annotations

import builtins
from traceback import format_exception

__all__ = ["OmniError", "RemoteError", "describe", "summary", "traceback_text", "unwrap"]


class OmniError(Exception):
    """Base class of every error Omni raises on purpose."""


class RemoteError(OmniError):
    """An error raised in another process, re-raised here: `remote_type` is the remote
    error's type name, and the message starts with it (``ValueError: ...``), so whoever
    reports it names that type, not this one."""

    remote_type: str = ""

    def is_builtin(self, kind: type[BaseException]) -> bool:
        """Whether the remote error was a `kind`: that builtin type or a builtin subclass of
        it (a type of the remote code's own is not known here)."""
        remote = getattr(builtins, self.remote_type, None)
        return isinstance(remote, type) and issubclass(remote, kind)


def summary(error: BaseException) -> str:
    """``Type: message`` of `error`, as a person reads what failed: its type name alone when
    it has no message, its message alone for a `RemoteError` (which names the remote type)."""
    text = str(error)
    if isinstance(error, RemoteError):
        return text
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def unwrap(error: BaseException) -> BaseException:
    """`error` without trio's wrapping: a nursery's group of one exception is that exception
    (at any depth); a group of several stays a group (`describe` names each)."""
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    return error


def describe(error: BaseException) -> tuple[str, str]:
    """`error`'s type name and message as another process should read them: a group of one
    as its exception's, a group of several as its type's with each exception named, e.g.
    ``("ExceptionGroup", "2 errors: ValueError: a; KeyError: 'b'")``."""
    error = unwrap(error)
    if not isinstance(error, BaseExceptionGroup):
        return type(error).__name__, str(error)
    parts = [": ".join(part for part in describe(e) if part) for e in error.exceptions]
    return type(error).__name__, f"{len(parts)} errors: {'; '.join(parts)}"


def traceback_text(error: BaseException, limit: int) -> str:
    """`error`'s traceback as Python prints it (a group of one unwrapped), cut to its last
    `limit` characters: what another process shows under the error it raises for it."""
    return "".join(format_exception(unwrap(error)))[-limit:]
