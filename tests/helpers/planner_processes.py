"""Real processes for the planner's end-to-end tests, and clients that load them.

- :class:`PlannerProcess`: ``llm-pipeline planner`` as a subprocess; its workers (started by
  its local connector, each in a session of its own) are killed with it, whatever happens.
- :class:`Clients`: closed-loop clients of the official ``openai`` SDK against a frontend,
  recording each request's prompt, ``max_tokens`` and what came back (text or the error);
  ``max_retries=0``, so that an error the server let through is seen, not retried away.
- :func:`reference`: what a fault-free, in-process ``serve --engine mocker`` answers to the
  same requests (the mocker's tokens are a function of the prompt and the position, so a
  migrated or disaggregated stream must equal it).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

import anyio
import httpx
import openai

__all__ = (
    "Clients",
    "PlannerProcess",
    "Result",
    "explained",
    "reference",
    "settled_for",
    "worker_command",
)

_BANNER = re.compile(r"llm-pipeline planner on (?P<url>http://\S+) planning")
_CHANGE = re.compile(
    r"planner: (?P<model>.+?) \((?P<role>\w+)\): "
    r"(?P<before>\d+) -> (?P<after>\d+) workers \((?P<reason>\w+)\)"
)


def worker_command(*mocker: str) -> str:
    """A ``--worker-command`` running a mocker worker with these mocker options."""
    return (
        f"{sys.executable} -m operators.cli worker --nats {{nats}} --model-name {{model}} "
        "--role {role} --worker-id {worker_id} --drain-timeout {drain_timeout} "
        f"--log-level info --engine mocker {' '.join(mocker)}"
    )


class PlannerProcess:
    """One ``llm-pipeline planner`` subprocess (``--port 0``); ``url`` once it plans."""

    def __init__(self, nats: str, *options: str, startup_timeout: float = 30.0) -> None:
        self._out: IO[bytes] = tempfile.TemporaryFile()  # closed in stop()
        self._err: IO[bytes] = tempfile.TemporaryFile()
        self._last_log = ""
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "operators.cli",
                "planner",
                "--nats",
                nats,
                "--port",
                "0",
                *options,
            ],
            stdout=self._out,
            stderr=self._err,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        deadline = time.monotonic() + startup_timeout
        while (match := _BANNER.search(self.stdout())) is None:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the planner did not start: {self.log()}")
            time.sleep(0.05)
        self.url = match["url"]

    def stdout(self) -> str:
        self._out.seek(0)
        return self._out.read().decode(errors="replace")

    def log(self) -> str:
        """Everything the planner and its workers logged so far (after :meth:`stop`: all)."""
        if self._err.closed:
            return self._last_log
        self._err.seek(0)
        return self._err.read().decode(errors="replace")

    def changes(self, role: str | None = None) -> list[tuple[int, int, str]]:
        """(before, after, reason) of each change of a pool's size, in order."""
        return [
            (int(m["before"]), int(m["after"]), m["reason"])
            for m in _CHANGE.finditer(self.log())
            if role is None or m["role"] == role
        ]

    def wait_logged(self, text: str, within: float = 15.0) -> None:
        """Wait until the log says ``text``."""
        deadline = time.monotonic() + within
        while text not in self.log():
            if time.monotonic() > deadline:
                raise TimeoutError(f"the planner did not log {text!r} within {within}s")
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/status", timeout=5).json()

    async def astatus(self, client: httpx.AsyncClient) -> dict[str, Any]:
        return (await client.get(f"{self.url}/status", timeout=5)).json()

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=5).text

    def groups(self) -> dict[str, int]:
        """worker id -> process group, of every worker it started."""
        found = re.findall(r"started worker (\S+) .*process group (\d+)", self.log())
        return {worker_id: int(group) for worker_id, group in found}

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM (it drains its workers), and its exit code."""
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def stop(self) -> None:
        """Stop it and every worker it started, however it takes."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for group in self.groups().values():
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not self._err.closed:
            self._last_log = self.log()
            self._err.close()
            self._out.close()


@dataclass(frozen=True, slots=True)
class Result:
    """One request: what was asked, and the text (None: it failed with ``error``)."""

    prompt: str
    max_tokens: int
    text: str | None
    error: str | None = None
    ttft: float | None = None


@dataclass
class Clients:
    """Closed-loop streaming clients of ``base_url``; each client sends its next request as
    its last one ends, cycling through ``prompts`` and ``max_tokens``."""

    base_url: str
    model: str
    prompts: Sequence[str]
    max_tokens: Sequence[int] = (16,)
    results: list[Result] = field(default_factory=list)

    async def phase(
        self, clients: int, done: Callable[[], Awaitable[bool]], within: float, *, poll: float = 0.5
    ) -> float:
        """Run ``clients`` clients until ``done()`` holds (asked every ``poll`` s); then
        each finishes its request. Returns how long it took.

        Raises:
            TimeoutError: ``done()`` did not hold within ``within`` seconds.
        """
        started = time.monotonic()
        stop = anyio.Event()
        client = openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0)
        in_time = False
        async with client, anyio.create_task_group() as tg:
            for index in range(clients):
                tg.start_soon(self._client, client, index, stop)
            try:
                with anyio.move_on_after(within):
                    while not await done():  # noqa: ASYNC110 - other processes: no event
                        await anyio.sleep(poll)
                    in_time = True
            finally:
                stop.set()
        if not in_time:
            raise TimeoutError(f"a phase of {clients} clients did not end within {within:g}s")
        return time.monotonic() - started

    async def _client(self, client: openai.AsyncOpenAI, index: int, stop: anyio.Event) -> None:
        turn = index
        while not stop.is_set():
            prompt = self.prompts[turn % len(self.prompts)]
            max_tokens = self.max_tokens[turn % len(self.max_tokens)]
            turn += len(self.prompts) + 1
            started = time.monotonic()
            first = None
            parts: list[str] = []
            try:
                stream = await client.chat.completions.create(
                    model=self.model,
                    messages=[{"role": "user", "content": prompt}],
                    max_tokens=max_tokens,
                    stream=True,
                )
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        if first is None:
                            first = time.monotonic() - started
                        parts.append(chunk.choices[0].delta.content)
            except Exception as exc:  # any error a client sees fails the test
                self.results.append(Result(prompt, max_tokens, None, repr(exc)))
            else:
                self.results.append(Result(prompt, max_tokens, "".join(parts), None, first))

    @property
    def errors(self) -> list[Result]:
        return [result for result in self.results if result.error is not None]


def reference(base_url: str, model: str, results: Sequence[Result]) -> dict[tuple[str, int], str]:
    """The fault-free answer to each (prompt, max_tokens) in ``results``."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    answers = {}
    for prompt, max_tokens in sorted({(r.prompt, r.max_tokens) for r in results}):
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens
        )
        answers[(prompt, max_tokens)] = reply.choices[0].message.content or ""
    client.close()
    return answers


@contextlib.asynccontextmanager
async def explained(planner: PlannerProcess) -> AsyncIterator[None]:
    """A failure inside says, too, what the planner decided (its last 40 decisions)."""
    try:
        yield
    except (TimeoutError, AssertionError) as exc:
        lines = [line for line in planner.log().splitlines() if "operators.planner" in line]
        raise AssertionError(
            f"{exc}\nthe planner's last lines:\n" + "\n".join(lines[-40:])
        ) from exc


def settled_for(planner: PlannerProcess, seconds: float) -> Callable[[dict[str, Any]], bool]:
    """Whether a pool's last change is at least ``seconds`` old (status pool -> bool)."""

    def settled(pool: dict[str, Any]) -> bool:
        changes = pool["changes"]
        return not changes or time.time() - changes[0]["at"] >= seconds

    return settled
