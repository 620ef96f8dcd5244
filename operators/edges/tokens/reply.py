"""The graph's token outputs in vLLM's ``/inference/v1/generate`` response shapes.

Streamed, one ``data:`` chunk per output of a choice (vLLM's: one choice per chunk)::

    data: {"request_id": ..., "output_mode": "tokens", "choices": [{"index": 0,
           "finish_reason": null, "stop_reason": null, "token_ids": [...], "logprobs":
           {"content": [{"token_id", "logprob", "top_logprobs": [{"token_id", "logprob"}]}]}}]}
    ...
    data: {"request_id": ..., "output_mode": "tokens", "choices": [], "usage": {...}}
                                          (with stream_options.include_usage)
    data: [DONE]

Whole, one object: ``request_id``, ``model``, ``created``, ``output_mode``, every choice's
``token_ids`` (with its ``finish_reason``, ``stop_reason``, ``logprobs``), ``usage`` (with
``prompt_tokens_details.cached_tokens`` when the engine said), and ``prompt_token_ids``
with ``return_token_ids``. ``token_ids`` are every id generated, a hidden stop's included
(vLLM's too: its ``text`` would drop the stop string, its ids never do).

An entry's ``top_logprobs`` lists the sampled token first, then the most likely others, as
many as asked for (vLLM's order and count: at least one entry).

The usage comes from the graph's last event (:class:`Tally`, which the edge's operator adds
after the Backend's outputs: prompt and generated tokens, and the cached ones the engine
reported).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, final

import orjson

from operators.contracts.llm import BackendOutput, TopLogprobs
from operators.edges.http.failures import ApiError

from .errors import VLLM_ERRORS
from .protocol import GenerateRequest

__all__ = ("Tally", "TokensReply")

_DONE: Final = b"data: [DONE]\n\n"


@final
@dataclass(frozen=True, slots=True)
class Tally:
    """The last event of a generation: what its usage reports."""

    prompt_tokens: int
    completion_tokens: int
    #: prompt tokens the engine found cached (None: it did not say)
    cached_tokens: int | None = None

    def usage(self) -> dict[str, Any]:
        """vLLM's ``usage`` object."""
        usage: dict[str, Any] = {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }
        if self.cached_tokens is not None:
            usage["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return usage


@final
class TokensReply:
    """One ``/inference/v1/generate`` response (a :class:`~operators.edges.http.routes.Reply`)."""

    __slots__ = ("_head", "_k", "_model", "_prompt", "_request", "output_tokens", "usage")

    def __init__(self, request: GenerateRequest, *, model: str, request_id: str) -> None:
        self._request = request
        self._model = model
        self._k = request.sampling_params.logprobs
        self._head = orjson.dumps(request_id)
        self._prompt = request.token_ids if request.return_token_ids else None
        #: tokens generated (the tally's, once it went by), for the metrics
        self.output_tokens = 0
        #: the usage reported, once it went by (the request's span records it)
        self.usage: dict[str, Any] | None = None

    # -- streamed ------------------------------------------------------------------------------

    def start(self, first: Any) -> Callable[[Any], bytes]:
        """The renderer of each event as a chunk."""
        return self._chunk

    def visible(self, event: Any) -> bool:
        """An output with ids (or a finish) shows the client something."""
        return isinstance(event, BackendOutput) and bool(
            event.token_ids or event.finish_reason is not None
        )

    def _chunk(self, event: Any) -> bytes:
        if isinstance(event, Tally):
            self.output_tokens = event.completion_tokens
            self.usage = event.usage()
            if not self._request.include_usage:
                return b""
            return self._data(b'"choices":[],"usage":' + orjson.dumps(self.usage))
        if not isinstance(event, BackendOutput) or not (
            event.token_ids or event.finish_reason is not None
        ):
            return b""
        choice = b'"choices":[' + orjson.dumps(self._choice(event)) + b"]"
        prompt, self._prompt = self._prompt, None  # (in the first chunk only)
        if prompt is not None:
            choice += b',"prompt_token_ids":' + orjson.dumps(prompt)
        return self._data(choice)

    def _data(self, fields: bytes) -> bytes:
        return (
            b'data: {"request_id":' + self._head + b',"output_mode":"tokens",' + fields + b"}\n\n"
        )

    async def end(self) -> bytes:
        """``[DONE]``."""
        return _DONE

    def failure(self, error: ApiError) -> bytes:
        """vLLM's error event, then ``[DONE]`` (as vLLM ends a failed stream)."""
        return b"data: " + VLLM_ERRORS.body(error) + b"\n\n" + _DONE

    # -- whole -------------------------------------------------------------------------------

    async def body(self, events: list[Any]) -> bytes:
        """The ``GenerateResponse`` object."""
        choices: dict[int, dict[str, Any]] = {}
        for event in events:
            if isinstance(event, Tally):
                self.output_tokens = event.completion_tokens
                self.usage = event.usage()
            elif isinstance(event, BackendOutput):
                self._fold(choices, event)
        response: dict[str, Any] = {
            "request_id": orjson.loads(self._head),
            "model": self._model,
            "created": int(time.time()),
            "output_mode": "tokens",
            "choices": [choices[index] for index in sorted(choices)],
            "usage": self.usage,
        }
        if self._prompt is not None:
            response["prompt_token_ids"] = self._prompt
        return orjson.dumps(response)

    def _fold(self, choices: dict[int, dict[str, Any]], output: BackendOutput) -> None:
        choice = choices.get(output.index)
        piece = self._choice(output)
        if choice is None:
            choices[output.index] = piece
            return
        choice["token_ids"].extend(piece["token_ids"])
        if piece["logprobs"] is not None:
            if choice["logprobs"] is None:
                choice["logprobs"] = {"content": []}
            choice["logprobs"]["content"].extend(piece["logprobs"]["content"])
        if output.finish_reason is not None:
            choice["finish_reason"] = piece["finish_reason"]
            choice["stop_reason"] = piece["stop_reason"]

    def _choice(self, output: BackendOutput) -> dict[str, Any]:
        logprobs = None
        if self._k is not None and output.logprobs is not None:
            logprobs = {"content": _content(output, self._k)}
        return {
            "index": output.index,
            "finish_reason": output.finish_reason,
            "stop_reason": output.stop_reason,
            "token_ids": list(output.token_ids),
            "logprobs": logprobs,
        }


def _content(output: BackendOutput, k: int) -> list[dict[str, Any]]:
    """One entry per token: its logprob, and the sampled token then the most likely others."""
    tops: list[TopLogprobs] = output.top_logprobs or [[] for _ in output.token_ids]
    assert output.logprobs is not None
    entries = []
    for token, logprob, top in zip(output.token_ids, output.logprobs, tops, strict=False):
        ranked = [{"token_id": token, "logprob": logprob}]
        ranked += [{"token_id": t, "logprob": lp} for t, lp in top if t != token]
        entries.append({"token_id": token, "logprob": logprob, "top_logprobs": ranked[: max(k, 1)]})
    return entries
