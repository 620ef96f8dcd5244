"""The exception hierarchy: what a caller can catch, and what each error carries."""

from __future__ import annotations

import anyio
import pytest

import pipeline
from pipeline import errors
from pipeline.errors import (
    CapacityExhausted,
    ConnectFailed,
    EngineDead,
    EngineError,
    EngineStalled,
    EngineUnavailable,
    InvalidRequest,
    LinkError,
    PipelineError,
    RequestError,
    ResponseTimeout,
    StreamDisconnected,
    WorkerLost,
)

# (error, its parent), as drawn in the errors module docstring
TREE = [
    (PipelineError, Exception),
    (LinkError, PipelineError),
    (RequestError, PipelineError),
    (InvalidRequest, RequestError),
    (CapacityExhausted, RequestError),
    (EngineError, RequestError),
    (WorkerLost, RequestError),
    (ConnectFailed, WorkerLost),
    (StreamDisconnected, WorkerLost),
    (ResponseTimeout, WorkerLost),
    (EngineUnavailable, CapacityExhausted),
    (EngineStalled, WorkerLost),
    (EngineDead, WorkerLost),
]


@pytest.mark.parametrize(("error", "parent"), TREE)
def test_each_error_sits_under_its_parent(error: type[Exception], parent: type[Exception]) -> None:
    assert error.__bases__ == (parent,)


def test_the_tree_covers_every_error_the_module_exports() -> None:
    assert {error.__name__ for error, _ in TREE} == set(errors.__all__)


def test_the_docstring_draws_every_error() -> None:
    assert errors.__doc__ is not None
    for error, _ in TREE:
        assert error.__name__ in errors.__doc__


@pytest.mark.parametrize(
    "error", [ConnectFailed, StreamDisconnected, ResponseTimeout, EngineStalled, EngineDead]
)
def test_the_migratable_errors_are_exactly_the_worker_lost_subtree(
    error: type[RequestError],
) -> None:
    with pytest.raises(WorkerLost):
        raise error("gone")


@pytest.mark.parametrize("error", [InvalidRequest, CapacityExhausted, EngineError, LinkError])
def test_non_migratable_errors_are_not_worker_lost(error: type[PipelineError]) -> None:
    assert not issubclass(error, WorkerLost)


def test_request_errors_carry_message_and_request_id() -> None:
    error = EngineError("engine crashed", request_id="req-1")
    assert (error.message, error.request_id, str(error)) == (
        "engine crashed",
        "req-1",
        "engine crashed",
    )
    assert StreamDisconnected("x").request_id is None


def test_invalid_request_names_the_offending_parameter() -> None:
    error = InvalidRequest("must be positive", param="max_tokens", request_id="r")
    assert (error.param, error.request_id) == ("max_tokens", "r")
    assert InvalidRequest("bad").param is None


def test_chaining_keeps_the_foreign_cause() -> None:
    cause = OSError("connection reset")
    with pytest.raises(StreamDisconnected) as info:
        try:
            raise cause
        except OSError as exc:
            raise StreamDisconnected("stream broke") from exc
    assert info.value.__cause__ is cause


async def test_cancellation_is_not_part_of_the_hierarchy() -> None:
    # `except PipelineError` (or `except Exception`) must never catch a cancellation.
    cancelled = anyio.get_cancelled_exc_class()
    assert not issubclass(cancelled, PipelineError)
    assert not issubclass(cancelled, Exception)


def test_the_package_re_exports_every_error() -> None:
    for name in errors.__all__:
        assert getattr(pipeline, name) is getattr(errors, name)
