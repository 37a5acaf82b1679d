"""The pipeline DSL: `@node`, `@graph`, `switch` and the symbolic `Ref`.

A graph body runs once, at decoration time, with a `Ref` for every input. Each node call
inside it records a `Call` in the active `Trace` and returns a `Ref` to the call's future
value; nothing runs. The finished trace is validated (`validate.py`) and compiled into a
`Plan` (`_plan.py`) so that a request does no tracing, binding or type checking.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import itertools
import os
import sys
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from omni.graph.errors import GraphError

__all__ = ["Call", "Graph", "Node", "NodeClass", "NodeOptions", "Ref", "Trace", "graph", "node",
           "switch"]

BalanceName = Literal["round_robin", "least_loaded", "power_of_two"]
NodeKind = Literal["function", "class"]

_OMNI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_current_trace: contextvars.ContextVar[Trace | None] = contextvars.ContextVar(
    "omni_trace", default=None)


def user_location(depth: int = 1) -> str:
    """``file:line`` of the innermost caller outside the omni package (for error messages)."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_code.co_filename.startswith(_OMNI_DIR):
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno}"


def _short_path(path: str) -> str:
    try:
        rel = os.path.relpath(path)
    except ValueError:  # another drive on Windows
        return path
    return path if rel.startswith("..") else rel


def _definition_location(obj: Any) -> str:
    try:
        return f"{_short_path(inspect.getsourcefile(obj) or '?')}:{inspect.getsourcelines(obj)[1]}"
    except (OSError, TypeError):
        return "<unknown>"


@dataclass(frozen=True)
class NodeOptions:
    """How the runtime runs a node. See `node` for the meaning of each option."""

    replicas: int = 1
    balance: Any = "round_robin"  # a BalanceName or an object with the Balancer protocol
    timeout: float | None = None
    retries: int = 0
    idempotent: bool = False
    concurrency: int | None = None
    max_queue: int = 256
    thread: bool = False

    def check(self, name: str) -> None:
        """Raise `ValueError` naming the first option that has no valid value."""
        if not isinstance(self.replicas, int) or self.replicas < 1:
            raise ValueError(f"node '{name}': replicas must be an integer >= 1, "
                             f"got {self.replicas!r}")
        if self.timeout is not None and not self.timeout > 0:
            raise ValueError(f"node '{name}': timeout must be > 0 seconds, got {self.timeout!r}")
        if not isinstance(self.retries, int) or self.retries < 0:
            raise ValueError(f"node '{name}': retries must be an integer >= 0, "
                             f"got {self.retries!r}")
        if self.retries and not self.idempotent:
            raise ValueError(f"node '{name}': retries={self.retries} needs idempotent=True "
                             "(a retried call runs the body again)")
        if self.concurrency is not None and (not isinstance(self.concurrency, int)
                                             or self.concurrency < 1):
            raise ValueError(f"node '{name}': concurrency must be an integer >= 1, "
                             f"got {self.concurrency!r}")
        if not isinstance(self.max_queue, int) or self.max_queue < 0:
            raise ValueError(f"node '{name}': max_queue must be an integer >= 0, "
                             f"got {self.max_queue!r}")
        if isinstance(self.balance, str):
            if self.balance not in typing.get_args(BalanceName):
                raise ValueError(f"node '{name}': unknown balance {self.balance!r}; choose one "
                                 f"of {', '.join(typing.get_args(BalanceName))} or pass a "
                                 "Balancer")
        elif not callable(getattr(self.balance, "choose", None)):
            raise ValueError(f"node '{name}': balance must be a name or an object with "
                             f"choose(replicas, call), got {self.balance!r}")

    @property
    def needs_pool(self) -> bool:
        """True when calls go through replicas (slots, queues, balancing)."""
        return self.replicas > 1 or self.concurrency is not None


class Node:
    """A node that can be called in a graph body: a function, or a class bound to its arguments.

    Attributes: `name`, `kind` ("function" or "class"), `target` (the function or class),
    `init_args`/`init_kwargs` (class nodes), `options`, `streaming` (the body is an async
    generator), `is_async` (False: a synchronous body, run in a worker thread when
    ``thread=True``), `signature` of the call and `hints` (its resolved annotations).
    """

    def __init__(self, target: Callable[..., Any], options: NodeOptions, name: str, *,
                 kind: NodeKind = "function", init_args: tuple = (),
                 init_kwargs: Mapping[str, Any] | None = None):
        self.target = target
        self.options = options
        self.name = name
        self.kind: NodeKind = kind
        self.init_args = init_args
        self.init_kwargs = dict(init_kwargs or {})
        body = target.__call__ if kind == "class" else target
        self.streaming = inspect.isasyncgenfunction(body)
        self.is_async = self.streaming or inspect.iscoroutinefunction(body)
        self.signature = _call_signature(body, skip_self=kind == "class")
        self.hints = _resolve_hints(body)
        self.location = _definition_location(target)
        self.deployment_key = _deployment_key(self)
        functools.update_wrapper(self, target, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = _current_trace.get()
        if trace is not None:
            return trace.add_call(self, args, kwargs, user_location(2))
        if self.kind == "class":
            raise TypeError(f"node '{self.name}' is a class node bound to its arguments; call it "
                            "inside an @omni.graph body, or run it with rt.run(node, ...)")
        return self.target(*args, **kwargs)  # the escape hatch: a plain call of the body

    def __repr__(self) -> str:
        kind = "stream " if self.streaming else ""
        return f"<omni.Node {kind}{self.kind} {self.name}>"


class NodeClass:
    """What `@omni.node` makes of a class: call it with constructor arguments to bind a `Node`.

    Binding builds no instance; the Runtime builds one per replica when it starts.
    """

    def __init__(self, cls: type, options: NodeOptions, name: str):
        self.cls = cls
        self.options = options
        self.name = name
        self._init_signature = inspect.signature(cls)
        functools.update_wrapper(self, cls, updated=())
        self._default = Node(cls, options, name, kind="class")

    def __call__(self, *args: Any, **kwargs: Any) -> Node:
        for value in itertools.chain(args, kwargs.values()):
            if _contains_ref(value):
                raise GraphError(f"constructor arguments must be constants, got a Ref; did you "
                                 f"mean {self.name}()(...)?", node=self.name,
                                 location=user_location(2))
        try:
            self._init_signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise GraphError(f"bad constructor arguments: {exc}", node=self.name,
                             location=user_location(2)) from None
        if not args and not kwargs:
            return self._default
        return Node(self.cls, self.options, self.name, kind="class", init_args=args,
                    init_kwargs=kwargs)

    def __repr__(self) -> str:
        return f"<omni.NodeClass {self.name}>"


def node(fn: Any = None, /, *, name: str | None = None, replicas: int = 1,
         balance: Any = "round_robin", timeout: float | None = None, retries: int = 0,
         idempotent: bool = False, concurrency: int | None = None, max_queue: int = 256,
         thread: bool = False) -> Any:
    """Make a function, async generator or class a pipeline node.

    Use bare (``@omni.node``) or with options (``@omni.node(replicas=2)``).

    Args:
        name: the node's name in graphs, errors and metrics (default: the function's name).
        replicas: instances of a class node (or parallel lanes of a function node).
        balance: "round_robin", "least_loaded", "power_of_two", or a `Balancer`.
        timeout: seconds one call may take; past it the request fails with a `NodeError`.
        retries: extra attempts after a failure; needs ``idempotent=True``. A streaming node is
            retried only if it had not produced an item yet.
        idempotent: the body may safely run again for the same inputs.
        concurrency: calls in flight per replica (default 1 for class nodes, unbounded for
            functions).
        max_queue: calls waiting per replica before callers wait for space (backpressure).
        thread: run a synchronous body in a worker thread (``trio.to_thread``) so a
            compute-heavy node does not freeze the event loop. A synchronous body without it
            runs on the event loop and must be quick.

    Raises:
        TypeError: `fn` is not a function or class; ValueError: an option is invalid.
    """
    if fn is None:
        return functools.partial(node, name=name, replicas=replicas, balance=balance,
                                 timeout=timeout, retries=retries, idempotent=idempotent,
                                 concurrency=concurrency, max_queue=max_queue, thread=thread)
    node_name = name or getattr(fn, "__name__", None) or repr(fn)
    is_class = inspect.isclass(fn)
    body = _class_call(fn) if is_class else fn
    if is_class and body is None:
        raise TypeError(f"class node '{node_name}' needs an (async) __call__ method")
    if inspect.isgeneratorfunction(body):
        raise TypeError(f"node '{node_name}' is a generator: a streaming node must be an async "
                        "generator (async def with yield)")
    if is_class:
        options = NodeOptions(replicas, balance, timeout, retries, idempotent,
                              1 if concurrency is None else concurrency, max_queue, thread)
        options.check(node_name)
        return NodeClass(fn, options, node_name)
    if not callable(fn):
        raise TypeError(f"@omni.node needs a function, async generator or class, got {fn!r}")
    options = NodeOptions(replicas, balance, timeout, retries, idempotent, concurrency,
                          max_queue, thread)
    options.check(node_name)
    return Node(fn, options, node_name)


def _class_call(cls: type) -> Callable[..., Any] | None:
    """The class's own ``__call__`` (None when only `object`'s or the metaclass's exists)."""
    for klass in cls.__mro__[:-1]:
        if "__call__" in vars(klass):
            return vars(klass)["__call__"]
    return None


def _call_signature(body: Callable[..., Any], *, skip_self: bool) -> inspect.Signature:
    sig = inspect.signature(body)
    if skip_self:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _resolve_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # forward references that do not resolve: fall back to what is there
        return {k: v for k, v in getattr(fn, "__annotations__", {}).items()
                if not isinstance(v, str)}


def _deployment_key(n: Node) -> Any:
    """Equal keys share one set of replicas: the same class (or function) and arguments."""
    key = (n.target, n.init_args, tuple(sorted(n.init_kwargs.items())))
    try:
        hash(key)
    except TypeError:
        return (n.target, id(n))
    return key


# ---------------------------------------------------------------------------------------------
# Tracing


class Ref:
    """A symbolic value inside a graph body: a graph input, or the future output of a node.

    Refs only wire nodes together. ``ref[key]`` selects an item of the value; truth tests and
    iteration raise `GraphError` (branch with `omni.switch` instead).
    """

    __slots__ = ("name", "slot", "stream", "trace", "type")

    def __init__(self, trace: Trace, slot: int, name: str, type_: Any, stream: bool):
        self.trace = trace
        self.slot = slot
        self.name = name
        self.type = type_
        self.stream = stream

    def __getitem__(self, key: Any) -> Ref:
        return self.trace.add_getitem(self, key, user_location(2))

    def __bool__(self) -> bool:
        raise GraphError(f"the value of '{self.name}' is not known while the graph is built; "
                         "use omni.switch(...) to branch on it", location=user_location(2))

    def __iter__(self) -> Any:
        raise GraphError(f"cannot iterate over '{self.name}' while the graph is built; pass it "
                         "to a node that iterates", location=user_location(2))

    def __repr__(self) -> str:
        return f"<omni.Ref {self.name}>"


@dataclass
class Call:
    """One node call recorded in a trace; `slot` is where its value lives in a request."""

    slot: int
    name: str
    target: Any  # Node | SwitchSpec | GetItem
    args: tuple
    kwargs: dict[str, Any]
    location: str
    ref: Ref | None = None


@dataclass(frozen=True)
class GetItem:
    """The pseudo-node behind ``ref[key]``."""

    key: Any


@dataclass(frozen=True)
class SwitchSpec:
    """The pseudo-node behind `omni.switch`: a selector and one sub-graph per value."""

    branches: Mapping[Any, Graph]
    streaming: bool
    type: Any


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
        from omni.graph.validate import check_call  # validate imports dsl; keep the cycle lazy

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
    from omni.graph.validate import stream_item_type

    ret = n.hints.get("return")
    return stream_item_type(ret) if n.streaming else ret


def _contains_ref(value: Any) -> bool:
    if isinstance(value, Ref):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_ref(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_ref(v) for v in value.values())
    return False


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
        from omni.graph._plan import compile_plan
        from omni.graph.validate import validate_graph

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
        trace = _current_trace.get()
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
    token = _current_trace.set(trace)
    _tracing_stack.append(name)
    try:
        output = body(*args, **kwargs)
    finally:
        _tracing_stack.pop()
        _current_trace.reset(token)
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
    return _trace_graph(fn, graph_name, inspect.signature(fn), _resolve_hints(fn),
                        _definition_location(fn), fn)


def switch(selector: Any, branches: Mapping[Any, Any], /, *args: Any, **kwargs: Any) -> Ref:
    """Route to one branch by the selector's value: only the chosen branch runs.

    `branches` maps selector values to nodes or graphs, all with the same signature; each is
    called with ``*args, **kwargs``. A selector value with no branch fails that request with
    `omni.RouteError`.
    """
    location = user_location(2)
    trace = _current_trace.get()
    if trace is None:
        raise GraphError("omni.switch is only for @omni.graph bodies", location=location)
    from omni.graph.validate import check_switch

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

