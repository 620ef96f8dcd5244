"""An engine whose process can die, watched and rebuilt in place (pipeline.health).

``build_app`` puts every engine behind a progress watchdog: nothing is asked of the
engine. To be rebuilt when it dies, an engine is given as a ``Supervised`` with a factory;
to be judged better, it may report its work (a ``progress`` count: long prefills are then
not stalls) and its death (raise ``EngineDead``, or say why in ``dead``: noticed even while
it is idle). ``GET /live``, ``/ready`` and ``/health`` tell the orchestrator.

Run it: ``python examples/engine_health.py``.
"""

from __future__ import annotations

import anyio
import httpx
from anyio.lowlevel import checkpoint

from operators.contracts.llm import EngineOutput, PreprocessedRequest
from operators.contracts.probe import one_token_probe
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, EngineDead, Stream
from pipeline.health import Supervised


class FlakyEngine:
    """Answers ``answer``, like an engine whose worker process can be killed."""

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer
        self.progress = 0  # work done, outputs or not: the watchdog counts it as progress
        self.dead: str | None = None  # why it can serve no more (None: alive)

    def kill(self) -> None:
        self.dead = "its process was killed"

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        if self.dead is not None:
            raise EngineDead(self.dead, request_id=ctx.id)
        request = ctx.data
        rest = self.answer[request.replayed_tokens :][: request.stop.max_tokens]
        for step, token_id in enumerate(rest):
            self.progress += 1
            await checkpoint()
            yield EngineOutput([token_id], finish_reason="stop" if step == len(rest) - 1 else None)


async def until_ready(http: httpx.AsyncClient, ready: bool) -> httpx.Response:
    """Ask ``/ready`` as an orchestrator does, until it says ``ready``."""
    while ((response := await http.get("/ready")).status_code == 200) != ready:  # noqa: ASYNC110
        await anyio.sleep(0.05)
    return response


async def main() -> None:
    tokenizer = Tokenizer.default()
    engines: list[FlakyEngine] = []

    async def start_engine() -> FlakyEngine:  # (what loading a model would be)
        engines.append(FlakyEngine(tokenizer.encode("Still here.")))
        return engines[-1]

    engine = Supervised(
        factory=start_engine, probe=one_token_probe, name="flaky", restarts=3, restart_window=300
    )
    app = build_app(engine, tokenizer, model_name="flaky", stall_timeout=30.0)
    probes = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")
    async with anyio.create_task_group() as tg, openai_client(app) as client, probes as http:
        await tg.start(app.health.run)  # (serve() runs it for you)
        await until_ready(http, True)
        first = await client.completions.create(model="flaky", prompt="Are you there?")
        print(f"answer: {first.choices[0].text!r}")

        engines[-1].kill()
        down = await until_ready(http, False)
        print(f"after its death: /ready {down.status_code}: {down.json()['models']['flaky']}")

        await until_ready(http, True)
        again = await client.completions.create(model="flaky", prompt="Are you there?")
        same = again.choices[0].text == first.choices[0].text
        print(f"rebuilt, the same answer: {same} ({engine.restarts} restart)")
        tg.cancel_scope.cancel()


if __name__ == "__main__":
    anyio.run(main)
