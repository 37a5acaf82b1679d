"""`omni.graph.render.render` (in process) and ``omni graph show`` (subprocesses)."""

from __future__ import annotations

import re
import subprocess
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

import omni
from omni.graph.render import render

Cli = Callable[..., subprocess.CompletedProcess[str]]


@omni.node
async def split(text: str) -> tuple[str, str]:
    return text[:1], text[1:]


@omni.node(name='say "hi" #1')
async def odd_name(text: str, *, tag: str = "t") -> str:
    return text


@omni.node
async def words(text: str) -> AsyncIterator[str]:
    for word in text.split():
        yield word


@omni.node
async def count(items: AsyncIterator[str]) -> int:
    return sum([1 async for _ in items])


@omni.node(replicas=3)
class Model:
    def __init__(self, path: str = "tiny") -> None:
        self.path = path

    async def __call__(self, text: str) -> str:
        return text


@omni.node(name="it's <x>")
async def quoted(text: str) -> str:
    return text


@omni.node
async def route(text: str) -> str:
    return "a"


@omni.graph
def branch(text: str):
    return Model(path="big")(text)


@omni.graph
def nested(text: str):
    return omni.switch(route(text), {"x": quoted, 'q"<#>': branch}, text)


@omni.graph
def everything(text: str, limit: int = 3):
    head = split(text)[0]
    tagged = odd_name(head, tag="#a")
    stream = words(text)
    chosen = omni.switch(route(text), {"a": nested, "b": branch}, tagged)
    return {"chosen": chosen, "n": count(stream), "words": stream, "listed": odd_name([head])}


CALL_NAMES = ["split", "split[0]", 'say "hi" #1', "words", "count", "route", "switch", "Model"]


def dot_problems(text: str) -> list[str]:
    """Syntax problems of a dot file: quoted strings, braces and statements."""
    problems, depth, i = [], 0, 0
    if not text.startswith("digraph "):
        problems.append("does not start with 'digraph'")
    while i < len(text):
        ch = text[i]
        if ch == '"':
            end = i + 1
            while end < len(text) and text[end] != '"':
                end += 2 if text[end] == "\\" else 1
            if end >= len(text) or "\n" in text[i:end]:
                problems.append(f"unterminated string at {i}")
            i = end
        elif ch in "{}":
            depth += 1 if ch == "{" else -1
            if depth < 0:
                problems.append(f"unbalanced '}}' at {i}")
        i += 1
    if depth != 0:
        problems.append(f"{depth} unclosed braces")
    return problems


def test_text_lists_calls_branches_and_outputs() -> None:
    text = render(everything, "text")
    assert text.startswith("graph everything(text: str, limit: int = 3)  # ")
    assert "  split = split(text)\n" in text
    assert "  split[0] = split[0]\n" in text
    assert "  say \"hi\" #1 = say \"hi\" #1(split[0], tag='#a')\n" in text
    assert "  words = words(text)  [stream]\n" in text
    assert "  switch = switch(route, say \"hi\" #1)\n" in text
    assert "      'a' -> nested(text: str)\n" in text
    assert "              'q\"<#>' -> branch(text: str)\n" in text
    assert "Model = Model(path='big')(text)  [replicas=3]" in text
    assert "  say \"hi\" #1_2 = say \"hi\" #1([split[0]])\n" in text
    assert "  output words = words  [stream]\n" in text
    assert "  output chosen = switch\n" in text


def test_text_of_a_single_output_graph() -> None:
    text = render(omni.Graph.of(words), "text")
    assert text.splitlines()[1:] == ["  words = words(text)  [stream]",
                                     "  output = words  [stream]"]


def test_mermaid_is_a_flowchart_with_safe_ids_and_labels() -> None:
    text = render(everything, "mermaid")
    lines = text.splitlines()
    assert lines[0] == "flowchart TD"
    for line in lines[1:]:
        stripped = line.strip()
        assert stripped.count('"') % 2 == 0, line
        if stripped.startswith(("%%", "subgraph ")) or stripped == "end":
            continue
        assert re.fullmatch(r"[A-Za-z0-9_]+(\W.*)?", stripped), line
        assert "#" not in re.sub(r"#(quot|35|lt|gt|96);", "", stripped), line
    assert sum(ln.strip().startswith("subgraph ") for ln in lines) == sum(
        ln.strip() == "end" for ln in lines) == 4
    assert 'in0(["text: str"])' in text and 'out0[/"chosen"/]' in text
    assert '-->|"tag"|' not in text  # `tag` is a constant: no edge
    assert re.search(r'n\d+ -\.->\|"\'a\'"\| n\d+b0_n\d+', text)  # a dashed branch edge
    assert re.search(r"n\d+ ==>\|\"items\"\| n\d+", text)  # the stream into `count`
    assert "say #quot;hi#quot; #35;1" in text


def test_dot_is_a_valid_digraph_naming_every_node() -> None:
    text = render(everything, "dot")
    assert dot_problems(text) == []
    for name in CALL_NAMES:
        escaped = name.replace('"', '\\"')
        assert f'label="{escaped}' in text, name
    assert "subgraph cluster_" in text and "style=dashed" in text
    assert 'label="q\\"<#>' not in text  # the branch value is repr'd: 'q"<#>'
    assert "label=\"'q\\\"<#>': branch\"" in text


def test_unknown_format_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown format 'svg'"):
        render(everything, "svg")  # type: ignore[arg-type]


def test_dot_problems_catches_broken_text() -> None:
    """The checker itself: it must see an unclosed brace and an unterminated string."""
    assert dot_problems('digraph "g" {\n  a -> b;\n') != []
    assert dot_problems('digraph "g {\n}\n') != []


# ---------------------------------------------------------------------------------------------
# omni graph show, end to end


def test_show_text_of_hello(omni_cli: Cli) -> None:
    result = omni_cli("graph", "show", "examples/hello.py")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("graph hello(text: str)")
    assert "'short' -> shout(text: str)" in result.stdout
    assert "output words = words  [stream]" in result.stdout


@pytest.mark.parametrize("fmt", ["mermaid", "dot"])
def test_show_diagrams_of_hello(omni_cli: Cli, fmt: str) -> None:
    result = omni_cli("graph", "show", "examples/hello.py", "--format", fmt)
    assert result.returncode == 0, result.stderr
    if fmt == "mermaid":
        assert result.stdout.startswith("flowchart TD\n")
    else:
        assert dot_problems(result.stdout) == []
    for name in ["upper", "classify", "switch", "shout", "summarize", "Greeter", "words",
                 "reply", "greeting"]:
        assert f'"{name}' in result.stdout, name


def test_show_a_named_node(omni_cli: Cli, graphs: Path) -> None:
    result = omni_cli("graph", "show", "two.py", "letters", "-f", "text", cwd=graphs)
    assert result.returncode == 0, result.stderr
    assert "letters = letters(text)  [stream]" in result.stdout
