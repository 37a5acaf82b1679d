"""The pipeline DSL: `@node`, `@graph`, `switch` and the symbolic `Ref`.

A graph body runs once, at decoration time, with a `Ref` for every input. Each node call
inside it records a `Call` in the active `Trace` and returns a `Ref` to the call's future
value; nothing runs. The finished trace is validated (`validate.py`) and compiled into a
`Plan` (`_plan.py`) so that a request does no tracing, binding or type checking.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from omni.graph._calls import Call, GetItem, SwitchSpec
from omni.graph._inputs import convert_inputs, input_converters
from omni.graph._node import (
    Node,
    NodeClass,
    NodeOptions,
    Ref,
    _definition_location,
    _resolve_hints,
    current_trace,
    node,
    user_location,
)
from omni.graph._plan import compile_plan
from omni.graph.errors import GraphError
from omni.graph.validate import check_call, check_switch, stream_item_type, validate_graph

__all__ = ["Call", "Graph", "Node", "NodeClass", "NodeOptions", "Ref", "Trace", "graph", "node",
           "switch"]


# ---------------------------------------------------------------------------------------------
# Tracing


@dataclass(frozen=True)
class GraphInput:
    """One input of a graph: its name, annotation and default (`inspect.Parameter.empty`)."""

    name: str
    type: Any
    default: Any


@dataclass
class Trace:
    """The recording a graph body makes while it is traced."""

    graph_name: str
    inputs: list[GraphInput] = field(default_factory=list)
    calls: list[Call] = field(default_factory=list)
    refs: list[Ref] = field(default_factory=list)
    _names: dict[str, int] = field(default_factory=dict)

    @property
    def num_inputs(self) -> int:
        return len(self.inputs)

    def add_input(self, name: str, type_: Any, default: Any) -> Ref:
        self.inputs.append(GraphInput(name, type_, default))
        ref = Ref(self, len(self.refs), name, type_, stream=False)
        self.refs.append(ref)
        self._names[name] = 1
        return ref

    def unique_name(self, base: str) -> str:
        count = self._names.get(base, 0) + 1
        self._names[base] = count
        return base if count == 1 else f"{base}_{count}"

    def _record(self, name: str, target: Any, args: tuple, kwargs: dict[str, Any],
                location: str, type_: Any, stream: bool) -> Ref:
        for value in itertools.chain(args, kwargs.values()):
            _check_refs_belong(value, self, name, location)
        slot = len(self.refs)
        ref = Ref(self, slot, name, type_, stream)
        self.refs.append(ref)
        self.calls.append(Call(slot, name, target, args, kwargs, location, ref))
        return ref

    def add_call(self, target: Any, args: tuple, kwargs: dict[str, Any], location: str) -> Any:
        if isinstance(target, Graph):
            return target.inline_into(self, args, kwargs, location)

        check_call(target, args, kwargs, location)
        return self._record(self.unique_name(target.name), target, args, kwargs, location,
                            _output_type(target), target.streaming)

    def add_getitem(self, ref: Ref, key: Any, location: str) -> Ref:
        if ref.stream:
            raise GraphError(f"cannot index the stream '{ref.name}'", location=location)
        return self._record(self.unique_name(f"{ref.name}[{key!r}]"), GetItem(key), (ref,), {},
                            location, None, False)

    def add_switch(self, selector: Any, spec: SwitchSpec, args: tuple, kwargs: dict[str, Any],
                   location: str) -> Ref:
        return self._record(self.unique_name("switch"), spec, (selector, *args), kwargs,
                            location, spec.type, spec.streaming)


def _output_type(n: Node) -> Any:

    ret = n.hints.get("return")
    return stream_item_type(ret) if n.streaming else ret


def _check_refs_belong(value: Any, trace: Trace, name: str, location: str) -> None:
    if isinstance(value, Ref):
        if value.trace is not trace:
            raise GraphError(f"'{value.name}' belongs to another graph ({value.trace.graph_name})",
                             node=name, location=location)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _check_refs_belong(v, trace, name, location)
    elif isinstance(value, dict):
        for v in value.values():
            _check_refs_belong(v, trace, name, location)


# ---------------------------------------------------------------------------------------------
# Graphs


class Graph:
    """A traced, validated and compiled pipeline; made by `@omni.graph` or `Graph.of(node)`.

    Attributes: `name`, `inputs` (`GraphInput`s), `calls` (the recorded `Call`s), `output` (a
    `Ref`, or a dict of output name to `Ref`), `plan` (what the scheduler runs).
    """

    def __init__(self, fn: Callable[..., Any] | None, name: str, trace: Trace, output: Any,
                 location: str, signature: inspect.Signature):

        self.fn = fn
        self.name = name
        self.trace = trace
        self.inputs = tuple(trace.inputs)
        self.calls = tuple(trace.calls)
        self.output = output
        self.location = location
        self.signature = signature
        if fn is not None:
            functools.update_wrapper(self, fn, updated=())
        validate_graph(self)
        self.plan = compile_plan(self)
        self._converters: dict[str, Callable[[Any], Any]] | None = None

    @classmethod
    def of(cls, target: Node | Graph) -> Graph:
        """A one-node graph, so that a node can be run, or used as a switch branch, directly."""
        if isinstance(target, Graph):
            return target
        if isinstance(target, NodeClass):
            target = target()
        if not isinstance(target, Node):
            raise TypeError(f"expected a node or a graph, got {target!r}")
        return _trace_graph(lambda *a, **k: target(*a, **k), target.name, target.signature,
                            target.hints, target.location, fn=None)

    @property
    def streaming_outputs(self) -> tuple[str, ...]:
        """Names of the outputs whose values arrive as streams."""
        return tuple(name for name, ref in self.output_refs() if ref.stream)

    @property
    def output_type(self) -> Any:
        return self.output.type if isinstance(self.output, Ref) else dict

    @property
    def is_streaming(self) -> bool:
        return isinstance(self.output, Ref) and self.output.stream

    def output_refs(self) -> list[tuple[str, Ref]]:
        """(name, Ref) pairs; a single-output graph's output is named "output"."""
        if isinstance(self.output, Ref):
            return [("output", self.output)]
        return list(self.output.items())

    def convert_inputs(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """`values` checked and converted to the graph's annotated input types, for inputs that
        arrive as JSON (``omni run``, a server): an object becomes the dataclass a parameter is
        annotated with, an array a tuple, 3 a float where a float is expected; ``"abc"`` for
        an ``int`` is refused before anything runs. `Runtime.run` takes values as given.

        Raises:
            InputError: an unknown or missing input, or a value that does not fit its input's
                type (naming the input, and where inside the value).
        """
        self.plan.bind(values)  # unknown and missing names
        if self._converters is None:
            self._converters = input_converters(self.inputs)
        return convert_inputs(self.name, self._converters, values)

    def inline_into(self, trace: Trace, args: tuple, kwargs: dict[str, Any],
                    location: str) -> Any:
        """Copy this graph's calls into `trace` (a graph used as a node); return its output."""
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise GraphError(f"bad arguments for graph '{self.name}': {exc}", node=self.name,
                             location=location) from None
        bound.apply_defaults()
        mapping: dict[int, Any] = {i: bound.arguments[inp.name]
                                   for i, inp in enumerate(self.inputs)}
        for c in self.calls:
            new_args = _remap(c.args, mapping)
            new_kwargs = _remap(c.kwargs, mapping)
            name = trace.unique_name(f"{self.name}.{c.name}")
            mapping[c.slot] = trace._record(name, c.target, new_args, new_kwargs, c.location,
                                            c.ref.type, c.ref.stream)
        return _remap(self.output, mapping)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = current_trace.get()
        if trace is None:
            raise TypeError(f"graph '{self.name}' runs with omni.run(graph, ...) or "
                            "rt.run(graph, ...); calling it is only for other graph bodies")
        return self.inline_into(trace, args, kwargs, user_location(2))

    def __repr__(self) -> str:
        return f"<omni.Graph {self.name} nodes={len(self.calls)} inputs={len(self.inputs)}>"


def _remap(value: Any, mapping: dict[int, Any]) -> Any:
    if isinstance(value, Ref):
        return mapping[value.slot]
    if isinstance(value, tuple):
        return tuple(_remap(v, mapping) for v in value)
    if isinstance(value, list):
        return [_remap(v, mapping) for v in value]
    if isinstance(value, dict):
        return {k: _remap(v, mapping) for k, v in value.items()}
    return value


_tracing_stack: list[str] = []


def _trace_graph(body: Callable[..., Any], name: str, signature: inspect.Signature,
                 hints: Mapping[str, Any], location: str, fn: Callable[..., Any] | None) -> Graph:
    if name in _tracing_stack:
        raise GraphError("a graph cannot call itself (cycle)", node=name, location=location)
    trace = Trace(name)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise GraphError(f"graph inputs must be named; '{p.name}' is *args/**kwargs",
                             node=name, location=location)
        ref = trace.add_input(p.name, hints.get(p.name), p.default)
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = ref
        else:
            args.append(ref)
    token = current_trace.set(trace)
    _tracing_stack.append(name)
    try:
        output = body(*args, **kwargs)
    finally:
        _tracing_stack.pop()
        current_trace.reset(token)
    output = _check_output(output, name, location)
    return Graph(fn, name, trace, output, location, signature)


def _check_output(output: Any, name: str, location: str) -> Any:
    if isinstance(output, Ref):
        return output
    if isinstance(output, Mapping) and output:
        bad = [k for k, v in output.items() if not isinstance(v, Ref) or not isinstance(k, str)]
        if not bad:
            return dict(output)
        raise GraphError(f"output {bad[0]!r} is not a Ref; outputs must be values that nodes or "
                         "inputs produce", node=name, location=location)
    raise GraphError(f"a graph must return a Ref or a non-empty dict of Refs, got {output!r}",
                     node=name, location=location)


def graph(fn: Callable[..., Any] | None = None, /, *, name: str | None = None) -> Any:
    """Trace `fn` once with a symbolic `Ref` per parameter and build a `Graph`.

    The body only wires nodes: calling a node returns a `Ref`. Return a single `Ref`, or a dict
    of output name to `Ref`. The graph is validated and compiled here, so every `GraphError` is
    raised at decoration time.
    """
    if fn is None:
        return functools.partial(graph, name=name)
    graph_name = name or fn.__name__
    return _trace_graph(fn, graph_name, inspect.signature(fn), _resolve_hints(fn, extras=True),
                        _definition_location(fn), fn)


def switch(selector: Any, branches: Mapping[Any, Any], /, *args: Any, **kwargs: Any) -> Ref:
    """Route to one branch by the selector's value: only the chosen branch runs.

    `branches` maps selector values to nodes or graphs, all with the same signature; each is
    called with ``*args, **kwargs``. A selector value with no branch fails that request with
    `omni.RouteError`.
    """
    location = user_location(2)
    trace = current_trace.get()
    if trace is None:
        raise GraphError("omni.switch is only for @omni.graph bodies", location=location)

    if not isinstance(branches, Mapping) or not branches:
        raise GraphError("switch branches must be a non-empty dict of value -> node or graph",
                         node="switch", location=location)
    graphs: dict[Any, Graph] = {}
    for key, target in branches.items():
        if isinstance(target, NodeClass):
            raise GraphError(f"branch {key!r} is the class node {target.name}; bind it first: "
                             f"{target.name}()", node="switch", location=location)
        if not isinstance(target, (Node, Graph)):
            raise GraphError(f"branch {key!r} is {target!r}, not a node or graph",
                             node="switch", location=location)
        graphs[key] = Graph.of(target)
    streaming, type_ = check_switch(branches, graphs, args, kwargs, location)
    spec = SwitchSpec(graphs, streaming, type_)
    return trace.add_switch(selector, spec, args, kwargs, location)

