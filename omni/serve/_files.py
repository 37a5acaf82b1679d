"""A remote client never names a server path: the server's policy for a graph's file inputs.

A graph marks its file inputs (`omni.InputFile`, `omni.OutputFile`, or a `Path` annotation).
Over HTTP:

- an input file is refused unless the operator allowed a folder (``--allow-path DIR``); then
  the client's path is resolved inside that folder (symbolic links and ``..`` followed) and
  refused unless it stays there. The refusal reads the same whether or not the path exists,
  so it tells a client nothing about the server's files;
- an output file is the server's to place: a client that names one is refused; the server
  passes a fresh path in a folder of the request's own (mode 0700), reads the file back when
  the graph is done, sends it in the answer's ``"files"`` (base64), and removes the folder.
  Where an output names the file's path, the answer names the file instead.
"""

from __future__ import annotations

import base64
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from omni.graph.dsl import Graph
from omni.graph.marks import InputFile, OutputFile, file_role
from omni.serve._errors import ApiError

__all__ = ["FILES_KEY", "MAX_OUTPUT_FILE_BYTES", "FilePolicy", "RequestFiles"]

FILES_KEY = "files"  # the answer's field holding the output files
MAX_OUTPUT_FILE_BYTES = 64 << 20  # an output file larger than this is not sent back


@dataclass(frozen=True)
class FilePolicy:
    """Which folders clients may name input files in (`allowed`, resolved), and where the
    requests' output folders go (`output_root`; None: the system's temporary folder)."""

    allowed: tuple[Path, ...] = ()
    output_root: Path | None = None

    @classmethod
    def create(cls, allow_paths: Sequence[str | os.PathLike[str]] = (),
               output_root: str | os.PathLike[str] | None = None) -> FilePolicy:
        """The policy allowing `allow_paths` (each an existing folder).

        Raises:
            ValueError: an allowed path or the output root that is not a folder.
        """
        allowed = []
        for folder in allow_paths:
            resolved = Path(os.path.realpath(folder))
            if not resolved.is_dir():
                raise ValueError(f"--allow-path {folder}: not a folder")
            allowed.append(resolved)
        if output_root is not None and not Path(output_root).is_dir():
            raise ValueError(f"the output folder {output_root} is not a folder")
        return cls(tuple(allowed), None if output_root is None else Path(output_root))

    def open_request(self, graph: Graph, inputs: Mapping[str, Any]) -> RequestFiles:
        """`inputs` (a request's raw inputs) with its file inputs checked and its output files
        placed. Close the result when the request is done.

        Raises:
            ApiError: 400 for an input file outside the allowed folders (or any, without
                one), or an output file the client named.
        """
        roles = {i.name: role for i in graph.inputs if (role := file_role(i.type)) is not None}
        request = RequestFiles(dict(inputs))
        try:
            for name, role in roles.items():
                if isinstance(role, InputFile):
                    self._check_input(request, name)
                else:
                    self._place_output(request, name, role)
        except BaseException:
            request.close()
            raise
        return request

    def _check_input(self, request: RequestFiles, name: str) -> None:
        value = request.inputs.get(name)
        if value is None or value == "":
            return
        if not self.allowed:
            raise ApiError(400, f"input '{name}' is a file on the server, and this server opens "
                                "no file its clients name (its operator may allow a folder "
                                "with --allow-path DIR)", param=f"inputs.{name}")
        if isinstance(value, str):
            for root in self.allowed:
                try:
                    resolved = os.path.realpath(os.path.join(root, value))
                except (ValueError, OSError):  # a NUL byte, a path too long
                    break
                if os.path.commonpath([resolved, root]) == str(root):
                    request.inputs[name] = resolved
                    return
        raise ApiError(400, f"input '{name}' must name a file under a folder this server allows "
                            "(--allow-path)", param=f"inputs.{name}")

    def _place_output(self, request: RequestFiles, name: str, role: OutputFile) -> None:
        if request.inputs.get(name) not in (None, ""):
            raise ApiError(400, f"input '{name}' is a file the server writes: over HTTP the "
                                f"server picks where, and sends the file back in the answer's "
                                f"\"{FILES_KEY}\"; leave '{name}' out", param=f"inputs.{name}")
        if request.folder is None:
            request.folder = Path(tempfile.mkdtemp(prefix="omni-request-",
                                                   dir=self.output_root))
        path = request.folder / f"{name}{role.suffix}"
        request.inputs[name] = str(path)
        request.outputs[name] = path


@dataclass
class RequestFiles:
    """One request's inputs after the policy, and the output files it will send back."""

    inputs: dict[str, Any]
    folder: Path | None = None
    outputs: dict[str, Path] = field(default_factory=dict)

    async def collect(self) -> dict[str, Any]:
        """The output files the graph wrote, by input name: ``{"filename", "bytes",
        "data"}`` (base64), read in a worker thread.

        Raises:
            ApiError: 500 for a file over `MAX_OUTPUT_FILE_BYTES`.
        """
        if not self.outputs:
            return {}
        return await anyio.to_thread.run_sync(self._read)

    def _read(self) -> dict[str, Any]:
        found = {}
        for name, path in self.outputs.items():
            if not path.is_file():
                continue  # the graph wrote none this time
            size = path.stat().st_size
            if size > MAX_OUTPUT_FILE_BYTES:
                raise ApiError(500, f"the output file '{name}' has {size} bytes, more than "
                                    f"the {MAX_OUTPUT_FILE_BYTES} an answer carries")
            found[name] = {"filename": path.name, "bytes": size,
                           "data": base64.b64encode(path.read_bytes()).decode("ascii")}
        return found

    def rewrite(self, value: Any) -> Any:
        """`value` (JSON-able) with every string that names an output file's path replaced by
        the file's name (the answer names no server path)."""
        if not self.outputs:
            return value
        names = {}
        for path in self.outputs.values():
            names[str(path)] = path.name
            names[os.path.realpath(path)] = path.name
        return _replace_strings(value, names)

    def close(self) -> None:
        """Remove the request's folder and what is in it."""
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def _replace_strings(value: Any, names: Mapping[str, str]) -> Any:
    """`value` (JSON-able: dicts, lists, scalars) with the strings in `names` replaced."""
    if isinstance(value, str):
        return names.get(value, value)
    if isinstance(value, dict):
        return {k: _replace_strings(v, names) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace_strings(v, names) for v in value]
    return value
