"""Test helpers for the LLM layer: :func:`check_engine`, :func:`make_request`, in-process
clients.

The framework's test helpers have two homes, as the code has two layers:
:mod:`pipeline.testing` holds what knows no LLM (:func:`~pipeline.testing.check_operator`,
:func:`~pipeline.testing.make_context`, :class:`~pipeline.testing.ScriptedEngine`,
:func:`~pipeline.testing.worker_set`, :func:`~pipeline.testing.collect`), and this module
what needs the LLM layer's types or its HTTP app. They cannot share a module: ``pipeline``
never imports ``operators`` (``tests/test_layering.py``), so a helper that builds a
:class:`~operators.contracts.llm.PreprocessedRequest` lives here, in the layer that defines it.

- :func:`check_engine` is to engines what :func:`pipeline.testing.check_operator` is to
  operators: a conformance suite (docs/engines.md has the contract it checks).
- :func:`make_request` is a :class:`~operators.contracts.llm.PreprocessedRequest` from flat
  keywords (``max_tokens=4, temperature=0, n=2``), for tests of operators and engines that
  sit after the preprocessor; put it in a :func:`~pipeline.testing.make_context`.
- :func:`openai_client` is the official ``openai.AsyncOpenAI`` (the ``openai`` package, a
  test dependency) talking to an :class:`~operators.edges.openai.server.OpenAIApp` through
  ``httpx.ASGITransport``: no socket, no server process, the app's own error mapping and
  rendering (:func:`anthropic_client`: the same for Anthropic's client).
  ``httpx.ASGITransport`` returns a response once the app has finished it, so a stream's
  chunks all arrive at the end (use a real server to observe timing)::

    async def test_hello() -> None:          # pytest with asyncio_mode = "auto" (or anyio)
        app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
        async with openai_client(app) as client:
            reply = await client.completions.create(model="echo", prompt="hi", max_tokens=2)
        assert reply.choices[0].text == "hi"
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from pipeline import Context, InvalidRequest, RequestError, open_stream

from ._clients import anthropic_client, openai_client
from .contracts.llm import (
    Constraint,
    EngineOutput,
    MultimodalItem,
    OutputOptions,
    PreprocessedRequest,
    ReasoningBudget,
    SamplingOptions,
    StopConditions,
    Tool,
)

if TYPE_CHECKING:
    from pipeline import Engine

__all__ = (
    "EngineFactory",
    "anthropic_client",
    "check_engine",
    "make_request",
    "openai_client",
)


# ------------------------------------------------------------------------ make_request


def make_request(
    token_ids: Iterable[int] = (1, 2, 3),
    *,
    max_tokens: int | None = None,
    min_tokens: int = 0,
    stop: Iterable[str] = (),
    stop_token_ids: Iterable[int] = (),
    eos_token_ids: Iterable[int] = (),
    include_stop_str_in_output: bool = False,
    ignore_eos: bool = False,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    logprobs: int | None = None,
    skip_special_tokens: bool = True,
    n: int = 1,
    replayed_tokens: int = 0,
    model: str = "",
    tools: Iterable[Tool] = (),
    constraint: Constraint | None = None,
    multimodal: Iterable[MultimodalItem] = (),
    encoder_result: dict[str, Any] | None = None,
    prefill_result: dict[str, Any] | None = None,
    priority: int = 0,
    lora: str | None = None,
    reasoning_budget: ReasoningBudget | None = None,
) -> PreprocessedRequest:
    """A :class:`~operators.contracts.llm.PreprocessedRequest` for ``token_ids`` (the
    prompt; after a migration, prompt + the ``replayed_tokens`` replayed), every option a
    flat keyword with the request's own default.

    The keywords are the fields of the request and of its parts, by their names:
    ``StopConditions`` (``max_tokens``, ``min_tokens``, ``stop`` -- the stop *strings*, as
    in OpenAI's API --, ``stop_token_ids``, ``eos_token_ids``, ``ignore_eos``,
    ``include_stop_str_in_output``), ``SamplingOptions`` (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``seed``, the penalties) and ``OutputOptions`` (``logprobs``,
    ``skip_special_tokens``); the rest are the request's. A token request the way the
    preprocessor makes one, without a tokenizer or a chat template::

        ctx = make_context(make_request(tokenizer.encode("Hi"), max_tokens=4, temperature=0))
    """
    return PreprocessedRequest(
        token_ids=list(token_ids),
        stop=StopConditions(
            max_tokens=max_tokens,
            min_tokens=min_tokens,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_token_ids),
            eos_token_ids=tuple(eos_token_ids),
            include_stop_str_in_output=include_stop_str_in_output,
            ignore_eos=ignore_eos,
        ),
        sampling=SamplingOptions(
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            min_p=min_p,
            seed=seed,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            repetition_penalty=repetition_penalty,
        ),
        output=OutputOptions(logprobs=logprobs, skip_special_tokens=skip_special_tokens),
        model=model,
        n=n,
        replayed_tokens=replayed_tokens,
        multimodal=tuple(multimodal),
        encoder_result=encoder_result,
        prefill_result=prefill_result,
        tools=tuple(tools),
        constraint=constraint,
        priority=priority,
        lora=lora,
        reasoning_budget=reasoning_budget,
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
       when it stopped at ``max_tokens``; logprobs, when present, align with the ids (an
       engine that has none may refuse a request for them with an
       :class:`~pipeline.InvalidRequest` naming ``logprobs``, never ignore it silently);
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
    """A greedy request that ignores EOS (lengths are then predictable)."""
    return make_request(prompt, max_tokens=max_tokens, ignore_eos=True, temperature=0.0,
                        logprobs=logprobs, n=n, replayed_tokens=replayed)  # fmt: skip


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
    try:
        outputs = await _run(factory(), _request(prompt, max_tokens=max_tokens, n=2, logprobs=1),
                             name)  # fmt: skip
    except InvalidRequest as exc:  # an engine without logprobs may say so, by name
        if exc.param != "logprobs":
            raise
        outputs = await _run(factory(), _request(prompt, max_tokens=max_tokens, n=2), name)
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
