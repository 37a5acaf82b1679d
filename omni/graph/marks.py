"""Marks on a graph's inputs (``Annotated[str, mark]``) for whoever feeds the graph from
outside: which inputs are files a node opens or writes, and which carries the request's cache
salt.

``omni run`` (the user's own machine) passes them as given. ``omni serve`` holds them to its
policy: it never lets a remote client name a server path (input files only from folders its
operator allows, output files in a folder the server picks, sent back as data), and it fills
the cache salt itself, from the client's API key and the request's ``cache_salt``::

    @omni.graph
    def dialogue(text: str, image: Annotated[str, omni.InputFile()] = "",
                 out: Annotated[str, omni.OutputFile(".wav")] = "",
                 salt: Annotated[str, omni.CacheSalt()] = ""): ...

An input annotated `pathlib.Path` (or another `PurePath`) is an input file too. The values
stay strings (or paths): the marks only describe them.
"""

from __future__ import annotations

import pathlib
import types
import typing
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["CacheSalt", "FileRole", "InputFile", "OutputFile", "cache_salt_mark", "file_role",
           "is_cache_salt"]


@dataclass(frozen=True)
class InputFile:
    """Marks a graph input (``Annotated[str, InputFile()]``) as the path of a file a node
    reads."""

    def __str__(self) -> str:
        return "input file"


@dataclass(frozen=True)
class OutputFile:
    """Marks a graph input (``Annotated[str, OutputFile(".wav")]``) as the path of a file a
    node writes; `suffix` is the file's type, for whoever picks the path."""

    suffix: str = ""

    def __str__(self) -> str:
        return f"output file {self.suffix}".rstrip()

    def __post_init__(self) -> None:
        if not isinstance(self.suffix, str) or (
                self.suffix and (not self.suffix.startswith(".") or "/" in self.suffix
                                 or self.suffix in (".", ".."))):
            raise ValueError(f"OutputFile's suffix is like '.wav' (or ''), got {self.suffix!r}")


@dataclass(frozen=True)
class CacheSalt:
    """Marks a graph input (``Annotated[str, CacheSalt()]``) as the request's cache salt: a
    string that nodes mix into the keys of what they cache (``TorchEngine.generate(...,
    cache_salt=)``), so that requests of different salts share nothing. A server fills it per
    tenant (API key) and request; requests with the same salt share their prefixes.

    ``CacheSalt(per="tenant")`` marks the tenant's own salt instead: the same for each of a
    tenant's requests whatever their ``cache_salt`` (which a client picks freely), what a node
    keys per-tenant state by (a session table's quota per tenant)."""

    per: Literal["request", "tenant"] = "request"

    def __str__(self) -> str:
        return "cache salt" if self.per == "request" else "tenant's cache salt"

    def __post_init__(self) -> None:
        if self.per not in ("request", "tenant"):
            raise ValueError(f"CacheSalt's per is 'request' or 'tenant', got {self.per!r}")


FileRole = InputFile | OutputFile


def file_role(annotation: Any) -> FileRole | None:
    """The file role an input's annotation gives it: the `InputFile` / `OutputFile` mark in an
    ``Annotated[...]``, `InputFile()` for a `PurePath` annotation, else None."""
    if typing.get_origin(annotation) is typing.Annotated:
        marks = [m for m in typing.get_args(annotation)[1:]
                 if isinstance(m, InputFile | OutputFile)]
        if marks:
            return marks[0]
        annotation = typing.get_args(annotation)[0]
    if isinstance(annotation, type) and issubclass(annotation, pathlib.PurePath):
        return InputFile()
    members = typing.get_args(annotation) if _is_union(annotation) else ()
    if any(isinstance(m, type) and issubclass(m, pathlib.PurePath) for m in members):
        return InputFile()  # Path | None
    return None


def is_cache_salt(annotation: Any) -> bool:
    """Whether an input's annotation marks it as the request's `CacheSalt`."""
    return cache_salt_mark(annotation) is not None


def cache_salt_mark(annotation: Any) -> CacheSalt | None:
    """The `CacheSalt` mark in an input's ``Annotated[...]`` annotation, or None."""
    if typing.get_origin(annotation) is not typing.Annotated:
        return None
    return next((m for m in typing.get_args(annotation)[1:] if isinstance(m, CacheSalt)), None)


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
