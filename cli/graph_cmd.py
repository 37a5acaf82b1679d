"""``omni graph ...``: inspect graphs without running them (``omni graph show``)."""

from __future__ import annotations

import sys
from enum import StrEnum
from typing import Annotated

import typer

from cli._errors import reporting
from cli._load import load_graph
from omni.graph.render import render

__all__ = ["Format", "app", "show"]

app = typer.Typer(help="Inspect graphs without running them.", no_args_is_help=True)


class Format(StrEnum):
    """The formats of ``omni graph show`` (see `omni.graph.render.render`)."""

    text = "text"
    mermaid = "mermaid"
    dot = "dot"


@app.command("show")
def show(
    file: Annotated[str, typer.Argument(
        metavar="FILE", help="Python file that defines the graph.", show_default=False)],
    graph_name: Annotated[str | None, typer.Argument(
        metavar="GRAPH", show_default=False,
        help="Name of the graph (or node) in FILE; needed only when FILE defines several.")
    ] = None,
    output_format: Annotated[Format, typer.Option(
        "--format", "-f", case_sensitive=False,
        help="text: one line per call; mermaid: a flowchart for Markdown; dot: a Graphviz "
             "digraph (pipe it to `dot -Tsvg`).")] = Format.text,
    debug: Annotated[bool, typer.Option(
        "--debug", help="Show tracebacks for errors, not only the one-line message.")] = False,
) -> None:
    """Print GRAPH's inputs, node calls, switch branches and outputs.

    Streaming outputs are marked; switch branches are listed under their switch (dashed
    edges in the diagrams). Exit status 2 when FILE does not load or the graph does not
    validate.

    Example: omni graph show examples/hello.py --format mermaid
    """
    with reporting(debug):
        graph = load_graph(file, graph_name)
        sys.stdout.write(render(graph, output_format.value))
