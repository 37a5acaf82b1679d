"""Graph inputs that are files: which inputs a node opens for reading and which it writes.

A graph says so in its annotations, so that whoever feeds it from outside can hold the paths
to a policy: ``omni run`` (the user's own machine) passes them as given; ``omni serve`` never
lets a remote client name a server path (`omni.serve`'s file policy: input files only from
folders its operator allows, output files in a folder the server picks, sent back as data)::

    @omni.graph
    def dialogue(text: str, image: Annotated[str, omni.InputFile()] = "",
                 out: Annotated[str, omni.OutputFile(".wav")] = ""): ...

An input annotated `pathlib.Path` (or another `PurePath`) is an input file too. The values
stay strings (or paths): the marks only describe them.
"""

from __future__ import annotations

import pathlib
import types
import typing
from dataclasses import dataclass
from typing import Any

__all__ = ["FileRole", "InputFile", "OutputFile", "file_role"]


@dataclass(frozen=True)
class InputFile:
    """Marks a graph input (``Annotated[str, InputFile()]``) as the path of a file a node
    reads."""


@dataclass(frozen=True)
class OutputFile:
    """Marks a graph input (``Annotated[str, OutputFile(".wav")]``) as the path of a file a
    node writes; `suffix` is the file's type, for whoever picks the path."""

    suffix: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.suffix, str) or (
                self.suffix and (not self.suffix.startswith(".") or "/" in self.suffix
                                 or self.suffix in (".", ".."))):
            raise ValueError(f"OutputFile's suffix is like '.wav' (or ''), got {self.suffix!r}")


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


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
