"""Test helpers for the LLM layer: :func:`check_engine`, and an in-process OpenAI client.

:func:`check_engine` is to engines what :func:`pipeline.testing.check_operator` is to
operators: a conformance suite (docs/engines.md has the contract it checks).

:func:`openai_client` is the official ``openai.AsyncOpenAI`` (the ``openai`` package, a test
dependency) talking to an :class:`~operators.edges.openai.server.OpenAIApp` through
``httpx.ASGITransport``: no socket, no server process, the app's own error mapping and
rendering. ``httpx.ASGITransport`` returns a response once the app has finished it, so a
stream's chunks all arrive at the end (use a real server to observe timing)::

    async def test_hello() -> None:          # pytest with asyncio_mode = "auto" (or anyio)
        app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
        async with openai_client(app) as client:
            reply = await client.completions.create(model="echo", prompt="hi", max_tokens=2)
        assert reply.choices[0].text == "hi"
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import httpx

from pipeline import Context, InvalidRequest, RequestError, open_stream

from .contracts.llm import (
    EngineOutput,
    OutputOptions,
    PreprocessedRequest,
    SamplingOptions,
    StopConditions,
)

if TYPE_CHECKING:
    import anthropic
    import openai

    from pipeline import Engine

    from .edges.http.app import EdgeApp

__all__ = ("EngineFactory", "anthropic_client", "check_engine", "openai_client")


def openai_client(app: EdgeApp, *, api_key: str = "test", **options: Any) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` client for ``app``, in-process; close it (``async with``).

    ``options`` go to the client (``max_retries`` is 0 unless given: a test sees the first
    error).

    Raises:
        ImportError: the ``openai`` package is not installed.
    """
    try:
        import openai
    except ImportError as exc:  # a test dependency, not the framework's
        raise ImportError("openai_client needs the openai package: pip install openai") from exc
    options.setdefault("max_retries", 0)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1")
    # (openai's annotations name its own httpx fork; an httpx client is what it takes)
    client: Any = http
    return openai.AsyncOpenAI(
        base_url="http://app/v1", api_key=api_key, http_client=client, **options
    )


def anthropic_client(
    app: EdgeApp, *, api_key: str = "test", **options: Any
) -> anthropic.AsyncAnthropic:
    """An ``anthropic.AsyncAnthropic`` client for ``app`` (its Messages edge), in-process;
    close it (``async with``). ``max_retries`` is 0 unless given.

    Raises:
        ImportError: the ``anthropic`` package is not installed.
    """
    try:
        import anthropic
    except ImportError as exc:  # a test dependency, not the framework's
        raise ImportError("anthropic_client needs the anthropic package") from exc
    try:  # the SDK's own httpx (recent versions ship a fork, httpx2)
        http_module: Any = importlib.import_module("httpx2")
    except ImportError:
        http_module = httpx
    options.setdefault("max_retries", 0)
    http = http_module.AsyncClient(
        transport=http_module.ASGITransport(app=app), base_url="http://app"
    )
    return anthropic.AsyncAnthropic(
        base_url="http://app", api_key=api_key, http_client=http, **options
    )


# ------------------------------------------------------------------------ check_engine

EngineFactory = Callable[[], "Engine[PreprocessedRequest, EngineOutput]"]


async def check_engine(
    factory: EngineFactory,
    *,
    prompt: Sequence[int] = (1, 2, 3, 4, 5, 6, 7, 8),
    deterministic: bool = True,
    time_limit: float = 30.0,
) -> None:
    """Check that engines built by ``factory()`` keep the engine contract (docs/engines.md).

    Each check builds a fresh engine and sends it greedy requests for ``prompt`` (token ids
    the engine accepts; ``ignore_eos`` so that lengths are predictable). The engine must:

    1. end every choice: for ``n=2`` each ``index`` 0..n-1 gets outputs, the last one with
       a ``finish_reason``, nothing after it, at most ``max_tokens`` tokens, ``"length"``
       when it stopped at ``max_tokens``; logprobs, when present, align with the ids;
    2. end cleanly and promptly after ``ctx.stop_generating()`` (a few outputs at most);
    3. end promptly after ``ctx.kill()``, by cancellation, yielding nothing more;
    4. continue from ``replayed_tokens`` (with ``deterministic``): a request whose
       ``token_ids`` end with the first k tokens of an earlier answer, marked replayed,
       gets the rest of that answer and counts ``max_tokens`` from there;
    5. raise only :class:`pipeline.RequestError` subclasses (an empty prompt: raise
       :class:`~pipeline.InvalidRequest` or end every choice);
    6. if it has ``embed`` (the optional part of the contract): one vector per input, all
       of one length, finite numbers, the same vector alone, in a batch, in another order
       and a second time; an empty input raises :class:`~pipeline.InvalidRequest` naming
       it (``input...``);
    7. leave no task running behind it.

    Each check runs in its own cancel scope and time limit, so one failure cannot poison
    the next.

    Raises:
        AssertionError: naming the first rule broken.
    """
    name = getattr(factory, "__name__", repr(factory))
    checks = (_ends_every_choice, _stops_promptly, _dies_promptly, _continues_replayed,
              _raises_request_errors, _embeds)  # fmt: skip
    before = {task.id for task in anyio.get_running_tasks()}
    for check in checks:
        if check is _continues_replayed and not deterministic:
            continue
        with anyio.CancelScope() as scope:
            scope.deadline = anyio.current_time() + time_limit
            await check(name, factory, list(prompt))
        if scope.cancelled_caught:
            raise AssertionError(f"{name}: {check.__doc__} — ran over {time_limit:g}s")
    for _ in range(3):
        await anyio.lowlevel.checkpoint()
    leftover = {task.id for task in anyio.get_running_tasks()} - before
    if leftover:
        raise AssertionError(f"{name}: left {len(leftover)} task(s) running behind its streams")


async def _embeds(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """embeds: one fixed-length vector per input, the same alone or batched"""
    embed = getattr(factory(), "embed", None)
    if embed is not None:
        inputs = [prompt, prompt[: max(1, len(prompt) // 2)], prompt[::-1]]
        batched = await embed(inputs)
        if len(batched) != len(inputs):
            raise AssertionError(
                f"{name}: embed gave {len(batched)} vectors for {len(inputs)} inputs"
            )
        sizes = {len(vector) for vector in batched}
        if len(sizes) != 1 or 0 in sizes:
            raise AssertionError(f"{name}: embed gave vectors of lengths {sorted(sizes)}")
        if not all(math.isfinite(x) for vector in batched for x in vector):
            raise AssertionError(f"{name}: embed gave a number that is not finite")
        alone = [(await embed([tokens]))[0] for tokens in inputs]
        reversed_order = (await embed(inputs[::-1]))[::-1]
        again = await embed(inputs)
        for label, other in (("alone", alone), ("in another order", reversed_order),
                             ("a second time", again)):  # fmt: skip
            if [list(v) for v in other] != [list(v) for v in batched]:
                raise AssertionError(f"{name}: embed gave other vectors {label} than batched")
        try:
            await embed([[]])
        except InvalidRequest as exc:
            if not (exc.param or "").startswith("input"):
                raise AssertionError(
                    f"{name}: an empty input to embed must be refused naming 'input...', "
                    f"not {exc.param!r}"
                ) from exc
        else:
            raise AssertionError(f"{name}: embed accepted an empty input")


def _request(prompt: list[int], *, max_tokens: int | None, n: int = 1, logprobs: int | None = None,
             replayed: int = 0) -> PreprocessedRequest:  # fmt: skip
    return PreprocessedRequest(
        token_ids=prompt,
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        sampling=SamplingOptions(temperature=0.0),
        output=OutputOptions(logprobs=logprobs),
        n=n,
        replayed_tokens=replayed,
    )


async def _run(engine: Engine[PreprocessedRequest, EngineOutput], request: PreprocessedRequest,
               name: str) -> list[EngineOutput]:  # fmt: skip
    outputs: list[EngineOutput] = []
    try:
        async with open_stream(engine, Context.new(request)) as stream:
            async for output in stream:
                outputs.append(output)  # noqa: PERF401 - the stream is iterated as it comes
    except RequestError:
        raise
    except Exception as exc:
        raise AssertionError(
            f"{name}: raised {exc!r}; engines raise pipeline.RequestError subclasses "
            "(InvalidRequest, EngineError, WorkerLost, ...)"
        ) from exc
    return outputs


def _by_choice(outputs: list[EngineOutput]) -> dict[int, list[EngineOutput]]:
    choices: dict[int, list[EngineOutput]] = {}
    for output in outputs:
        choices.setdefault(output.index, []).append(output)
    return choices


async def _ends_every_choice(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """1. every choice ends"""
    max_tokens = 4
    outputs = await _run(factory(), _request(prompt, max_tokens=max_tokens, n=2, logprobs=1), name)
    choices = _by_choice(outputs)
    if sorted(choices) != [0, 1]:
        raise AssertionError(f"{name}: n=2 gave outputs for choices {sorted(choices)}, not [0, 1]")
    for index, steps in choices.items():
        ends = [i for i, step in enumerate(steps) if step.finish_reason is not None]
        if not ends:
            raise AssertionError(f"{name}: choice {index} never got a finish_reason")
        if ends != [len(steps) - 1]:
            raise AssertionError(
                f"{name}: choice {index} got outputs after its finish_reason (or two of them)"
            )
        tokens = sum(len(step.token_ids) for step in steps)
        if tokens > max_tokens:
            raise AssertionError(
                f"{name}: choice {index} got {tokens} tokens, max_tokens={max_tokens}"
            )
        if tokens == max_tokens and steps[-1].finish_reason != "length":
            raise AssertionError(
                f"{name}: choice {index} stopped at max_tokens with finish_reason "
                f"{steps[-1].finish_reason!r}, not 'length'"
            )
        for step in steps:
            if step.logprobs is not None and len(step.logprobs) != len(step.token_ids):
                raise AssertionError(f"{name}: logprobs not aligned with token_ids in {step!r}")


async def _stopped_after_first(name: str, factory: EngineFactory, prompt: list[int],
                               *, kill: bool) -> tuple[int, bool]:  # fmt: skip
    engine = factory()
    ctx = Context.new(_request(prompt, max_tokens=None))  # (the engine's own limit)
    after = 0
    ended_cleanly = False
    with anyio.move_on_after(2.0) as slow:
        async with open_stream(engine, ctx) as stream:
            async for _ in stream:
                if ctx.is_stopped:
                    after += 1
                elif kill:
                    ctx.kill()
                else:
                    ctx.stop_generating()
            ended_cleanly = not ctx.is_killed
    if slow.cancelled_caught:
        what = "kill()" if kill else "stop_generating()"
        raise AssertionError(f"{name}: did not end within 2s of {what}")
    return after, ended_cleanly


async def _stops_promptly(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """2. stop_generating() ends the stream"""
    after, ended_cleanly = await _stopped_after_first(name, factory, prompt, kill=False)
    if not ended_cleanly:
        raise AssertionError(f"{name}: stop_generating() did not end the stream cleanly")
    if after > 4:
        raise AssertionError(f"{name}: gave {after} more outputs after stop_generating()")


async def _dies_promptly(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """3. kill() ends the stream"""
    after, ended_cleanly = await _stopped_after_first(name, factory, prompt, kill=True)
    if ended_cleanly:
        raise AssertionError(f"{name}: kill() did not cancel the stream")
    if after:
        raise AssertionError(f"{name}: yielded {after} outputs after kill()")


async def _continues_replayed(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """4. a replayed request continues the answer"""
    whole = [
        t for o in await _run(factory(), _request(prompt, max_tokens=6), name) for t in o.token_ids
    ]
    if len(whole) < 6:
        raise AssertionError(f"{name}: gave {len(whole)} tokens for max_tokens=6 with ignore_eos")
    replayed = _request([*prompt, *whole[:3]], max_tokens=3, replayed=3)
    rest = [t for o in await _run(factory(), replayed, name) for t in o.token_ids]
    if rest != whole[3:]:
        raise AssertionError(
            f"{name}: after replaying {whole[:3]} it continued with {rest}, not {whole[3:]}; "
            "the last replayed_tokens of token_ids are output already generated"
        )


async def _raises_request_errors(name: str, factory: EngineFactory, prompt: list[int]) -> None:
    """5. errors are RequestErrors"""
    try:
        outputs = await _run(factory(), _request([], max_tokens=2, n=2), name)
    except InvalidRequest:
        return
    except RequestError as exc:
        raise AssertionError(f"{name}: an empty prompt raised {exc!r}, not InvalidRequest") from exc
    ended = {o.index for o in outputs if o.finish_reason is not None}
    if ended != {0, 1}:
        raise AssertionError(
            f"{name}: an empty prompt neither raised InvalidRequest nor ended every choice"
        )
