"""The DSL: what @node, @graph, switch and Ref build, and what a graph returns when it runs."""

from collections.abc import AsyncIterator

import pytest

import omni
from omni.graph.dsl import Graph, Node, NodeClass


@omni.node
async def upper(text: str) -> str:
    return text.upper()


@omni.node
async def add(a: int, b: int) -> int:
    return a + b


@omni.node
async def double(x: int) -> int:
    return 2 * x


@omni.node
async def words(text: str) -> AsyncIterator[str]:
    for w in text.split():
        yield w


@omni.node
async def total(values: list) -> int:
    return sum(values)


async def run(g, **inputs):
    async with omni.Runtime() as rt:
        return await rt.run(g, **inputs)


def test_node_kinds_are_recognised():
    assert isinstance(upper, Node) and upper.kind == "function" and not upper.streaming
    assert words.streaming and words.is_async

    @omni.node
    class Model:
        async def __call__(self, prompt: str) -> str:
            return prompt

    assert isinstance(Model, NodeClass)
    bound = Model()
    assert isinstance(bound, Node) and bound.kind == "class"


def test_binding_a_class_node_builds_no_instance():
    built = []

    @omni.node
    class Model:
        def __init__(self, name: str = "tiny"):
            built.append(name)

        async def __call__(self, prompt: str) -> str:
            return prompt

    @omni.graph
    def g(prompt: str):
        return Model(name="big")(prompt)

    assert built == []
    assert g.calls[0].target.init_kwargs == {"name": "big"}


async def test_calling_a_node_outside_a_graph_runs_its_body():
    """The escape hatch: a function node is still a plain async function."""
    assert await upper("abc") == "ABC"


def test_graph_body_is_traced_exactly_once():
    calls = []

    @omni.graph
    def g(text: str):
        calls.append(text)
        return upper(text)

    assert len(calls) == 1
    assert isinstance(calls[0], omni.Ref)
    assert isinstance(g, Graph) and [c.name for c in g.calls] == ["upper"]


async def test_single_ref_output_returns_the_value():
    @omni.graph
    def g(text: str):
        return upper(text)

    assert await run(g, text="hi") == "HI"


async def test_dict_output_returns_a_dict():
    @omni.graph
    def g(a: int, b: int):
        s = add(a, b)
        return {"sum": s, "double": double(s), "a": a}

    assert await run(g, a=2, b=3) == {"sum": 5, "double": 10, "a": 2}


async def test_fan_out_and_fan_in():
    """One Ref feeds many nodes; one node takes many Refs, also inside a list."""

    @omni.graph
    def g(x: int):
        d = double(x)
        return total([d, add(d, x), double(d), 100])

    assert await run(g, x=1) == 2 + 3 + 4 + 100


async def test_constants_and_keyword_arguments():
    @omni.graph
    def g(x: int):
        return add(b=10, a=x)

    assert await run(g, x=5) == 15


async def test_graph_input_defaults():
    @omni.graph
    def g(a: int, b: int = 7):
        return add(a, b)

    assert await run(g, a=1) == 8
    assert await run(g, a=1, b=1) == 2


async def test_graph_used_as_a_node_in_another_graph():
    @omni.graph
    def inner(a: int, b: int):
        return {"sum": add(a, b), "twice": double(a)}

    @omni.graph
    def outer(x: int):
        parts = inner(x, 1)
        return double(parts["sum"])

    assert await run(outer, x=4) == 10
    assert [c.name for c in outer.calls] == ["inner.add", "inner.double", "double"]


async def test_indexing_a_ref_selects_an_item():
    @omni.node
    async def pair(x: int) -> dict:
        return {"left": x, "right": -x}

    @omni.graph
    def g(x: int):
        p = pair(x)
        return add(p["left"], p["right"])

    assert await run(g, x=3) == 0


async def test_running_a_node_directly_wraps_it_in_a_graph():
    async with omni.Runtime() as rt:
        assert await rt.run(add, a=1, b=2) == 3


def test_graph_records_call_locations():
    @omni.graph
    def g(text: str):
        return upper(text)

    assert g.calls[0].location.endswith(f"test_dsl.py:{g.fn.__code__.co_firstlineno + 2}")


def test_node_options_are_checked_when_decorated():
    with pytest.raises(ValueError, match="retries=2 needs idempotent=True"):
        omni.node(retries=2)(upper.target)
    with pytest.raises(ValueError, match="unknown balance 'fastest'"):
        omni.node(balance="fastest")(upper.target)
    with pytest.raises(ValueError, match="replicas must be an integer >= 1"):
        omni.node(replicas=0)(upper.target)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        omni.node(timeout=0)(upper.target)


def test_sync_generators_are_refused():
    def gen(x):
        yield x

    with pytest.raises(TypeError, match="async generator"):
        omni.node(gen)


def test_graph_repr_and_outputs():
    @omni.graph
    def g(text: str):
        return {"upper": upper(text), "words": words(text)}

    assert repr(g) == "<omni.Graph g nodes=2 inputs=1>"
    assert g.streaming_outputs == ("words",)
