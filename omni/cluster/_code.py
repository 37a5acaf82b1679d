"""Naming a node's code so that a cluster worker can run it.

A class node travels as a `CodeRef`: its module's name, file path, source text and digest, and
the class's qualified name. The worker resolves it to the same class: the module already loaded
under that name with the same digest, else the file at that path if its digest matches, else
the shipped source. Nothing is unpickled; the source runs as a module, like the graph file
`omni run` loads (its ``if __name__ == "__main__"`` block does not run). Only members holding
the cluster token can send it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from omni.cluster.errors import LayoutMismatch
from omni.transport.values import types

__all__ = ["CodeRef", "check_kv_layout", "code_ref", "module_kv_layout", "resolve"]


class CodeRef(msgspec.Struct, frozen=True):
    module: str
    qualname: str
    path: str
    source: str
    digest: str


_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}  # digest -> module, for sources loaded here


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def code_ref(obj: Any) -> CodeRef:
    """The `CodeRef` of a module-level class or function.

    Raises:
        ValueError: it is defined inside a function, or its module has no source file.
    """
    qualname = obj.__qualname__
    if "<locals>" in qualname:
        raise ValueError(f"{qualname} is defined inside a function: a cluster worker can only "
                         "load classes defined at a module's top level")
    module = sys.modules.get(obj.__module__)
    path = getattr(module, "__file__", None)
    if path is None or not Path(path).is_file():
        raise ValueError(f"{qualname}: its module {obj.__module__!r} has no source file to send "
                         "to cluster workers")
    source = Path(path).read_text()
    return CodeRef(obj.__module__, qualname, str(Path(path).resolve()), source, _digest(source))


def module_kv_layout(obj: Any) -> dict[str, Any] | None:
    """The ``KV_LAYOUT`` that `obj`'s module defines at its top level, as a `LayoutSpec`'s
    fields (None when it defines none). Why: a graph file computes it as it is imported, from
    its environment (``OMNI_MODEL``), which does not travel with its code; a worker compares
    its own import's with the driver's."""
    target = getattr(obj, "cls", obj)  # an @omni.node class is a NodeClass
    layout = getattr(sys.modules.get(target.__module__), "KV_LAYOUT", None)
    to_spec = getattr(layout, "to_spec", None)
    return None if to_spec is None else msgspec.structs.asdict(to_spec())


def check_kv_layout(obj: Any, driver_layout: dict[str, Any] | None, path: str,
                    worker: str) -> None:
    """Refuse `obj` when its module, imported on `worker`, defines another ``KV_LAYOUT`` than
    the driver's import did (`driver_layout`, from `module_kv_layout` there): the code is the
    same, so the environment it reads differs.

    Raises:
        LayoutMismatch: naming the file (`path`), both layouts and what to set.
    """
    here = module_kv_layout(obj)
    if here == driver_layout:
        return
    raise LayoutMismatch(
        f"KV_LAYOUT of {path} is {_layout_text(driver_layout)} on the driver but "
        f"{_layout_text(here)} on worker '{worker}': a graph file's code travels to the "
        "workers, its environment does not; start `omni cluster join` (or `ray start`) with "
        "the variables the file reads (such as OMNI_MODEL) set as for the driver")


def _layout_text(spec: dict[str, Any] | None) -> str:
    """A `LayoutSpec`'s fields as ``num_layers=2 num_kv_heads=2 ...``, or ``none``."""
    if spec is None:
        return "none"
    return " ".join(f"{name}={value}" for name, value in spec.items())


def resolve(ref: CodeRef) -> Any:
    """The object `ref` names, loading its module in this process if needed.

    Raises:
        ValueError: the digest does not match the source, or the module lacks the name.
        Exception: whatever running the module's source raises.
    """
    if _digest(ref.source) != ref.digest:
        raise ValueError(f"code for {ref.qualname} does not match its digest")
    module = _module(ref)
    types.alias(ref.module, module)  # its dataclasses travel under the sender's module name
    obj: Any = module
    for part in ref.qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise ValueError(f"module {ref.module!r} has no {ref.qualname!r}")
    return obj


def _module(ref: CodeRef) -> ModuleType:
    with _lock:
        existing = sys.modules.get(ref.module)
        if existing is not None and _file_digest(getattr(existing, "__file__", None)) == ref.digest:
            return existing
        if ref.digest in _loaded:
            return _loaded[ref.digest]
        on_disk = _file_digest(ref.path) == ref.digest
        if on_disk and ref.module != "__main__" and ref.module not in sys.modules:
            # importable here as the sender imported it: import it so (a package's module
            # runs after its package, whose own imports may name it)
            imported = _import(ref.module)
            if _file_digest(getattr(imported, "__file__", None)) == ref.digest:
                _loaded[ref.digest] = imported
                return imported
        name = ref.module if ref.module != "__main__" and ref.module not in sys.modules \
            else f"_omni_remote_{ref.digest[:16]}"
        spec = importlib.util.spec_from_loader(name, loader=None,
                                               origin=ref.path if on_disk else None)
        module = importlib.util.module_from_spec(spec)
        module.__file__ = ref.path
        folder = str(Path(ref.path).parent)
        if on_disk and folder not in sys.path:
            sys.path.insert(0, folder)  # sibling imports work as they did for the sender
        sys.modules[name] = module  # dataclasses and typing look the module up by name
        try:
            exec(compile(ref.source, ref.path, "exec"), module.__dict__)
        except BaseException:
            del sys.modules[name]
            raise
        _loaded[ref.digest] = module
        return module


def _import(name: str) -> ModuleType | None:
    """Module `name` imported as Python imports it; None when it is not importable here."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _file_digest(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return _digest(Path(path).read_text())
    except (OSError, UnicodeDecodeError):
        return None
