"""Load a graph file as a module and pick the graph to use from it.

A graph file is plain Python: the CLI imports it under a unique module name (so that two files
called ``pipeline.py`` do not collide) with its folder on ``sys.path`` (so that sibling imports
work), then looks for `omni.Graph` objects among its module-level names.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import NoReturn

from cli._errors import CliError
from omni import Graph, GraphError, Node
from omni.graph import NodeClass

__all__ = ["find_graphs", "graphs_to_serve", "load_graph", "load_module", "select_graph"]


def load_graph(path: str, name: str | None) -> Graph:
    """Load the file at `path` and return its graph called `name` (or its only graph).

    Raises:
        CliError: the file does not load, or names no single graph (see `select_graph`).
    """
    return select_graph(load_module(path), name, path)


def load_module(path: str) -> ModuleType:
    """Import the Python file at `path` as a new module.

    Raises:
        CliError: no such file, a syntax error (with file:line), a `GraphError` raised while
            the file builds its graphs, or any other exception raised while importing it.
    """
    file = Path(path)
    if not file.exists():
        raise CliError(f"no such file: {path}")
    if not file.is_file():
        raise CliError(f"not a file: {path}")
    resolved = file.resolve()
    folder = str(resolved.parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    name = _module_name(resolved)
    loader = importlib.machinery.SourceFileLoader(name, str(resolved))
    spec = importlib.util.spec_from_file_location(name, resolved, loader=loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses, pickling and typing look the module up by name
    try:
        loader.exec_module(module)
    except BaseException as exc:
        del sys.modules[name]
        _raise_load_error(exc, path, resolved)
    return module


def _module_name(resolved: Path) -> str:
    stem = re.sub(r"\W", "_", resolved.stem)
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    return f"_omni_file_{stem}_{digest}"


def _raise_load_error(exc: BaseException, path: str, resolved: Path) -> NoReturn:
    if isinstance(exc, KeyboardInterrupt):
        raise exc
    if isinstance(exc, GraphError):
        raise CliError(str(exc)) from exc
    if isinstance(exc, SyntaxError):
        where = _display(exc.filename, path, resolved)
        raise CliError(f"{where}:{exc.lineno}: syntax error: {exc.msg}") from exc
    line = _line_in_file(exc, resolved)
    at = f" at line {line}" if line is not None else ""
    detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    raise CliError(f"loading {path} failed{at}: {detail}") from exc


def _line_in_file(exc: BaseException, resolved: Path) -> int | None:
    """The line of the loaded file that was running when `exc` was raised (innermost)."""
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename == str(resolved):
            return frame.lineno
    return None


def _display(filename: str | None, path: str, resolved: Path) -> str:
    """`path` as the user typed it for the loaded file; other files relative to the cwd."""
    if not filename or filename == str(resolved):
        return path
    try:
        relative = os.path.relpath(filename)
    except ValueError:  # another drive on Windows
        return filename
    return filename if relative.startswith("..") else relative


def find_graphs(module: ModuleType) -> dict[str, Graph]:
    """The module's graphs by variable name, in definition order, each graph once."""
    found: dict[str, Graph] = {}
    seen: set[int] = set()
    for name, value in vars(module).items():
        if isinstance(value, Graph) and not name.startswith("_") and id(value) not in seen:
            seen.add(id(value))
            found[name] = value
    return found


def select_graph(module: ModuleType, name: str | None, path: str) -> Graph:
    """The graph (or node, wrapped with `Graph.of`) called `name`; without a name, the graph.

    Without a name, graphs defined in the file itself win over graphs it imports, and plain
    graphs over those marked as an OpenAI endpoint (`omni.serve.openai`: they take a
    request object, not inputs a command line gives).

    Raises:
        CliError: no graph, several graphs and no name, or no graph or node with that name.
    """
    graphs = find_graphs(module)
    if name is None:
        own = {k: g for k, g in graphs.items()
               if getattr(g, "__module__", None) == module.__name__} or graphs
        own = {k: g for k, g in own.items()
               if getattr(g, "openai_endpoint", None) is None} or own
        if len(own) == 1:
            return next(iter(own.values()))
        if not own:
            raise CliError(f"{path} defines no graph (decorate a function with @omni.graph)")
        raise CliError(f"{path} defines several graphs; name one: {', '.join(own)}")
    return _named(module, graphs, name, path)


def graphs_to_serve(module: ModuleType, names: Sequence[str], path: str) -> dict[str, Graph]:
    """The graphs ``omni serve`` serves: those `names` (`select_graph` each), else every one.

    Raises:
        CliError: a name that names nothing, or a file that defines no graph.
    """
    if not names:
        graphs = find_graphs(module)
        if not graphs:
            raise CliError(f"{path} defines no graph to serve")
        return graphs
    return {name: select_graph(module, name, path) for name in names}


def _named(module: ModuleType, graphs: dict[str, Graph], name: str, path: str) -> Graph:
    available = ", ".join(graphs) or "none"
    target = vars(module).get(name)
    if target is None:
        by_graph_name = [g for g in graphs.values() if g.name == name]
        if by_graph_name:
            return by_graph_name[0]
        raise CliError(f"{path} has no graph named '{name}' (graphs: {available})")
    if isinstance(target, Graph):
        return target
    if isinstance(target, Node):
        return Graph.of(target)
    if isinstance(target, NodeClass):
        try:
            return Graph.of(target)  # binds the constructor's defaults
        except GraphError as exc:  # its location would be this file: say it in the user's terms
            raise CliError(f"'{name}' in {path} is a class node that needs constructor "
                           f"arguments ({exc.message}); bind them in an @omni.graph") from exc
    raise CliError(f"'{name}' in {path} is not a graph or a node but a "
                   f"{type(target).__name__} (graphs: {available})")
