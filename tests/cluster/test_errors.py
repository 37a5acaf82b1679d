"""How a worker's error travels to the driver (`omni.cluster.protocol.Failure`): trio's
exception groups unwrapped, each error of several named, the traceback text kept, and raised
at the driver as a `RemoteNodeError` whose printed traceback shows the worker's."""

from __future__ import annotations

import traceback

import msgspec
import pytest

from omni.cluster.errors import RemoteNodeError
from omni.cluster.protocol import Failure
from omni.errors import describe
from omni.graph.errors import NodeError
from omni.serve._requests import graph_error


def raised(error: BaseException) -> BaseException:
    """`error` as raised (with a traceback)."""
    try:
        raise error
    except BaseException as caught:  # any error, as a worker catches it
        return caught


def bad_weights() -> None:
    raise ValueError("bad weights path")


def test_a_group_of_one_is_its_exception_at_any_depth() -> None:
    try:
        bad_weights()
    except ValueError as exc:
        inner = exc
    group = raised(ExceptionGroup("outer", [ExceptionGroup("inner", [inner])]))
    assert describe(group) == ("ValueError", "bad weights path")
    failure = Failure.of(group)
    assert (failure.remote_type, failure.message) == ("ValueError", "bad weights path")
    assert 'raise ValueError("bad weights path")' in failure.traceback
    assert "ExceptionGroup" not in failure.traceback


def test_a_group_of_several_names_each() -> None:
    group = raised(ExceptionGroup("nursery", [ValueError("a"), KeyError("b"),
                                              ExceptionGroup("one", [RuntimeError()])]))
    assert describe(group) == ("ExceptionGroup",
                               "3 errors: ValueError: a; KeyError: 'b'; RuntimeError")


def test_the_driver_raises_it_naming_the_worker_with_its_traceback_as_a_note() -> None:
    sent = Failure.of(raised(ValueError("bad weights path")))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=Failure | None)
    error = wire.error("w1")
    assert isinstance(error, RemoteNodeError) and error.member == "w1"
    assert (error.remote_type, error.remote_message) == ("ValueError", "bad weights path")
    assert str(error) == "ValueError: bad weights path (on worker 'w1')"
    printed = "".join(traceback.format_exception(error))
    assert "on worker 'w1':\nTraceback" in printed and "raise error" in printed


@pytest.mark.parametrize("remote_type, status", [
    ("ValueError", 400), ("UnicodeDecodeError", 400), ("KeyError", 500), ("BadWeights", 500)])
def test_a_nodes_error_on_a_worker_reads_and_answers_as_it_would_here(remote_type: str,
                                                                       status: int) -> None:
    """The user reads the remote error's own type, once (not `RemoteNodeError: ValueError`),
    and a served client gets the status the same error gets without a cluster."""
    cause = RemoteNodeError("w1", remote_type, "no such voice")
    failed = NodeError("Speak", "req-1", cause)
    assert str(failed) == (f"node 'Speak' failed in request req-1: {remote_type}: no such "
                           "voice (on worker 'w1')")
    answer = graph_error(failed)
    assert answer.status == status
    assert answer.message == f"node 'Speak' failed: {remote_type}: no such voice (on worker 'w1')"
