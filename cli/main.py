"""The ``omni`` command: the typer app and its entry point.

Each command group lives in its own module and is registered here: ``run`` and ``serve``
(single commands), ``graph`` and ``cluster`` (sub-apps). A new group is a module with a
``typer.Typer`` named ``app``, added with `app.add_typer` below.
"""

from __future__ import annotations

from typing import Annotated

import typer

import omni
from cli import cluster_cmd, graph_cmd
from cli.run import run
from cli.serve import serve

__all__ = ["app", "main"]

app = typer.Typer(
    name="omni",
    help="Omni: run multimodal inference pipelines (graphs of models and functions).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.command("run", no_args_is_help=True)(run)
app.command("serve", no_args_is_help=True)(serve)
app.add_typer(graph_cmd.app, name="graph")
app.add_typer(cluster_cmd.app, name="cluster")


def _show_version(value: bool) -> None:
    if value:
        typer.echo(f"omni {omni.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_show_version, is_eager=True,
        help="Print the version and exit.")] = False,
) -> None:
    """Omni: run multimodal inference pipelines (graphs of models and functions)."""


def main() -> None:
    """Entry point of the ``omni`` console script and of ``python -m cli``."""
    app(prog_name="omni")
