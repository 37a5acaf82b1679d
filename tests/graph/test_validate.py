"""Graph errors are found when the graph is built, and name the node and the file:line."""

import inspect
import re
from collections.abc import AsyncIterator, Sequence

import pytest

import omni
from omni.graph.validate import compatible, validate_graph


@omni.node
async def upper(text: str) -> str:
    return text.upper()


@omni.node
async def length(text: str) -> int:
    return len(text)


@omni.node
async def half(x: float) -> float:
    return x / 2


@omni.node
async def words(text: str) -> AsyncIterator[str]:
    for w in text.split():
        yield w


@omni.node
async def count(items: AsyncIterator[str]) -> int:
    return sum([1 async for _ in items])


@omni.node
async def join(items: list[str]) -> str:
    return " ".join(items)


def here(offset: int = 0) -> str:
    """``file:line`` of the caller's line plus `offset`."""
    frame = inspect.currentframe().f_back
    return f"test_validate.py:{frame.f_lineno + offset}"


def raises_graph_error(match: str):
    return pytest.raises(omni.GraphError, match=re.escape(match))


def test_unknown_argument_names_node_and_line():
    where = here(4)
    with raises_graph_error("node 'upper': unknown argument 'txt' (parameters: text)") as info:
        @omni.graph
        def g(text: str):
            return upper(txt=text)
    assert info.value.node == "upper"
    assert info.value.location.endswith(where)
    assert str(info.value).startswith(info.value.location)


def test_missing_argument():
    with raises_graph_error("node 'upper': missing argument 'text'"):
        @omni.graph
        def g(text: str):
            return upper()


def test_too_many_arguments():
    with raises_graph_error("node 'upper': bad arguments: too many positional arguments"):
        @omni.graph
        def g(text: str):
            return upper(text, text)


def test_annotated_types_that_cannot_connect():
    where = here(5)
    with raises_graph_error("argument 'text' expects str but 'length' produces int") as info:
        @omni.graph
        def g(text: str):
            n = length(text)
            return upper(n)
    assert info.value.location.endswith(where)


def test_graph_input_types_are_checked_too():
    with raises_graph_error("argument 'text' expects str but 'n' produces int"):
        @omni.graph
        def g(n: int):
            return upper(n)


def test_compatible_types_connect():
    @omni.graph
    def g(text: str):
        return half(length(text))  # int flows into float

    assert [c.name for c in g.calls] == ["length", "half"]


@pytest.mark.parametrize(("src", "dst", "ok"), [
    (int, float, True), (bool, int, True), (str, int, False), (list[int], Sequence[int], True),
    (list[int], list[str], False), (int, int | None, True), (int | None, int, False),
    (None, int, True), (dict[str, int], dict, True), (str, object, True),
    (int | None, int | None, True), (int | str, str | int | None, True),
    (int | str, int | None, False),
])
def test_type_compatibility_rules(src, dst, ok):
    assert compatible(src, dst) is ok


def test_stream_into_a_scalar_parameter_is_refused():
    with raises_graph_error("expects str but 'words' is a stream of str, delivered as list[str]"):
        @omni.graph
        def g(text: str):
            return upper(words(text))


def test_stream_into_list_or_async_iterator_connects():
    @omni.graph
    def g(text: str):
        w = words(text)
        return {"n": count(w), "joined": join(w)}

    assert g.streaming_outputs == ()


def test_non_stream_into_async_iterator_is_refused():
    with raises_graph_error("argument 'items' expects a stream"):
        @omni.graph
        def g(text: str):
            return count(upper(text))


def test_stream_consumer_that_would_deadlock_is_refused():
    @omni.node
    async def both(items: AsyncIterator[str], joined: str) -> str:
        return joined

    with raises_graph_error("argument 'joined' waits for 'words' to finish while 'both' "
                            "consumes its stream"):
        @omni.graph
        def g(text: str):
            w = words(text)
            return both(w, join(w))


def test_switch_branches_with_different_signatures():
    @omni.node
    async def shout(text: str, times: int) -> str:
        return text * times

    with raises_graph_error("switch branches have different signatures: 'a' is "
                            "upper(text: str) -> str, 'b' is shout(text: str, times: int)"):
        @omni.graph
        def g(text: str):
            return omni.switch(text, {"a": upper, "b": shout}, text)


def test_switch_branches_with_different_return_types():
    with raises_graph_error("switch branches have different signatures"):
        @omni.graph
        def g(text: str):
            return omni.switch(text, {"a": upper, "b": length}, text)


def test_switch_branch_must_be_a_node_or_graph():
    with raises_graph_error("branch 'a' is 42, not a node or graph"):
        @omni.graph
        def g(text: str):
            return omni.switch(text, {"a": 42}, text)


def test_switch_arguments_are_checked_against_the_branches():
    with raises_graph_error("node 'switch': unknown argument 'txt'"):
        @omni.graph
        def g(text: str):
            return omni.switch(text, {"a": upper}, txt=text)


def test_branching_on_a_ref_with_python_if_is_refused():
    with raises_graph_error("use omni.switch"):
        @omni.graph
        def g(text: str):
            return upper(text) if length(text) else text


def test_graph_must_return_refs():
    with raises_graph_error("a graph must return a Ref or a non-empty dict of Refs"):
        @omni.graph
        def g(text: str):
            return "constant"
    with raises_graph_error("output 'b' is not a Ref"):
        @omni.graph
        def h(text: str):
            return {"a": upper(text), "b": 1}


def test_class_node_constructor_arguments_must_be_constants():
    @omni.node
    class Model:
        def __init__(self, name: str = "tiny"):
            self.name = name

        async def __call__(self, prompt: str) -> str:
            return prompt

    with raises_graph_error("did you mean Model()(...)?"):
        @omni.graph
        def g(prompt: str):
            return Model(prompt)


def test_refs_cannot_cross_graphs():
    leaked = []

    @omni.graph
    def first(text: str):
        leaked.append(upper(text))
        return leaked[0]

    with raises_graph_error("'upper' belongs to another graph (first)"):
        @omni.graph
        def second(text: str):
            return upper(leaked[0])


def test_cycles_are_refused():
    """Tracing cannot build a cycle, but a hand-edited graph is still checked."""

    @omni.graph
    def g(text: str):
        return upper(upper(text))

    first, second = g.calls
    first.args = (second.ref,)
    with raises_graph_error("cycle: upper -> upper_2 -> upper"):
        validate_graph(g)


def test_graph_inputs_must_be_named():
    with raises_graph_error("graph inputs must be named; 'args' is *args/**kwargs"):
        @omni.graph
        def g(*args):
            return upper(args)
