"""Build-time checks: arguments that bind, types that connect, switch signatures, no cycles.

Everything here runs while a graph is traced or right after, never while it serves, and every
failure is a `GraphError` naming the node and the ``file:line`` of the call that built the
bad edge. Type checks are deliberately lenient: an annotation they cannot reason about
(a TypeVar, a Protocol, a string that does not resolve) connects to anything.
"""

from __future__ import annotations

import collections.abc as cabc
import inspect
import types
import typing
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from omni.graph._calls import Call
from omni.graph._node import Node, Ref
from omni.graph.errors import GraphError
from omni.graph.marks import CacheSalt, InputFile, OutputFile

if TYPE_CHECKING:
    from omni.graph.dsl import Graph

__all__ = ["bind_call", "check_call", "check_switch", "compatible", "is_stream_param",
           "stream_item_type", "validate_graph"]

_STREAM_ORIGINS = (cabc.AsyncIterator, cabc.AsyncIterable, cabc.AsyncGenerator)
_NUMERIC_TOWER = {int: (float, complex), float: (complex,)}


def is_stream_param(annotation: Any) -> bool:
    """True for ``AsyncIterator[T]``-like annotations: the parameter receives items as they come."""
    return typing.get_origin(annotation) in _STREAM_ORIGINS or annotation in _STREAM_ORIGINS


def stream_item_type(annotation: Any) -> Any:
    """``T`` of ``AsyncIterator[T]`` (or AsyncIterable / AsyncGenerator); None if unknown."""
    if typing.get_origin(annotation) in _STREAM_ORIGINS:
        args = typing.get_args(annotation)
        return args[0] if args else None
    return None


def type_name(annotation: Any) -> str:
    """An annotation as text: ``int``, ``list[str]``; an ``Annotated`` one as its type with
    Omni's marks in brackets (``str (input file)``), other metadata left out."""
    if annotation is None:
        return "Any"
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
        marks = [f" ({m})" for m in metadata if isinstance(m, InputFile | OutputFile | CacheSalt)]
        return type_name(base) + "".join(marks)
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    return repr(annotation).replace("typing.", "").replace("collections.abc.", "")


def compatible(src: Any, dst: Any) -> bool:
    """Whether a value annotated `src` may flow into a parameter annotated `dst`."""
    if src is None or dst is None or src is Any or dst is Any or dst is object:
        return True
    if isinstance(src, (typing.TypeVar, str)) or isinstance(dst, (typing.TypeVar, str)):
        return True
    src, dst = _strip_annotated(src), _strip_annotated(dst)
    if _is_union(src):  # each value it may be must fit (checked first: X | None into X | None)
        return all(compatible(member, dst) for member in typing.get_args(src))
    if _is_union(dst):
        return any(compatible(src, member) for member in typing.get_args(dst))
    if src is type(None) or dst is type(None):
        return src is dst
    if typing.get_origin(src) is typing.Literal:
        values = typing.get_args(src)
        if typing.get_origin(dst) is typing.Literal:
            return set(values) <= set(typing.get_args(dst))
        return all(compatible(type(v), dst) for v in values)
    if typing.get_origin(dst) is typing.Literal:
        return True  # a str may hold one of the literals: only known when it runs
    src_origin = typing.get_origin(src) or src
    dst_origin = typing.get_origin(dst) or dst
    if not (isinstance(src_origin, type) and isinstance(dst_origin, type)):
        return True
    if not _is_subclass(src_origin, dst_origin):
        return False
    return _args_compatible(src, dst)


def _strip_annotated(t: Any) -> Any:
    return typing.get_args(t)[0] if typing.get_origin(t) is typing.Annotated else t


def _is_union(t: Any) -> bool:
    return typing.get_origin(t) in (typing.Union, types.UnionType)


def _is_subclass(src: type, dst: type) -> bool:
    if dst in _NUMERIC_TOWER.get(src, ()):
        return True
    try:
        return issubclass(src, dst)
    except TypeError:  # protocols that are not runtime-checkable, and friends
        return True


def _args_compatible(src: Any, dst: Any) -> bool:
    src_args, dst_args = typing.get_args(src), typing.get_args(dst)
    if not src_args or not dst_args or Ellipsis in src_args or Ellipsis in dst_args:
        return True
    if len(src_args) != len(dst_args):
        return True  # e.g. tuple[int, int] into Sequence[int]: do not guess
    return all(compatible(s, d) for s, d in zip(src_args, dst_args, strict=True))


def _fail(message: str, name: str, location: str) -> typing.NoReturn:
    raise GraphError(message, node=name, location=location)


def bind_call(signature: inspect.Signature, args: tuple, kwargs: Mapping[str, Any], name: str,
              location: str) -> inspect.BoundArguments:
    """Bind a call's arguments the way Python would, with errors that name the node."""
    params = signature.parameters
    takes_var_kw = any(p.kind == p.VAR_KEYWORD for p in params.values())
    for key in kwargs:
        if key not in params and not takes_var_kw:
            names = ", ".join(params) or "none"
            _fail(f"unknown argument '{key}' (parameters: {names})", name, location)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        missing = [p.name for p in params.values()
                   if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
                   and p.name not in kwargs]
        positional = [p for p in params.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if missing and len(args) < len(positional) + 1:
            _fail(f"missing argument '{missing[min(len(args), len(missing) - 1)]}'", name,
                  location)
        _fail(f"bad arguments: {exc}", name, location)
    return bound


def _check_edge(ref: Ref, param: inspect.Parameter, dst: Any, name: str, location: str) -> None:
    if is_stream_param(dst):
        if not ref.stream:
            _fail(f"argument '{param.name}' expects a stream ({type_name(dst)}) but '{ref.name}' "
                  "is not a streaming node", name, location)
        if not compatible(ref.type, stream_item_type(dst)):
            _fail(f"argument '{param.name}' expects {type_name(dst)} but '{ref.name}' streams "
                  f"{type_name(ref.type)}", name, location)
        return
    if ref.stream:
        delivered = list if ref.type is None else list[ref.type]  # type: ignore[name-defined]
        if not compatible(delivered, dst):
            _fail(f"argument '{param.name}' expects {type_name(dst)} but '{ref.name}' is a stream "
                  f"of {type_name(ref.type)}, delivered as {type_name(delivered)}; annotate it "
                  f"AsyncIterator[{type_name(ref.type)}] to receive items as they come",
                  name, location)
        return
    if not compatible(ref.type, dst):
        _fail(f"argument '{param.name}' expects {type_name(dst)} but '{ref.name}' produces "
              f"{type_name(ref.type)}", name, location)


def check_arguments(signature: inspect.Signature, hints: Mapping[str, Any], args: tuple,
                    kwargs: Mapping[str, Any], name: str, location: str) -> None:
    """Bind the arguments and check that every Ref's type connects to its parameter."""
    bound = bind_call(signature, args, kwargs, name, location)
    for pname, value in bound.arguments.items():
        param = signature.parameters[pname]
        dst = hints.get(pname)
        values = value if param.kind == param.VAR_POSITIONAL else (
            value.values() if param.kind == param.VAR_KEYWORD else (value,))
        for v in values:
            if isinstance(v, Ref):
                _check_edge(v, param, dst, name, location)
            elif is_stream_param(dst):
                _fail(f"argument '{pname}' expects a stream; pass a streaming node's output",
                      name, location)


def check_call(target: Node, args: tuple, kwargs: Mapping[str, Any], location: str) -> None:
    """All build-time checks of one node call in a graph body."""
    check_arguments(target.signature, target.hints, args, kwargs, target.name, location)


def _branch_signature(g: Graph) -> tuple:
    params = tuple((p.name, p.kind, g_input.type)
                   for p, g_input in zip(g.signature.parameters.values(), g.inputs, strict=True))
    return params, g.output_type, g.is_streaming


def _describe(g: Graph) -> str:
    params = ", ".join(f"{p}: {type_name(t)}" if t is not None else p for p, _, t in
                       _branch_signature(g)[0])
    ret = _branch_signature(g)[1]
    stream = "stream of " if g.is_streaming else ""
    return f"{g.name}({params}) -> {stream}{type_name(ret)}"


def check_switch(raw: Mapping[Any, Any], graphs: Mapping[Any, Graph], args: tuple,
                 kwargs: Mapping[str, Any], location: str) -> tuple[bool, Any]:
    """Check that every branch has one signature; return (streaming, output type)."""
    keys = list(graphs)
    first = graphs[keys[0]]
    for key in keys[1:]:
        other = graphs[key]
        if not _same_signature(_branch_signature(first), _branch_signature(other)):
            _fail(f"switch branches have different signatures: {keys[0]!r} is "
                  f"{_describe(first)}, {key!r} is {_describe(other)}", "switch", location)
    hints = {i.name: i.type for i in first.inputs if i.type is not None}
    check_arguments(first.signature, hints, args, kwargs, "switch", location)
    return first.is_streaming, first.output_type


def _same_signature(a: tuple, b: tuple) -> bool:
    (a_params, a_ret, a_stream), (b_params, b_ret, b_stream) = a, b
    if a_stream != b_stream or len(a_params) != len(b_params):
        return False
    for (a_name, a_kind, a_type), (b_name, b_kind, b_type) in zip(a_params, b_params,
                                                                  strict=True):
        if a_name != b_name or a_kind != b_kind:
            return False
        if a_type is not None and b_type is not None and a_type != b_type:
            return False
    return a_ret is None or b_ret is None or a_ret == b_ret


# ---------------------------------------------------------------------------------------------
# Whole-graph checks


def _refs_in(value: Any) -> list[Ref]:
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, (list, tuple)):
        return [r for v in value for r in _refs_in(v)]
    if isinstance(value, dict):
        return [r for v in value.values() for r in _refs_in(v)]
    return []


def call_dependencies(c: Call) -> list[Ref]:
    """Every Ref a call reads, in argument order."""
    return _refs_in(c.args) + _refs_in(c.kwargs)


def stream_arguments(c: Call) -> set[str]:
    """Names of the parameters of `c` that receive a stream as it is produced."""
    if not isinstance(c.target, Node):
        return set()
    bound = c.target.signature.bind(*c.args, **c.kwargs)
    return {name for name, value in bound.arguments.items()
            if isinstance(value, Ref) and value.stream
            and is_stream_param(c.target.hints.get(name))}


def validate_graph(g: Graph) -> None:
    """Checks that need the whole graph: no cycles, and no stream consumer that would deadlock."""
    by_slot = {c.slot: c for c in g.calls}
    _check_acyclic(g, by_slot)
    ancestors: dict[int, set[int]] = {}
    for c in g.calls:  # calls are in trace order, which is a topological order
        deps = {r.slot for r in call_dependencies(c)}
        ancestors[c.slot] = set(deps).union(*(ancestors.get(d, set()) for d in deps))
    for c in g.calls:
        streamed = stream_arguments(c)
        if not streamed:
            continue
        bound = c.target.signature.bind(*c.args, **c.kwargs)
        _warn_if_teed(c, {n: bound.arguments[n] for n in sorted(streamed)})
        producers = {bound.arguments[n].slot for n in streamed}
        for pname, value in bound.arguments.items():
            if pname in streamed:
                continue
            for ref in _refs_in(value):
                upstream = ancestors.get(ref.slot, set()) | {ref.slot}
                blocked = producers & upstream
                if blocked:
                    producer = by_slot[blocked.pop()].name
                    _fail(f"argument '{pname}' waits for '{producer}' to finish while "
                          f"'{c.name}' consumes its stream; this would deadlock", c.name,
                          c.location)


def _warn_if_teed(c: Call, streams: Mapping[str, Ref]) -> None:
    """Say so when one stream feeds several parameters of `c`: each parameter sees every item
    (the stream is teed), but only a bounded number of items wait for the slower reader."""
    by_stream: dict[int, list[str]] = {}
    for name, ref in streams.items():
        by_stream.setdefault(id(ref), []).append(name)
    for names in by_stream.values():
        if len(names) > 1:
            message = (f"'{c.name}' reads one stream through parameters {', '.join(names)}: "
                       "each sees every item, but only a few items wait for the slower reader, "
                       "so reading one to its end before the other blocks on a longer stream "
                       "(read them side by side)")
            filename, _, line = (c.location or "").rpartition(":")
            if filename and line.isdigit():  # shown at the graph's own line
                warnings.warn_explicit(message, UserWarning, filename, int(line))
            else:
                warnings.warn(message, UserWarning, stacklevel=2)


def _check_acyclic(g: Graph, by_slot: Mapping[int, Call]) -> None:
    state: dict[int, int] = {}  # 1: on the current path, 2: done

    def visit(slot: int, path: list[str]) -> None:
        if state.get(slot) == 2 or slot not in by_slot:
            return
        c = by_slot[slot]
        if state.get(slot) == 1:
            cycle = " -> ".join([*path[path.index(c.name):], c.name])
            _fail(f"cycle: {cycle}", c.name, c.location)
        state[slot] = 1
        for ref in call_dependencies(c):
            visit(ref.slot, [*path, c.name])
        state[slot] = 2

    for slot in by_slot:
        visit(slot, [])
