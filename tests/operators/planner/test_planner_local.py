"""``--connector local`` (``operators.planner.local.LocalConnector``) with real processes:
stand-ins for workers (a shell, ``sleep``, a Python that drains on SIGTERM), so that what is
tested is the supervision: starting, draining, restarting with back-off, killing only a
worker that will not leave."""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
from pathlib import Path

import anyio
import pytest

from operators.planner import local
from operators.planner.local import LocalConnector, check_template

POOL = ("m", "aggregated")


def drains(folder: Path) -> str:
    """A worker stand-in: exits 0 on SIGTERM (as a worker does once drained), else sleeps;
    it says it is ready (its handler in place) with a file named after its worker id."""
    return (
        f"{sys.executable} -c 'import pathlib, signal, sys, time; "
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
        "pathlib.Path(sys.argv[2], sys.argv[1]).touch(); time.sleep(60)' "
        f"{{worker_id}} {folder}"
    )


def _groups(caplog: pytest.LogCaptureFixture) -> dict[str, int]:
    """worker id -> process group, from the connector's "started" lines."""
    found = re.findall(r"started worker (\S+) .*process group (\d+)", caplog.text)
    return {worker_id: int(group) for worker_id, group in found}


def _alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def _until(condition, within: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - other processes: no event to wait on
            await anyio.sleep(0.02)


@pytest.fixture(autouse=True)
def _info(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="operators.planner.local")


async def test_workers_start_and_leave_by_draining(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    async with LocalConnector({POOL: drains(tmp_path)}, nats="x", drain_timeout=5) as connector:
        await connector.scale_to(*POOL, 2)
        await _until(lambda: len(list(tmp_path.iterdir())) == 2)
        first, second = _groups(caplog)
        assert {(w.worker_id, w.state) for w in connector.list()} == {
            (first, "running"),
            (second, "running"),
        }
        await connector.scale_to(*POOL, 1, leaving=[first])
        await _until(lambda: f"worker {first} of 'm' (aggregated) left: exit code 0" in caplog.text)
        assert [w.worker_id for w in connector.list()] == [second]
    assert f"worker {second} of 'm' (aggregated) left: exit code 0" in caplog.text
    assert connector.list() == []
    assert not any(_alive(group) for group in _groups(caplog).values())


async def test_fields_are_filled_in_and_shell_quoted(caplog: pytest.LogCaptureFixture) -> None:
    template = "sleep 60 # {model} {role} {worker_id} {nats} {drain_timeout}"
    pool = ("it's a model", "decode")
    async with LocalConnector({pool: template}, nats="nats://h:1", drain_timeout=2.5) as connector:
        await connector.scale_to(*pool, 1)
        await _until(lambda: len(_groups(caplog)) == 1)
        [worker_id] = _groups(caplog)
        assert worker_id.startswith("decode-")
        expected = f"sleep 60 # 'it'\"'\"'s a model' decode {worker_id} nats://h:1 2.5"
        assert expected in caplog.text


@pytest.mark.time_limit(20)
async def test_a_command_that_keeps_failing_is_retried_ever_more_slowly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    restarted: list[tuple[str, str]] = []
    connector = LocalConnector(
        {POOL: "exit 3; {worker_id}"},
        nats="nats://x",
        drain_timeout=1,
        on_restart=lambda *pool: restarted.append(pool),
    )
    async with connector:
        await connector.scale_to(*POOL, 1)
        with anyio.fail_after(10):
            while len(restarted) < 3:  # noqa: ASYNC110 - other processes
                await anyio.sleep(0.02)
        [worker] = connector.list()
        assert (worker.state, worker.restarts) == ("restarting", 3)
    delays = re.findall(r"exit code 3 after [\d.]+ s: starting another in (\S+) s", caplog.text)
    assert delays[:3] == ["1", "2", "4"]
    assert restarted == [POOL] * 3
    assert len(_groups(caplog)) == 3  # one start per attempt: no tight loop


async def test_a_worker_killed_by_something_else_is_replaced(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    async with LocalConnector({POOL: drains(tmp_path)}, nats="x", drain_timeout=5) as connector:
        await connector.scale_to(*POOL, 1)
        await _until(lambda: len(_groups(caplog)) == 1)
        [(killed, group)] = _groups(caplog).items()
        os.killpg(group, signal.SIGKILL)
        await _until(lambda: len(_groups(caplog)) == 2)
        [worker] = connector.list()
        assert worker.worker_id != killed
        assert (worker.state, worker.restarts) == ("running", 1)
    assert f"worker {killed} of 'm' (aggregated) killed by SIGKILL after" in caplog.text


async def test_a_worker_that_will_not_leave_is_killed_after_the_drain_timeout(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(local, "_GRACE", 0.3)
    stubborn = "trap '' TERM; sleep 60; # {worker_id}"  # (the shell and sleep ignore SIGTERM)
    async with LocalConnector({POOL: stubborn}, nats="nats://x", drain_timeout=0.2) as connector:
        await connector.scale_to(*POOL, 1)
        await _until(lambda: len(_groups(caplog)) == 1)
        [(worker_id, group)] = _groups(caplog).items()
        await connector.scale_to(*POOL, 0, leaving=[worker_id])
        await _until(lambda: "left: killed by SIGKILL" in caplog.text)
        assert not _alive(group)
        assert connector.list() == []
    assert "still there 0.5 s after SIGTERM: SIGKILL" in caplog.text


async def test_scaling_down_takes_those_restarting_first(tmp_path: Path) -> None:
    commands = {POOL: drains(tmp_path), ("m", "prefill"): "exit 1; {worker_id}"}
    async with LocalConnector(commands, nats="nats://x", drain_timeout=5) as connector:
        await connector.scale_to(*POOL, 1)
        await connector.scale_to("m", "prefill", 1)
        await _until(lambda: any(w.state == "restarting" for w in connector.list()))
        await connector.scale_to("m", "prefill", 0)
        await _until(lambda: [w.role for w in connector.list()] == ["aggregated"])


@pytest.mark.parametrize(
    ("template", "problem"),
    [
        ("worker --id {id}", "unknown field 'id'"),
        ("worker --model {model}", "it must pass {worker_id} to the worker"),
        ("worker {worker_id", "not a format string"),
        ("worker {{worker_id}}", "it must pass {worker_id}"),
    ],
)
def test_a_bad_template_is_refused_naming_the_problem(template: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        check_template(template)


async def test_a_pool_without_a_command_is_refused() -> None:
    async with LocalConnector(
        {POOL: "sleep 9 # {worker_id}"}, nats="x", drain_timeout=1
    ) as connector:
        with pytest.raises(ValueError, match="no worker command for 'other'"):
            await connector.scale_to("other", "aggregated", 1)
        with pytest.raises(ValueError, match="cannot run -1 workers"):
            await connector.scale_to(*POOL, -1)
    with pytest.raises(RuntimeError, match="inside `async with connector:`"):
        await connector.scale_to(*POOL, 1)
