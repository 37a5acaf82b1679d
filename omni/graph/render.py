"""Render a graph for people: an indented text listing, a Mermaid flowchart or a Graphviz digraph.

`render(graph, format)` is the one entry point; it only reads the traced graph (`Graph.inputs`,
`Graph.calls`, `Graph.output_refs()`), never the compiled plan. The two diagram formats share one
model, `_Diagram` (vertices grouped in nested clusters, plus edges), built by walking the calls;
each `omni.switch` branch becomes a cluster that the switch reaches by dashed edges. The text
form walks the calls directly and mirrors the DSL: ``name = node(args)``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from omni.graph.dsl import Call, GetItem, Graph, Node, Ref, SwitchSpec
from omni.graph.validate import type_name

__all__ = ["Format", "render"]

Format = Literal["text", "mermaid", "dot"]
VertexShape = Literal["input", "call", "stream", "switch", "getitem", "output"]
EdgeStyle = Literal["solid", "stream", "branch"]

_MAX_CONSTANT = 40  # characters of a constant argument's repr shown before it is cut


def render(graph: Graph, format: Format = "text") -> str:
    """Describe `graph` as text, a Mermaid flowchart or a Graphviz (dot) digraph.

    Args:
        graph: a built graph (``@omni.graph`` or ``Graph.of(node)``).
        format: "text" (one line per call, branches indented), "mermaid" (``flowchart TD``)
            or "dot" (a ``digraph``).

    Returns:
        The rendering, ending with a newline.

    Raises:
        ValueError: `format` is not one of the three.
    """
    renderers: dict[str, Callable[[Graph], str]] = {
        "text": _render_text, "mermaid": _render_mermaid, "dot": _render_dot}
    if format not in renderers:
        raise ValueError(f"unknown format {format!r}; choose one of text, mermaid, dot")
    return renderers[format](graph)


# ---------------------------------------------------------------------------------------------
# Shared helpers


def _refs(value: Any) -> Iterator[Ref]:
    """Every Ref inside an argument, which may nest them in lists, tuples and dicts."""
    if isinstance(value, Ref):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _refs(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _refs(item)


def _arguments(c: Call) -> list[tuple[str | None, Ref]]:
    """(parameter name, Ref) for every Ref a call reads; the name is None where unknown."""
    target = c.target
    if isinstance(target, GetItem):
        return [(None, ref) for ref in _refs(c.args)]
    if isinstance(target, SwitchSpec):
        first = next(iter(target.branches.values()))
        selector = [("selector", ref) for ref in _refs(c.args[0])]
        return selector + _bound(first.signature, c.args[1:], c.kwargs)
    return _bound(target.signature, c.args, c.kwargs)


def _bound(signature: inspect.Signature, args: tuple, kwargs: dict[str, Any]
           ) -> list[tuple[str | None, Ref]]:
    try:
        arguments = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:  # validated graphs bind; stay useful if one does not
        return [(None, ref) for ref in _refs((args, kwargs))]
    return [(name, ref) for name, value in arguments.items() for ref in _refs(value)]


def _node_marks(target: Node) -> list[str]:
    marks = ["stream"] if target.streaming else []
    if target.options.replicas > 1:
        marks.append(f"replicas={target.options.replicas}")
    return marks


def _constant(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _MAX_CONSTANT else text[:_MAX_CONSTANT - 3] + "..."


def _input_text(g: Graph, index: int) -> str:
    item = g.inputs[index]
    text = item.name if item.type is None else f"{item.name}: {type_name(item.type)}"
    if item.default is not inspect.Parameter.empty:
        text += f" = {_constant(item.default)}"
    return text


def _signature_text(g: Graph) -> str:
    return f"{g.name}({', '.join(_input_text(g, i) for i in range(len(g.inputs)))})"


# ---------------------------------------------------------------------------------------------
# Text


def _render_text(g: Graph) -> str:
    lines = [f"graph {_signature_text(g)}  # {g.location}"]
    lines += _call_lines(g, "  ")
    for name, ref in g.output_refs():
        mark = "  [stream]" if ref.stream else ""
        target = "output" if isinstance(g.output, Ref) else f"output {name}"
        lines.append(f"  {target} = {ref.name}{mark}")
    return "\n".join(lines) + "\n"


def _call_lines(g: Graph, indent: str) -> list[str]:
    lines: list[str] = []
    for c in g.calls:
        lines.append(f"{indent}{c.name} = {_call_text(c)}")
        if isinstance(c.target, SwitchSpec):
            for value, branch in c.target.branches.items():
                lines.append(f"{indent}    {value!r} -> {_signature_text(branch)}")
                lines += _call_lines(branch, indent + "        ")
    return lines


def _call_text(c: Call) -> str:
    target = c.target
    if isinstance(target, GetItem):
        return f"{_value_text(c.args[0])}[{target.key!r}]"
    args = ", ".join([*(_value_text(a) for a in c.args),
                      *(f"{k}={_value_text(v)}" for k, v in c.kwargs.items())])
    if isinstance(target, SwitchSpec):
        mark = "  [stream]" if target.streaming else ""
        return f"switch({args}){mark}"
    marks = _node_marks(target)
    suffix = f"  [{', '.join(marks)}]" if marks else ""
    if target.kind == "class":
        init = ", ".join([*(_constant(a) for a in target.init_args),
                          *(f"{k}={_constant(v)}" for k, v in target.init_kwargs.items())])
        return f"{target.name}({init})({args}){suffix}"
    return f"{target.name}({args}){suffix}"


def _value_text(value: Any) -> str:
    if isinstance(value, Ref):
        return value.name
    if isinstance(value, list) and any(True for _ in _refs(value)):
        return "[" + ", ".join(_value_text(v) for v in value) + "]"
    if isinstance(value, tuple) and any(True for _ in _refs(value)):
        end = ",)" if len(value) == 1 else ")"
        return "(" + ", ".join(_value_text(v) for v in value) + end
    if isinstance(value, dict) and any(True for _ in _refs(value)):
        return "{" + ", ".join(f"{k!r}: {_value_text(v)}" for k, v in value.items()) + "}"
    return _constant(value)


# ---------------------------------------------------------------------------------------------
# The diagram model


@dataclass(frozen=True)
class _Vertex:
    id: str
    label: str
    shape: VertexShape


@dataclass(frozen=True)
class _Edge:
    source: str
    target: str
    label: str | None
    style: EdgeStyle


@dataclass
class _Cluster:
    """A group of vertices: the whole graph at the top, one switch branch below it."""

    id: str
    label: str
    vertices: list[_Vertex] = field(default_factory=list)
    clusters: list[_Cluster] = field(default_factory=list)


@dataclass(frozen=True)
class _Source:
    """Where a slot's value comes from in the diagram. Why: a branch's inputs have no vertex
    of their own; they come from the switch, by a dashed edge labelled with the branch value."""

    vertex: str
    label: str | None = None  # replaces the parameter name (branch edges)
    style: EdgeStyle | None = None  # None: solid, or stream when the value is a stream


@dataclass
class _Diagram:
    root: _Cluster
    edges: list[_Edge] = field(default_factory=list)

    def connect(self, source: _Source, target: str, param: str | None, stream: bool) -> None:
        style = source.style or ("stream" if stream else "solid")
        edge = _Edge(source.vertex, target, source.label or param, style)
        if edge not in self.edges:
            self.edges.append(edge)


def _diagram(g: Graph) -> _Diagram:
    diagram = _Diagram(_Cluster("root", g.name))
    sources: dict[int, _Source] = {}
    for index in range(len(g.inputs)):
        vertex = _Vertex(f"in{index}", _input_text(g, index), "input")
        diagram.root.vertices.append(vertex)
        sources[index] = _Source(vertex.id)
    _add_calls(diagram, diagram.root, g, "", sources, None)
    for index, (name, ref) in enumerate(g.output_refs()):
        label = f"{name} (stream)" if ref.stream else name
        diagram.root.vertices.append(_Vertex(f"out{index}", label, "output"))
        diagram.connect(sources[ref.slot], f"out{index}", None, ref.stream)
    return diagram


def _add_calls(diagram: _Diagram, cluster: _Cluster, g: Graph, prefix: str,
               sources: dict[int, _Source], entry: _Source | None) -> None:
    """Add a (sub)graph's calls; `sources` gains a `_Source` for each call's slot."""
    for c in g.calls:
        vertex = _Vertex(f"{prefix}n{c.slot}", _vertex_label(c), _vertex_shape(c))
        cluster.vertices.append(vertex)
        arguments = _arguments(c)
        for param, ref in arguments:
            diagram.connect(sources[ref.slot], vertex.id, param, ref.stream)
        if not arguments and entry is not None:  # a branch call that reads nothing
            diagram.connect(entry, vertex.id, None, False)
        sources[c.slot] = _Source(vertex.id)
        if isinstance(c.target, SwitchSpec):
            _add_branches(diagram, cluster, c.target, vertex.id)


def _add_branches(diagram: _Diagram, cluster: _Cluster, spec: SwitchSpec, switch_id: str) -> None:
    for index, (value, branch) in enumerate(spec.branches.items()):
        sub = _Cluster(f"{switch_id}b{index}", f"{value!r}: {branch.name}")
        cluster.clusters.append(sub)
        entry = _Source(switch_id, repr(value), "branch")
        sources = dict.fromkeys(range(len(branch.inputs)), entry)
        _add_calls(diagram, sub, branch, f"{sub.id}_", sources, entry)


def _vertex_label(c: Call) -> str:
    if isinstance(c.target, Node):
        marks = _node_marks(c.target)
        return f"{c.name} ({', '.join(marks)})" if marks else c.name
    if isinstance(c.target, SwitchSpec) and c.target.streaming:
        return f"{c.name} (stream)"
    return c.name


def _vertex_shape(c: Call) -> VertexShape:
    if isinstance(c.target, GetItem):
        return "getitem"
    if isinstance(c.target, SwitchSpec):
        return "switch"
    return "stream" if c.target.streaming else "call"


def _walk(cluster: _Cluster, depth: int, enter: Callable[[_Cluster, int], list[str]],
          vertex: Callable[[_Vertex, int], str], leave: Callable[[int], str]) -> list[str]:
    """Lines for a cluster tree: `enter` and `leave` frame each nested cluster."""
    lines = [vertex(v, depth) for v in cluster.vertices]
    for sub in cluster.clusters:
        lines += enter(sub, depth)
        lines += _walk(sub, depth + 1, enter, vertex, leave)
        lines.append(leave(depth))
    return lines


# ---------------------------------------------------------------------------------------------
# Mermaid

# Quoted labels keep any text safe; these characters still need Mermaid's entity codes.
_MERMAID_ENTITIES = {"#": "#35;", '"': "#quot;", "<": "#lt;", ">": "#gt;", "`": "#96;",
                     "\n": " ", "\r": " "}
_MERMAID_SHAPES = {"input": '(["{}"])', "call": '["{}"]', "stream": '[["{}"]]',
                   "switch": '{{"{}"}}', "getitem": '>"{}"]', "output": '[/"{}"/]'}
_MERMAID_ARROWS = {"solid": "-->", "stream": "==>", "branch": "-.->"}


def _mermaid_text(text: str) -> str:
    return "".join(_MERMAID_ENTITIES.get(ch, ch) for ch in text)


def _render_mermaid(g: Graph) -> str:
    diagram = _diagram(g)
    lines = ["flowchart TD",
             f"    %% graph {_mermaid_text(g.name)}: thick arrows carry streams, "
             "dashed arrows enter switch branches"]

    def vertex(v: _Vertex, depth: int) -> str:
        shape = _MERMAID_SHAPES[v.shape].format(_mermaid_text(v.label))
        return f"{'    ' * (depth + 1)}{v.id}{shape}"

    def enter(c: _Cluster, depth: int) -> list[str]:
        return [f'{"    " * (depth + 1)}subgraph {c.id} ["{_mermaid_text(c.label)}"]']

    lines += _walk(diagram.root, 0, enter, vertex, lambda depth: f"{'    ' * (depth + 1)}end")
    for e in diagram.edges:
        label = f'|"{_mermaid_text(e.label)}"|' if e.label else ""
        lines.append(f"    {e.source} {_MERMAID_ARROWS[e.style]}{label} {e.target}")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# Graphviz dot

_DOT_SHAPES = {"input": "shape=ellipse", "call": "shape=box", "stream": "shape=box, peripheries=2",
               "switch": "shape=diamond", "getitem": "shape=box, style=rounded",
               "output": "shape=parallelogram"}
_DOT_STYLES = {"solid": "", "stream": ", style=bold", "branch": ", style=dashed"}


def _dot_text(text: str) -> str:
    """A double-quoted dot string (quotes, backslashes and newlines escaped)."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "").replace("\n", "\\n") + '"'


def _render_dot(g: Graph) -> str:
    diagram = _diagram(g)
    lines = [f"digraph {_dot_text(g.name)} {{", "    rankdir=TB;",
             '    node [fontname="Helvetica"];', '    edge [fontname="Helvetica"];']

    def vertex(v: _Vertex, depth: int) -> str:
        return f"{'    ' * (depth + 1)}{v.id} [label={_dot_text(v.label)}, {_DOT_SHAPES[v.shape]}];"

    def enter(c: _Cluster, depth: int) -> list[str]:
        pad = "    " * (depth + 1)
        return [f"{pad}subgraph cluster_{c.id} {{",
                f"{pad}    label={_dot_text(c.label)};", f"{pad}    style=dashed;"]

    lines += _walk(diagram.root, 0, enter, vertex, lambda depth: f"{'    ' * (depth + 1)}}}")
    for e in diagram.edges:
        label = f"label={_dot_text(e.label)}" if e.label else ""
        style = _DOT_STYLES[e.style]
        attrs = f" [{label}{style}]".replace("[, ", "[") if label or style else ""
        lines.append(f"    {e.source} -> {e.target}{attrs};")
    lines.append("}")
    return "\n".join(lines) + "\n"
