"""Nodes and Refs: the values a graph body handles.

`@omni.node` makes a `Node` of a function or async generator, and a `NodeClass` of a class.
Why apart from the tracing in `dsl.py`: a node is a value with options and a signature that
exists without any graph; calling one inside a graph body hands the call to the active trace,
which returns a `Ref`.
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from omni.graph.errors import GraphError

if TYPE_CHECKING:
    from omni.graph.dsl import Trace

__all__ = ["Node", "NodeClass", "NodeOptions", "Ref", "current_trace", "node", "user_location"]

BalanceName = Literal["round_robin", "least_loaded", "power_of_two", "kv_aware"]
NodeKind = Literal["function", "class"]

_OMNI_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
current_trace: contextvars.ContextVar[Trace | None] = contextvars.ContextVar(
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
    resources: Mapping[str, float] | None = None  # per replica, on a cluster worker
    where: str | None = None  # the cluster worker to place replicas on

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
        for resource, amount in (self.resources or {}).items():
            if not isinstance(resource, str) or isinstance(amount, bool) or not (
                    isinstance(amount, (int, float)) and amount >= 0):
                raise ValueError(f"node '{name}': resources must map names to amounts >= 0, "
                                 f"got {resource!r}: {amount!r}")
        if self.where is not None and (not isinstance(self.where, str) or not self.where):
            raise ValueError(f"node '{name}': where must be a worker name, got {self.where!r}")
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
    ``thread=True``), `signature` of the call and `hints` (its resolved annotations), and
    `direct` (no timeout, retries or replica pool: the scheduler calls the body as it is; worked
    out once here because the scheduler asks on every call).
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
        self.direct = options.timeout is None and not options.retries and not options.needs_pool
        self.signature = _call_signature(body, skip_self=kind == "class")
        self.hints = _resolve_hints(body)
        self.location = _definition_location(target)
        self.deployment_key = _deployment_key(self)
        functools.update_wrapper(self, target, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = current_trace.get()
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
         thread: bool = False, resources: Mapping[str, float] | None = None,
         where: str | None = None) -> Any:
    """Make a function, async generator or class a pipeline node.

    Use bare (``@omni.node``) or with options (``@omni.node(replicas=2)``).

    Args:
        name: the node's name in graphs, errors and metrics (default: the function's name).
        replicas: instances of a class node (or parallel lanes of a function node).
        balance: "round_robin", "least_loaded", "power_of_two", "kv_aware" (replicas that
            hold the request's prefix pages win unless loads are uneven; see
            `omni.graph.balance.KVAware`), or a `Balancer`.
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
        resources: what one replica of a class node needs on a cluster worker, e.g.
            ``{"gpu": 1}``; replicas go to workers with that much free.
        where: the name of the cluster worker that hosts this class node's replicas.

    Raises:
        TypeError: `fn` is not a function or class; ValueError: an option is invalid.
    """
    if fn is None:
        return functools.partial(node, name=name, replicas=replicas, balance=balance,
                                 timeout=timeout, retries=retries, idempotent=idempotent,
                                 concurrency=concurrency, max_queue=max_queue, thread=thread,
                                 resources=resources, where=where)
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
                              1 if concurrency is None else concurrency, max_queue, thread,
                              dict(resources) if resources else None, where)
        options.check(node_name)
        return NodeClass(fn, options, node_name)
    if not callable(fn):
        raise TypeError(f"@omni.node needs a function, async generator or class, got {fn!r}")
    if resources or where is not None:
        raise ValueError(f"node '{node_name}': resources= and where= place class nodes on "
                         "cluster workers; function nodes run in the driver")
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


def _resolve_hints(fn: Callable[..., Any], *, extras: bool = False) -> dict[str, Any]:
    """`fn`'s resolved annotations; with `extras`, ``Annotated[...]`` kept whole (a graph's
    inputs: their marks and constraints matter to whoever feeds them)."""
    try:
        return typing.get_type_hints(fn, include_extras=extras)
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


def _contains_ref(value: Any) -> bool:
    if isinstance(value, Ref):
        return True
    if isinstance(value, (list, tuple)):
        return any(_contains_ref(v) for v in value)
    if isinstance(value, dict):
        return any(_contains_ref(v) for v in value.values())
    return False
