"""OpenAI response events built from the Backend's outputs: the preprocessor's backward edge.

:class:`ChatChunks` and :class:`CompletionChunks` hold the state of one response (its
:class:`~operators.edges.openai.events.ResponseHead` and one small :class:`ChoiceState` per
choice) and turn each :class:`~operators.contracts.llm.BackendOutput` into typed events
(:mod:`operators.edges.openai.events`), which the server renders to bytes once
(:mod:`operators.edges.openai.sse`) or folds into a non-streamed response.

Rules every response keeps (``docs/bug-classes.md`` B4, B8, B11, B14):

* one id, ``created`` and model on every chunk; chat choices open with a role chunk;
* ``finish_reason`` exactly once per choice, on the chunk of the output that carries it
  (together with that output's last text, if any); nothing for a choice after it;
* logprobs only for *delivered* tokens (``BackendOutput.delivered_tokens``), each once, in
  order: tokens swallowed by a hidden stop never appear;
* ``completion_tokens`` counts every generated token once, delivered or not;
* chat: an output's reasoning text and tool-call pieces (a parser moved them out of its
  ``text``) become :class:`~.events.RichDelta` events, one payload each, in the order
  reasoning, content, calls; the output's logprobs ride on the first of its events and its
  finish_reason on the last. Each becomes one chunk: one ``tool_calls`` entry per chunk is
  what clients accumulate most reliably.

Events are small ``slots`` objects: no pydantic, no dict per token, no per-token work for
logprobs unless they were asked for, nor for reasoning or tool calls beyond one test of
each output's two fields.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, ClassVar, Literal

from operators.contracts.llm import BackendOutput, TopLogprobs

from .events import ChoiceDelta, ChoiceStart, OpenAIEvent, ResponseHead, RichDelta, Usage
from .logprobs import ChoiceState, Entry, TokenDecoder, TokenTexts

__all__ = (
    "ChatChunks",
    "ChoiceState",
    "CompletionChunks",
    "TokenDecoder",
    "TokenTexts",
)


class _Chunks:
    """What chat and completions responses share: the head, the choices, the usage."""

    __slots__ = (
        "_base",
        "_choices",
        "_echo",
        "_logprobs",
        "_texts",
        "completion_tokens",
        "head",
        "reasoning_tokens",
    )

    #: the response id's prefix and the chunks' ``object`` (set by each kind of response)
    _ID_PREFIX: ClassVar[str]
    _OBJECT: ClassVar[Literal["chat.completion.chunk", "text_completion"]]

    def __init__(
        self,
        *,
        model: str,
        logprobs: int | None,
        texts: TokenTexts,
        request_id: str | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        """``request_id`` names the response (``chatcmpl-<id>``); a fresh one if None."""
        #: the response's constant part, the first event of its stream
        self.head = ResponseHead(
            id=f"{self._ID_PREFIX}-{request_id or uuid.uuid4().hex}",
            object=self._OBJECT,
            created=int(time.time()),
            model=model,
            prompt_tokens=prompt_tokens,
        )
        self._logprobs = logprobs
        self._texts = texts
        self._choices: dict[int, ChoiceState] = {}
        self._base = 0
        self._echo = ""
        #: every token generated so far, over all choices (delivered or not)
        self.completion_tokens = 0
        #: the tokens generated up to the last output that carried reasoning text
        self.reasoning_tokens = 0

    @property
    def id(self) -> str:
        """The response id."""
        return self.head.id

    def start_prompt(self, base: int, echo: str = "") -> None:
        """The outputs that follow are the next prompt's (a completions batch): output
        index ``i`` is choice ``base + i``, and ``echo`` starts each of those choices."""
        self._base = base
        self._echo = echo

    def usage(self, prompt_tokens: int, cached_tokens: int | None = None) -> Usage:
        """The last event: the response's token counts (and its choices' finish reasons)."""
        reasons = tuple(
            choice.finish_reason
            for _, choice in sorted(self._choices.items())
            if choice.finish_reason is not None
        )
        return Usage(
            prompt_tokens, self.completion_tokens, cached_tokens, reasons, self.reasoning_tokens
        )

    def _bytes(self, token_id: int, text: str) -> list[int]:
        raw = self._texts.get(token_id)[1]
        return list(text.encode() if raw is None else raw)


class ChatChunks(_Chunks):
    """The events of one chat response (``chat.completion.chunk`` when rendered).

    ``logprobs``: None, or how many alternatives each token's entry lists.
    """

    __slots__ = ()
    _ID_PREFIX = "chatcmpl"
    _OBJECT = "chat.completion.chunk"

    def feed(self, output: BackendOutput) -> list[OpenAIEvent]:
        """The events for one output: a ChoiceStart first for a new choice, then one delta
        unless there is nothing to say (no text, no logprobs, no finish); an output with
        reasoning or tool-call pieces gets one delta per payload (:func:`_rich`)."""
        self.completion_tokens += len(output.token_ids)
        index = self._base + output.index
        choice = self._choices.get(index)
        events: list[OpenAIEvent] = []
        if choice is None:
            choice = self._choices[index] = ChoiceState(index)
            events.append(ChoiceStart(index))
        elif choice.finished:
            return events
        logprobs = None
        if self._logprobs is not None:
            entries = choice.delivered(output)
            if entries:
                content = [self._entry(entry) for entry in entries if isinstance(entry, tuple)]
                if content:
                    logprobs = {"content": content, "refusal": None}
        if output.tool_calls or output.reasoning:
            if output.reasoning:
                self.reasoning_tokens = self.completion_tokens
            return _rich(events, choice, output, logprobs)
        text = output.text
        finish = output.finish_reason
        if finish is not None:
            choice.finished = True
            choice.finish_reason = finish
            events.append(
                ChoiceDelta(index, text, logprobs, finish, stop_reason=output.stop_reason)
            )
        elif text or logprobs is not None:
            events.append(ChoiceDelta(index, text, logprobs))
        return events

    def _entry(self, entry: tuple[int, str, float, TopLogprobs | None]) -> dict[str, Any]:
        token_id, token, logprob, top = entry
        alternatives = []
        if top:
            get = self._texts.get
            for alt_id, alt_logprob in top[: self._logprobs]:
                alt_text, alt_raw = get(alt_id)
                alternatives.append(
                    {
                        "token": alt_text,
                        "logprob": alt_logprob,
                        "bytes": list(alt_text.encode() if alt_raw is None else alt_raw),
                    }
                )
        return {
            "token": token,
            "logprob": logprob,
            "bytes": self._bytes(token_id, token),
            "top_logprobs": alternatives,
        }


def _rich(
    events: list[OpenAIEvent],
    choice: ChoiceState,
    output: BackendOutput,
    logprobs: dict[str, Any] | None,
) -> list[OpenAIEvent]:
    """``events`` plus the deltas of an output with reasoning or tool-call pieces: one
    payload each.

    Reasoning first, then content, then each call piece in order: a parser releases them
    in that order within one step (thinking ends before the answer, text precedes the
    marker that opens a call). The output's logprobs go on the first delta, its finish on
    the last, so each is reported once, as for a plain output.
    """
    index = choice.index
    reasoning, text, calls = output.reasoning, output.text, output.tool_calls
    finish = output.finish_reason
    if finish is not None:
        choice.finished = True
        choice.finish_reason = finish
    if not calls and not text:  # a reasoning model's thinking: a delta per token
        delta = RichDelta(index, "", logprobs, finish, reasoning)
        if finish is not None:
            delta.stop_reason = output.stop_reason
        events.append(delta)
        return events
    deltas: list[ChoiceDelta] = []
    if reasoning:
        deltas.append(RichDelta(index, "", None, None, reasoning))
    if text:
        deltas.append(ChoiceDelta(index, text))
    deltas.extend(RichDelta(index, "", None, None, "", call) for call in calls or ())
    deltas[0].logprobs = logprobs
    deltas[-1].finish_reason = finish
    if finish is not None:
        deltas[-1].stop_reason = output.stop_reason
    events.extend(deltas)
    return events


class CompletionChunks(_Chunks):
    """The events of one completions response (``text_completion`` when rendered)."""

    __slots__ = ()
    _ID_PREFIX = "cmpl"
    _OBJECT = "text_completion"

    def feed(self, output: BackendOutput) -> list[OpenAIEvent]:
        """The delta for one output, unless there is nothing to say."""
        self.completion_tokens += len(output.token_ids)
        index = self._base + output.index
        choice = self._choices.get(index)
        if choice is None:
            choice = self._choices[index] = ChoiceState(index, self._echo)
        elif choice.finished:
            return []
        text = output.text
        if choice.echo:
            text = choice.echo + text
            choice.echo = ""
        logprobs = None
        if self._logprobs is not None:
            entries = choice.delivered(output)
            if entries:
                logprobs = self._logprobs_of(choice, entries)
        finish = output.finish_reason
        if not text and logprobs is None and finish is None:
            return []
        if finish is not None:
            choice.finished = True
            choice.finish_reason = finish
        return [ChoiceDelta(index, text, logprobs, finish)]

    def _logprobs_of(self, choice: ChoiceState, entries: list[Entry]) -> dict[str, Any] | None:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        get = self._texts.get
        k = self._logprobs or 0
        offset = choice.text_offset
        for entry in entries:
            if not isinstance(entry, tuple):
                offset += entry or 0  # a token shown without logprobs: its output's text
                continue
            _, token, logprob, top = entry
            tokens.append(token)
            token_logprobs.append(logprob)
            # OpenAI: the k most likely tokens, plus the sampled one (up to k + 1 entries).
            best = {get(alt_id)[0]: alt for alt_id, alt in (top or ())[:k]}
            best.setdefault(token, logprob)
            top_logprobs.append(best)
            text_offset.append(offset)
            offset += len(token)
        choice.text_offset = offset
        if not tokens:
            return None
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
