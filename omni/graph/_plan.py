"""Compile a traced graph into a `Plan`: the flat, precomputed form the scheduler runs.

All per-graph work happens here, once: argument templates become builder functions, edges
become consumer lists and dependency counts, outputs become slot lookups. A request then only
fills a list of values and counts dependencies down (see `scheduler.py`).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from omni.graph._calls import Call, GetItem, SwitchSpec
from omni.graph._node import Node, Ref
from omni.graph.errors import InputError
from omni.graph.validate import call_dependencies, stream_arguments

if TYPE_CHECKING:
    from omni.graph.dsl import Graph

__all__ = ["Plan", "Step", "compile_plan"]

StepKind = Literal["call", "stream", "getitem", "switch"]
ArgBuilder = Callable[[list, list], tuple[tuple, dict]]
_NO_KWARGS: dict[str, Any] = {}  # shared, never mutated: `f(**d)` copies it


@dataclass(eq=False)
class Step:
    """One node call of a plan. Why a separate record from `Call`: it holds only what the
    scheduler needs on the hot path, resolved to slot numbers.

    Invariant: `num_deps` = number of distinct producer steps in `consumers` lists that point
    here + number of stream edges that feed this step.
    """

    slot: int
    name: str
    kind: StepKind
    node: Node | None
    build_args: ArgBuilder
    num_deps: int = 0
    consumers: list[int] = field(default_factory=list)  # wait for this step to finish
    stream_edges: list[tuple[int, int]] = field(default_factory=list)  # (consumer, edge)
    in_edges: list[int] = field(default_factory=list)  # stream edges this step reads
    collect: bool = False  # a streaming step keeps its items as a list
    outputs: list[str] = field(default_factory=list)  # graph outputs this step's value is
    key: Any = None  # GetItem key
    branches: Mapping[Any, Plan] | None = None  # switch
    # Only class nodes take this call's value, each as a whole argument: where class nodes
    # run in other processes (a cluster), the value may stay where it was made and go from
    # there to them, never through this process (`CallContext.keep`).
    keep: bool = False
    # The steps after this one that may run as one chain with it where class nodes run in
    # other processes: each takes the one before as its only argument and nothing else reads
    # it, so each stage's value goes from its process straight to the next's
    # (`_chain_after`). Set on a chain's first step only; empty elsewhere.
    chain: tuple[Step, ...] = ()


@dataclass(eq=False)
class Plan:
    """A compiled graph: `steps` by slot (None for input slots), in topological order."""

    name: str
    signature: inspect.Signature
    input_names: tuple[str, ...]
    defaults: dict[str, Any]
    steps: list[Step | None]
    num_edges: int
    initial_pending: list[int]
    roots: tuple[int, ...]
    output_slots: dict[str, int] | int
    sequential: bool  # a chain with no streams: runs in the caller's task, no nursery
    nodes: tuple[Node, ...]  # every node that may run, branches included (for deployment)
    input_set: frozenset[str] = frozenset()  # `input_names`, for a one-comparison check in bind

    @property
    def num_slots(self) -> int:
        return len(self.steps)

    def bind(self, inputs: Mapping[str, Any]) -> list[Any]:
        """A fresh values list with the request's inputs in their slots."""
        values: list[Any] = [None] * len(self.steps)
        names = self.input_names
        if inputs.keys() == self.input_set:  # every input given by name: the common case
            for i, n in enumerate(names):
                values[i] = inputs[n]
            return values
        for key in inputs:
            if key not in names:
                raise InputError(f"graph '{self.name}' has no input '{key}' "
                                 f"(inputs: {', '.join(names) or 'none'})")
        for i, n in enumerate(names):
            if n in inputs:
                values[i] = inputs[n]
            elif n in self.defaults:
                values[i] = self.defaults[n]
            else:
                raise InputError(f"graph '{self.name}' is missing input '{n}'")
        return values

    def outputs(self, values: list[Any]) -> Any:
        if isinstance(self.output_slots, int):
            return values[self.output_slots]
        return {name: values[slot] for name, slot in self.output_slots.items()}


def compile_plan(g: Graph) -> Plan:
    num_inputs = len(g.inputs)
    steps: list[Step | None] = [None] * (num_inputs + len(g.calls))
    num_edges = 0
    for c in g.calls:
        # An edge per stream parameter: a stream read through two parameters is teed, each
        # seeing every item, not one iterator shared (which would split the items).
        edge_of: dict[int, list[int]] = {}
        for ref in _streamed_refs(c):
            edge_of.setdefault(id(ref), []).append(num_edges)
            num_edges += 1
        step = _make_step(c, _arg_builder(c.args, c.kwargs, edge_of))
        producers = {r.slot for r in call_dependencies(c)
                     if r.slot >= num_inputs and id(r) not in edge_of}
        for p in sorted(producers):
            steps[p].consumers.append(c.slot)
            if steps[p].kind == "stream":
                steps[p].collect = True
        for ref in _streamed_refs(c):
            for edge in edge_of[id(ref)]:
                if edge not in step.in_edges:
                    steps[ref.slot].stream_edges.append((c.slot, edge))
                    step.in_edges.append(edge)
        step.num_deps = len(producers) + len(step.in_edges)
        steps[c.slot] = step
    output_slots = _output_slots(g, steps)
    by_slot = {c.slot: c for c in g.calls}
    for step in steps:
        if step is not None:
            step.keep = _only_class_nodes_take(step, steps, by_slot)
    _mark_chains(steps, by_slot)
    real = [s for s in steps if s is not None]
    return Plan(
        name=g.name, signature=g.signature,
        input_names=tuple(i.name for i in g.inputs),
        defaults={i.name: i.default for i in g.inputs if i.default is not inspect.Parameter.empty},
        steps=steps, num_edges=num_edges,
        initial_pending=[0 if s is None else s.num_deps for s in steps],
        roots=tuple(s.slot for s in real if s.num_deps == 0),
        output_slots=output_slots,
        sequential=_is_chain(real),
        nodes=_all_nodes(real),
        input_set=frozenset(i.name for i in g.inputs),
    )


def _only_class_nodes_take(step: Step, steps: list[Step | None],
                           calls: Mapping[int, Call]) -> bool:
    """Whether `step` is a call whose value only class nodes take, each as a whole argument
    (not inside a container), balanced without looking at their arguments, and which is no
    graph output: then nothing in this process ever needs the value itself."""
    if step.kind != "call" or step.outputs or not step.consumers or step.stream_edges:
        return False
    for slot in step.consumers:
        consumer = steps[slot]
        if consumer is None or consumer.kind not in ("call", "stream") \
                or consumer.node is None or consumer.node.kind != "class":
            return False
        balance = consumer.node.options.balance  # kv_aware and custom balancers read args
        if not isinstance(balance, str) or balance == "kv_aware":
            return False
        c = calls[slot]
        whole = [a for a in (*c.args, *c.kwargs.values()) if isinstance(a, Ref)]
        if any(r.slot == step.slot and not any(r is w for w in whole)
               for r in call_dependencies(c)):
            return False
    return True


def _mark_chains(steps: list[Step | None], calls: Mapping[int, Call]) -> None:
    """Set `Step.chain` on the first step of each run of steps that may run as one chain."""
    follows = {}
    for step in steps:
        if step is not None and (after := _chain_after(step, steps, calls)) is not None:
            follows[step.slot] = after
    followers = {after.slot for after in follows.values()}
    for slot, after in follows.items():
        if slot in followers:
            continue  # not a chain's first step
        chain = []
        while after is not None:
            chain.append(after)
            after = follows.get(after.slot)
        steps[slot].chain = tuple(chain)


def _chain_after(step: Step, steps: list[Step | None], calls: Mapping[int, Call]) -> Step | None:
    """The step that may run right after `step` in one chain, or None. Both are plain calls of
    class nodes with neither timeout nor retries (a chain is retried only as a whole, when its
    first stage is lost); the next takes `step`'s value as its one and only argument, nothing
    else takes it, and it is balanced without looking at its arguments (its replica is chosen
    before the value exists)."""
    if not step.keep or len(step.consumers) != 1 or not _chainable(step):
        return None
    after = steps[step.consumers[0]]
    if after is None or after.kind != "call" or after.num_deps != 1 or not _chainable(after):
        return None
    c = calls[after.slot]
    if c.kwargs or len(c.args) != 1 or not isinstance(c.args[0], Ref) \
            or c.args[0].slot != step.slot:
        return None
    return after


def _chainable(step: Step) -> bool:
    node = step.node
    return step.kind == "call" and not step.in_edges and node is not None \
        and node.kind == "class" and not node.streaming and node.options.timeout is None \
        and not node.options.retries


def _streamed_refs(c: Call) -> list[Ref]:
    """The Ref of each stream parameter of `c` (one stream twice for two parameters)."""
    if not isinstance(c.target, Node):
        return []
    names = stream_arguments(c)
    if not names:
        return []
    bound = c.target.signature.bind(*c.args, **c.kwargs)
    return [bound.arguments[n] for n in sorted(names)]


def _make_step(c: Call, build: ArgBuilder) -> Step:
    target = c.target
    if isinstance(target, GetItem):
        return Step(c.slot, c.name, "getitem", None, build, key=target.key)
    if isinstance(target, SwitchSpec):
        branches = {k: g.plan for k, g in target.branches.items()}
        return Step(c.slot, c.name, "stream" if target.streaming else "switch", None, build,
                    branches=branches)
    return Step(c.slot, c.name, "stream" if target.streaming else "call", target, build)


def _output_slots(g: Graph, steps: list[Step | None]) -> dict[str, int] | int:
    for name, ref in g.output_refs():
        step = steps[ref.slot]
        if step is not None:
            step.outputs.append(name)
            if step.kind == "stream":
                step.collect = True
    if isinstance(g.output, Ref):
        return g.output.slot
    return {name: ref.slot for name, ref in g.output.items()}


def _is_chain(steps: list[Step]) -> bool:
    """True when each step is the only consumer of the one before it (no concurrency to lose)."""
    if any(s.kind == "stream" for s in steps):
        return False
    for before, after in itertools.pairwise(steps):
        if before.consumers != [after.slot]:
            return False
    return True


def _all_nodes(steps: list[Step]) -> tuple[Node, ...]:
    found: dict[int, Node] = {}
    for s in steps:
        if s.node is not None:
            found[id(s.node)] = s.node
        for plan in (s.branches or {}).values():
            for n in plan.nodes:
                found[id(n)] = n
    return tuple(found.values())


# ---------------------------------------------------------------------------------------------
# Argument builders: turn a recorded call's arguments into a function of (values, edges)


def _getter(value: Any, edge_of: Mapping[int, list[int]]) -> Callable[[list, list], Any] | None:
    """None for a constant; otherwise a function that reads the value of a request. A stream
    takes the next of its edges at each place it is passed (`edge_of` is consumed)."""
    if isinstance(value, Ref):
        if edge_of.get(id(value)):
            edge = edge_of[id(value)].pop(0)
            return lambda values, edges: edges[edge]
        slot = value.slot
        return lambda values, edges: values[slot]
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        getters = {k: _getter(v, edge_of) for k, v in items}
        if all(g is None for g in getters.values()):
            return None
        return _container_getter(value, getters)
    return None


def _container_getter(value: Any, getters: dict[Any, Any]) -> Callable[[list, list], Any]:
    parts = [(k, g, None if g else (value[k])) for k, g in getters.items()]
    if isinstance(value, dict):
        return lambda values, edges: {k: g(values, edges) if g else c for k, g, c in parts}
    kind = type(value)
    return lambda values, edges: kind([g(values, edges) if g else c for _, g, c in parts])


def _arg_builder(args: tuple, kwargs: Mapping[str, Any], edge_of: Mapping[int, list[int]]
                 ) -> ArgBuilder:
    edge_of = {ref_id: list(edges) for ref_id, edges in edge_of.items()}
    arg_getters = [(_getter(a, edge_of), a) for a in args]
    kw_getters = [(k, _getter(v, edge_of), v) for k, v in kwargs.items()]
    if not kw_getters and all(g is not None for g, _ in arg_getters):
        if len(arg_getters) == 1:  # the common case: one upstream value
            only = arg_getters[0][0]
            return lambda values, edges: ((only(values, edges),), _NO_KWARGS)
        fns = [g for g, _ in arg_getters]
        return lambda values, edges: (tuple([f(values, edges) for f in fns]), _NO_KWARGS)

    def build(values: list, edges: list) -> tuple[tuple, dict]:
        built_args = tuple([g(values, edges) if g else a for g, a in arg_getters])
        built_kwargs = {k: g(values, edges) if g else v for k, g, v in kw_getters}
        return built_args, built_kwargs

    return build
