"""How the CLI reports a user's mistake: one ``error: ...`` line on stderr and an exit code.

Commands run their body inside `reporting(debug)`: a `CliError` (or a library error that means
the same, such as a `GraphError`) becomes that one line and ``typer.Exit``; ``--debug`` adds the
traceback. Exit codes: 0 success, 1 a request failed, 2 bad usage or a graph that does not load
or validate, 130 interrupted (SIGINT), 143 terminated (SIGTERM).
"""

from __future__ import annotations

import signal
import sys
import traceback
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from omni import GraphError

__all__ = ["EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_TERMINATED", "EXIT_USAGE", "CliError",
           "Stopped", "error_line", "first_of", "reporting"]

EXIT_FAILED = 1  # a request (or a node starting up) failed
EXIT_USAGE = 2  # bad usage, a file that does not load, a graph that does not validate
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_TERMINATED = 143  # 128 + SIGTERM


class CliError(Exception):
    """A mistake the user can fix; `message` is printed after ``error: `` on one line."""

    def __init__(self, message: str, *, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code


class Stopped(Exception):
    """A signal ended the command, once its work had unwound (see `cli._signals`)."""

    def __init__(self, signum: int):
        interrupted = signum == signal.SIGINT
        super().__init__("interrupted" if interrupted else "terminated")
        self.message = str(self)
        self.signal_name = signal.Signals(signum).name
        self.exit_code = EXIT_INTERRUPTED if interrupted else EXIT_TERMINATED


def first_of(error: BaseException, kind: type[BaseException] | tuple[type[BaseException], ...]
             ) -> BaseException | None:
    """`error` if it is a `kind`, else the first `kind` inside it (an exception group), else
    None: trio nurseries wrap errors in groups, and the user wants the one that matters."""
    if isinstance(error, kind):
        return error
    if isinstance(error, BaseExceptionGroup):
        match, _ = error.split(kind)
        while isinstance(match, BaseExceptionGroup):
            match = match.exceptions[0]
        return match
    return None


def error_line(message: str) -> None:
    """Write ``error: <message>`` to stderr as a single line."""
    one_line = " ".join(message.splitlines()) or "unknown error"
    sys.stderr.write(f"error: {one_line}\n")
    sys.stderr.flush()


@contextmanager
def reporting(debug: bool) -> Iterator[None]:
    """Turn user mistakes raised in the block into one stderr line and ``typer.Exit``.

    Args:
        debug: also print the traceback (of the mistake and what caused it).
    """
    try:
        yield
    except CliError as exc:
        _fail(exc, exc.message, exc.exit_code, debug)
    except GraphError as exc:
        _fail(exc, str(exc), EXIT_USAGE, debug)
    except Stopped as exc:
        _fail(exc, exc.message, exc.exit_code, debug)
    except KeyboardInterrupt as exc:
        _fail(exc, "interrupted", EXIT_INTERRUPTED, debug)


def _fail(exc: BaseException, message: str, exit_code: int, debug: bool) -> None:
    if debug:
        traceback.print_exception(exc)
    error_line(message)
    raise typer.Exit(exit_code) from None
