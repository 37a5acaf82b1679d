"""What the compiled plan says of each call's value: only class nodes take it, each as a
whole argument (`Step.keep`), so a cluster may leave it on the worker that made it."""

from __future__ import annotations

import omni


@omni.node
class Make:
    async def __call__(self, n: int) -> list[int]:
        return list(range(n))


@omni.node
class Use:
    async def __call__(self, x: object, y: object = None) -> int:
        return 0


@omni.node(balance="kv_aware")
class Cached:
    @staticmethod
    def kv_keys(x: object) -> list[bytes]:
        return []

    async def __call__(self, x: object) -> int:
        return 0


@omni.node
async def local(x: object) -> int:
    return 0


def keeps(graph) -> dict[str, bool]:
    return {step.name: step.keep for step in graph.plan.steps if step is not None}


def test_a_value_only_class_nodes_take_whole_is_kept():
    @omni.graph
    def chain(n: int):
        made = Make()(n)
        return Use()(Use()(made), y=made)

    kept = keeps(chain)
    assert kept["Make"] is True
    assert sorted(kept.values()).count(True) == 2  # Make, and the inner Use: not the output


def test_anything_here_taking_the_value_keeps_it_here():
    @omni.graph
    def to_function(n: int):
        made = Make()(n)
        return {"a": Use()(made), "b": local(made)}

    @omni.graph
    def in_a_list(n: int):
        return Use()([Make()(n)])

    @omni.graph
    def output(n: int):
        made = Make()(n)
        return {"made": made, "used": Use()(made)}

    @omni.graph
    def item(n: int):
        return Use()(Make()(n)[0])

    @omni.graph
    def balanced_by_its_keys(n: int):
        return Cached()(Make()(n))

    for graph in (to_function, in_a_list, output, item, balanced_by_its_keys):
        assert keeps(graph)["Make"] is False, graph.name


@omni.node
class Pass:
    async def __call__(self, x: object) -> object:
        return x


@omni.node(timeout=5.0)
class Timed:
    async def __call__(self, x: object) -> object:
        return x


def chains(graph) -> dict[str, list[str]]:
    """Each chain's first step -> the steps after it."""
    return {step.name: [s.name for s in step.chain] for step in graph.plan.steps
            if step is not None and step.chain}


def test_class_nodes_each_taking_only_the_one_before_make_a_chain():
    @omni.graph
    def line(n: int):
        return Pass()(Use()(Make()(n)))

    assert chains(line) == {"Make": ["Use", "Pass"]}
    assert line.plan.steps[-1].chain == ()  # only the first step names the chain


def test_a_chain_ends_where_a_value_is_needed_here_or_taken_with_more():
    @omni.graph
    def with_more(n: int):  # Use takes a second value: it waits for both, here
        return Use()(Make()(n), y=n)

    @omni.graph
    def output_inside(n: int):  # Make's value is an output: it comes here
        made = Make()(n)
        return {"made": made, "used": Use()(made)}

    @omni.graph
    def into_a_function(n: int):
        return local(Use()(Make()(n)))

    @omni.graph
    def timed(n: int):  # a timeout is per call: a chain cannot keep it
        return Use()(Timed()(Make()(n)))

    @omni.graph
    def balanced_by_its_keys(n: int):  # its replica is chosen by the value
        return Cached()(Make()(n))

    @omni.graph
    def twice(n: int):  # a node may come again: each call queues on its own worker
        return Use()(Make()(Use()(Make()(n))))

    assert chains(with_more) == {}
    assert chains(output_inside) == {}
    assert chains(into_a_function) == {"Make": ["Use"]}
    assert chains(timed) == {}
    assert chains(balanced_by_its_keys) == {}
    assert chains(twice) == {"Make": ["Use", "Make_2", "Use_2"]}
