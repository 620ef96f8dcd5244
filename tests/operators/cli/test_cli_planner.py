"""``llm-pipeline planner`` end to end: every process real (a nats-server, a ``serve --nats``
frontend, the planner and the mocker workers its local connector starts), driven by the
official ``openai`` client, compared with a fault-free in-process server.

The mocker's timing makes the load ramp mean something: a worker holds 4 sequences
(``--mocker-max-batch 4``) of 16 tokens at 25 ms a step, so 12 closed-loop clients queue on
one worker (TTFT p90 near a second) and on two (about half a second) but not on three
(tens of ms), against a 200 ms target; 3 clients fit on one worker. Simulated time is
slept, not computed, so it holds on a loaded machine. The 3-minute steady load of the
issue is here with real processes (6 clients on slower steps, which one worker cannot
carry and two carry with a slot to spare each), and in the policy's property test on a
simulated clock (``tests/operators/planner/test_planner_policy.py``).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

pytest.importorskip("nats", reason="the planner needs the nats extra: pip install -e '.[nats]'")

from tests.helpers.nats_server import NatsServer
from tests.helpers.planner_processes import (
    Clients,
    PlannerProcess,
    explained,
    reference,
    settled_for,
    worker_command,
)
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

MODEL = "mocker"
MOCKER = ("--mocker-max-batch", "4", "--mocker-decode-ms-per-step", "25")
PROMPTS = [f"Tell me about the number {number}." for number in range(7)]
COOLDOWN = 8.0
PLANNING = ("--interval", "2", "--cooldown", f"{COOLDOWN:g}", "--drain-timeout", "1")


@pytest.fixture
def nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fault_free() -> Iterator[ServerProcess]:
    """The reference: an in-process mocker, no NATS, no planner."""
    server = ServerProcess("--engine", "mocker", "--mocker-decode-ms-per-step", "0")
    yield server
    server.stop()


@pytest.fixture
def frontend(nats: NatsServer) -> Iterator[ServerProcess]:
    server = ServerProcess(
        "--nats", nats.url, "--model-name", MODEL, "--router", "kv", "--log-level", "info"
    )
    yield server
    server.stop()


def pool(status: dict, role: str = "aggregated") -> dict:  # type: ignore[type-arg]
    [found] = [p for p in status["pools"] if p["role"] == role]
    return found


def drained(log: str) -> dict[str, int]:
    """worker id -> requests in flight when it was asked to drain."""
    return {
        worker: int(count)
        for worker, count in re.findall(
            r"worker (\S+) asked to drain: deregisters and drains (\d+)", log
        )
    }


def assert_as_fault_free(clients: Clients, server: ServerProcess) -> None:
    assert not clients.errors, clients.errors[:3]
    expected = reference(server.base_url, MODEL, clients.results)
    wrong = [r for r in clients.results if r.text != expected[(r.prompt, r.max_tokens)]]
    assert not wrong, wrong[:3]


@pytest.mark.time_limit(240)
async def test_a_load_ramp_scales_1_3_1_and_no_client_sees_it(
    nats: NatsServer, frontend: ServerProcess, fault_free: ServerProcess
) -> None:
    planner = PlannerProcess(
        nats.url,
        "--model", MODEL,
        "--ttft-p90-ms", "200",
        "--max-workers", "4",
        *PLANNING,
        "--worker-command", worker_command(*MOCKER),
    )  # fmt: skip
    clients = Clients(frontend.base_url, MODEL, PROMPTS, max_tokens=(16, 16, 16, 80))
    settled = settled_for(planner, 2 * COOLDOWN)
    try:
        async with explained(planner), httpx.AsyncClient() as http:

            async def size() -> tuple[int, int]:
                found = pool(await planner.astatus(http))
                return found["workers"], found["serving"]

            async def steady_at_least(n: int) -> bool:
                found = pool(await planner.astatus(http))
                return found["serving"] >= n and found["workers"] >= n and settled(found)

            async def back_to_one() -> bool:
                return await size() == (1, 1) and len(planner.changes()) > 1

            async def one() -> bool:
                return await size() == (1, 1)

            await clients.phase(0, one, within=30)
            await clients.phase(3, after(8), within=20)
            assert planner.changes() == [(0, 1, "min_workers")]  # 3 clients fit on one
            await clients.phase(12, lambda: steady_at_least(3), within=100)
            await clients.phase(3, back_to_one, within=60)
        changes = planner.changes()
        sizes = [changes[0][0]] + [after for _, after, _ in changes]
        assert sizes[:2] == [0, 1]
        assert max(sizes) >= 3
        assert sizes[-1] == 1
        ups = [reason for before, after, reason in changes[1:] if after > before]
        downs = [reason for before, after, reason in changes[1:] if after < before]
        assert set(ups) <= {"ttft_missed", "predicted"}
        assert set(downs) == {"headroom"}
        # one step per cool-down at most (the status keeps the last ten changes)
        times = sorted(change["at"] for change in pool(planner.status())["changes"])[1:]
        assert all(b - a >= COOLDOWN - 0.5 for a, b in itertools.pairwise(times))
        # each worker drained by a step down had streams in flight, and exited 0
        log = planner.log()
        gone = drained(log)
        assert len(gone) == len(downs)
        assert sum(gone.values()) > 0
        for worker in gone:
            planner.wait_logged(f"worker {worker} of '{MODEL}' (aggregated) left: exit code 0")
        assert_as_fault_free(clients, fault_free)
        assert planner.terminate() == 0
        [last] = set(planner.groups()) - set(gone)
        assert f"worker {last} of '{MODEL}' (aggregated) left: exit code 0" in planner.log()
    finally:
        planner.stop()


def after(seconds: float) -> Callable[[], Awaitable[bool]]:
    """A phase's ``done``: ``seconds`` have passed since it was made."""
    started = time.monotonic()

    async def done() -> bool:
        return time.monotonic() - started >= seconds

    return done


#: the reasons of a decision that changes a pool's size (the others hold it)
STEPS = ("min_workers", "max_workers", "ttft_missed", "itl_missed", "predicted", "idle", "headroom")
STEADY_FOR = 180.0  # seconds: the three minutes
#: slower steps than the ramp's, for margins the machine's noise cannot cross: a request
#: takes 16 x 50 ms, so of 6 clients on one worker (4 at a time) 2 wait about 800 ms for a
#: slot (a p90 far over 400 ms), while two workers carry 3 each with a slot to spare (a
#: TTFT of one 50 ms step, far under it)
STEADY_MOCKER = ("--mocker-max-batch", "4", "--mocker-decode-ms-per-step", "50")


def decisions(metrics: str) -> dict[str, float]:
    """reason -> decisions so far, of the one pool, from the planner's /metrics."""
    return {
        reason: float(count)
        for reason, count in re.findall(
            r'llm_pipeline_planner_decisions_total\{[^}]*reason="(\w+)"[^}]*\} (\S+)', metrics
        )
    }


@pytest.mark.time_limit(STEADY_FOR + 150)
async def test_a_steady_load_held_for_three_minutes_brings_no_scale_event(
    nats: NatsServer, frontend: ServerProcess, fault_free: ServerProcess
) -> None:
    planner = PlannerProcess(
        nats.url,
        "--model", MODEL,
        "--ttft-p90-ms", "400",
        "--max-workers", "4",
        *PLANNING,
        "--worker-command", worker_command(*STEADY_MOCKER),
    )  # fmt: skip
    clients = Clients(frontend.base_url, MODEL, PROMPTS)
    settled = settled_for(planner, 2 * COOLDOWN)
    plateau: dict[str, Any] = {}
    try:
        async with explained(planner), httpx.AsyncClient() as http:

            async def one() -> bool:
                found = pool(await planner.astatus(http))
                return (found["workers"], found["serving"]) == (1, 1)

            async def held() -> bool:
                """Settled (at two workers, or three after a step too many), then held
                there for three minutes."""
                if not plateau:
                    found = pool(await planner.astatus(http))
                    if found["workers"] == found["serving"] >= 2 and settled(found):
                        plateau.update(
                            at=time.monotonic(),
                            changes=planner.changes(),
                            decisions=decisions((await http.get(f"{planner.url}/metrics")).text),
                        )
                    return False
                return time.monotonic() - plateau["at"] >= STEADY_FOR

            await clients.phase(0, one, within=30)
            await clients.phase(6, held, within=STEADY_FOR + 90)
            after_plateau = decisions(planner.metrics())
            assert planner.changes() == plateau["changes"]  # not one change of size
            before = plateau["decisions"]
            assert {r: after_plateau[r] - before[r] for r in STEPS} == dict.fromkeys(STEPS, 0.0)
            # (it did decide, every interval: to hold)
            assert after_plateau["steady"] - before["steady"] >= STEADY_FOR / 2 / 2
            ups = [why for b, a, why in plateau["changes"] if a > b]
            assert ups[0] == "min_workers"
            assert set(ups[1:]) <= {"ttft_missed", "predicted"}
        assert_as_fault_free(clients, fault_free)
    finally:
        planner.stop()


@pytest.mark.time_limit(120)
async def test_at_zero_load_it_scales_down_to_its_minimum(
    nats: NatsServer, frontend: ServerProcess
) -> None:
    planner = PlannerProcess(
        nats.url,
        "--model", MODEL,
        "--ttft-p90-ms", "200",
        "--max-workers", "3",
        *PLANNING,
        "--worker-command", worker_command(*MOCKER),
    )  # fmt: skip
    clients = Clients(frontend.base_url, MODEL, PROMPTS)
    try:
        async with explained(planner), httpx.AsyncClient() as http:

            async def workers() -> int:
                return int(pool(await planner.astatus(http))["serving"])

            async def two() -> bool:
                return await workers() >= 2

            async def one() -> bool:
                return await workers() == 1

            await clients.phase(0, one, within=30)
            await clients.phase(12, two, within=60)
            await clients.phase(0, one, within=3 * COOLDOWN)  # no load at all
        downs = [(b, a, why) for b, a, why in planner.changes() if a < b]
        assert downs == [(2, 1, "idle")]
        assert not clients.errors
        idle = (
            'llm_pipeline_planner_decisions_total{model="mocker",reason="idle",role="aggregated"}'
        )
        assert f"{idle} 1.0" in planner.metrics()
    finally:
        planner.stop()


@pytest.mark.time_limit(90)
async def test_a_worker_killed_by_something_else_is_replaced(
    nats: NatsServer, frontend: ServerProcess, fault_free: ServerProcess
) -> None:
    planner = PlannerProcess(
        nats.url,
        "--model", MODEL,
        "--ttft-p90-ms", "200",
        "--max-workers", "1",
        *PLANNING,
        "--worker-command", worker_command(*MOCKER),
    )  # fmt: skip
    clients = Clients(frontend.base_url, MODEL, PROMPTS)
    try:
        async with explained(planner), httpx.AsyncClient() as http:

            async def serving() -> list[str]:
                managed = pool(await planner.astatus(http))["managed"]
                return [w["id"] for w in managed if w["state"] == "running"]

            async def one() -> bool:
                return pool(await planner.astatus(http))["serving"] == 1

            await clients.phase(0, one, within=30)
            [(victim, group)] = planner.groups().items()
            os.killpg(group, signal.SIGKILL)

            async def replaced() -> bool:
                found = pool(await planner.astatus(http))
                ids = [w["id"] for w in found["managed"]]
                return found["serving"] == 1 and victim not in ids and await serving() == ids

            await clients.phase(0, replaced, within=30)
            await clients.phase(2, after(3), within=10)
        assert f"worker {victim} of '{MODEL}' (aggregated) killed by SIGKILL after" in planner.log()
        assert "starting another in 1 s" in planner.log()
        [managed] = pool(planner.status())["managed"]
        assert managed["restarts"] == 1, managed
        assert re.search(
            r"llm_pipeline_planner_worker_restarts_total\{[^}]*\} 1\.0", planner.metrics()
        )
        assert clients.results
        assert_as_fault_free(clients, fault_free)
    finally:
        planner.stop()


@pytest.mark.time_limit(60)
async def test_a_worker_command_that_fails_is_reported_and_retried_with_back_off(
    nats: NatsServer,
) -> None:
    failing = (
        f"{sys.executable} -m operators.cli worker --nats {{nats}} --worker-id {{worker_id}} "
        "--no-such-option"
    )
    planner = PlannerProcess(
        nats.url, "--model", MODEL, "--ttft-p90-ms", "200", *PLANNING, "--worker-command", failing
    )
    try:
        deadline = time.monotonic() + 40
        while len(re.findall(r"exit code 2 after", planner.log())) < 3:
            assert time.monotonic() < deadline, planner.log()
            await anyio.sleep(0.1)
        delays = re.findall(
            r"exit code 2 after [\d.]+ s: starting another in (\S+) s", planner.log()
        )
        assert delays[:3] == ["1", "2", "4"]
        assert "unrecognized arguments: --no-such-option" in planner.log()
        [managed] = pool(planner.status())["managed"]
        assert managed["restarts"] >= 3
        assert "exit code 2" in managed["detail"]
        assert re.search(
            r"llm_pipeline_planner_worker_restarts_total\{[^}]*\} [3-9]\.0", planner.metrics()
        )
        assert planner.terminate() == 0  # (with its worker waiting for a restart)
    finally:
        planner.stop()


#: prefill and decode workers of one deployment: a prompt token costs 0.25 ms to prefill
#: (six 600-token prompts at once: 0.9 s), a decode step 5 ms plus 6 ms per sequence in
#: the batch (12 sequences on one worker: 77 ms a token; on two, 41 ms)
SECRET = ("--transfer-secret", "shared-by-this-deployment")
PREFILL = worker_command(
    "--mocker-prefill-ms-per-token", "0.25", "--mocker-decode-ms-per-step", "10", *SECRET
)
DECODE = worker_command(
    "--mocker-decode-ms-per-step", "5", "--mocker-decode-ms-per-sequence", "6", *SECRET
)
LONG = [f"{number}: " + "hello " * 600 for number in range(6)]  # ~600 tokens each


@pytest.mark.time_limit(240)
async def test_disaggregated_prefill_and_decode_are_scaled_apart(
    nats: NatsServer, frontend: ServerProcess, fault_free: ServerProcess, tmp_path: Path
) -> None:
    models = tmp_path / "pools.toml"
    models.write_text(
        f'[[model]]\nname = "{MODEL}"\nrole = "prefill"\nttft-p90-ms = 500\n'
        f"worker-command = {PREFILL!r}\n\n"
        f'[[model]]\nname = "{MODEL}"\nrole = "decode"\nitl-p90-ms = 70\n'
        f"worker-command = {DECODE!r}\n"
    )
    planner = PlannerProcess(nats.url, "--models", str(models), "--max-workers", "3", *PLANNING)
    prompt_heavy = Clients(frontend.base_url, MODEL, LONG, max_tokens=(16,))
    decode_heavy = Clients(frontend.base_url, MODEL, PROMPTS, max_tokens=(48,))
    settled = settled_for(planner, 2 * COOLDOWN)
    try:
        async with explained(planner), httpx.AsyncClient() as http:

            async def pools() -> tuple[dict, dict]:  # type: ignore[type-arg]
                status = await planner.astatus(http)
                return pool(status, "prefill"), pool(status, "decode")

            async def ready() -> bool:
                prefill, decode = await pools()
                return prefill["serving"] == decode["serving"] == 1

            async def more_prefill() -> bool:
                prefill, _decode = await pools()
                return prefill["serving"] >= 2 and settled(prefill)

            async def more_decode_fewer_prefill() -> bool:
                prefill, decode = await pools()
                return (
                    decode["serving"] >= 2
                    and settled(decode)
                    and (prefill["workers"], prefill["serving"]) == (1, 1)
                )

            await prompt_heavy.phase(0, ready, within=40)
            await prompt_heavy.phase(6, more_prefill, within=90)
            assert planner.changes("decode") == [(0, 1, "min_workers")]
            await decode_heavy.phase(12, more_decode_fewer_prefill, within=90)
        prefill = planner.changes("prefill")
        ups = {why for before, after, why in prefill if after > before}
        assert "ttft_missed" in ups
        assert ups <= {"min_workers", "ttft_missed", "predicted"}
        assert {why for before, after, why in prefill if after < before} <= {"headroom", "idle"}
        assert prefill[-1][1] == 1
        ups = {why for before, after, why in planner.changes("decode") if after > before}
        assert "itl_missed" in ups
        assert ups <= {"min_workers", "itl_missed", "predicted"}
        for clients in (prompt_heavy, decode_heavy):
            assert_as_fault_free(clients, fault_free)
    finally:
        planner.stop()
