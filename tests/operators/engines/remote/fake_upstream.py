"""A fake upstream server for the remote engine's tests: vLLM's and llama-server's
tokens-in/tokens-out shapes over real HTTP, with faults on demand.

A plain ASGI app under uvicorn in a thread of its own (its own event loop: the test's loop
sees only its client). Its "model" is a function of the sequence so far
(:func:`next_token`), so a request continued from prompt + output after a migration gets
exactly the tokens it would have got, as a greedy model does. It keeps a prefix cache of
the prompts it saw (cached tokens: the longest shared prefix, in 16-token blocks) and
counts what the tests check: requests, requests whose client went away mid-stream
(``aborted``), and the requests running now.

Faults (set on :attr:`FakeUpstream.faults`, read per request):

- ``status``: answer every generation with this HTTP status (an OpenAI-shaped error);
- ``reset_after``: break the connection after this many tokens (no end of the chunked body);
- ``garbage_after``: send a line that is not JSON after this many tokens;
- ``eof_after``: end the body cleanly, without a finish, after this many tokens;
- ``error_after``: send an ``{"error": ...}`` event after this many tokens;
- ``no_generate``: answer ``/inference/v1/generate`` 403, as vLLM without
  ``--enable-scale-out`` does;
- ``owned_by``: what ``/v1/models`` says (None: nothing, so the kind must be probed).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any, Literal

import uvicorn

__all__ = ("FakeUpstream", "Faults", "next_token", "continuation")

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]

VOCAB = 49152
MAX_MODEL_LEN = 4096


def next_token(sequence: list[int]) -> int:
    """The fake model's greedy choice after ``sequence``: ids 300..399."""
    return 300 + (sequence[-1] * 7 + len(sequence) * 13) % 100


def continuation(prompt: list[int], count: int) -> list[int]:
    """The ``count`` tokens the fake model generates after ``prompt``."""
    sequence = list(prompt)
    for _ in range(count):
        sequence.append(next_token(sequence))
    return sequence[len(prompt) :]


@dataclass
class Faults:
    status: int | None = None
    reset_after: int | None = None
    garbage_after: int | None = None
    eof_after: int | None = None
    error_after: int | None = None
    no_generate: bool = False
    owned_by: str | None = "vllm"


@dataclass
class Counts:
    requests: int = 0
    aborted: int = 0
    running: int = 0
    #: (path, body) of every generation request, in order
    bodies: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    #: the x-session-affinity header of every generation request (None: not sent)
    conversations: list[str | None] = field(default_factory=list)


class _Break(Exception):
    """Raised in the response body: uvicorn drops the connection mid-body."""


class FakeUpstream:
    """The fake server, ``kind`` "vllm" or "llama-server", on a free port (or ``port``)."""

    def __init__(
        self,
        kind: Literal["vllm", "llama-server"] = "vllm",
        *,
        delay: float = 0.002,
        port: int = 0,
        model: str = "fake-model",
    ) -> None:
        self.kind = kind
        self.delay = delay
        self.model = model
        self.faults = Faults(owned_by="vllm" if kind == "vllm" else "llamacpp")
        self.counts = Counts()
        self._prompts: list[list[int]] = []
        self._server = uvicorn.Server(
            uvicorn.Config(
                self._app,
                host="127.0.0.1",
                port=port,
                log_level="critical",
                interface="asgi3",
                lifespan="off",
            )
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the fake upstream did not start")
            time.sleep(0.01)
        self.port: int = self._server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Stop serving (connections close; the port is free again)."""
        self._server.should_exit = True
        self._server.force_exit = True
        self._thread.join(10)

    # ------------------------------------------------------------------------------ app

    async def _app(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if method == "GET":
            await self._get(path, send)
            return
        request = json.loads(body or b"{}")
        if request:  # (not the remote engine's probe of /inference/v1/generate)
            self.counts.bodies.append((path, request))
            headers = dict(scope["headers"])
            conversation = headers.get(b"x-session-affinity")
            self.counts.conversations.append(
                None if conversation is None else conversation.decode()
            )
        if path == "/inference/v1/generate" and self.kind == "vllm":
            if self.faults.no_generate:
                await _json(send, 403, {"error": {"message": "forbidden", "code": 403}})
                return
            if "token_ids" not in request:
                await _json(send, 400, {"error": {"message": "token_ids: Field required"}})
                return
            await self._generate(request, receive, send, prompt=request["token_ids"],
                                 params=request["sampling_params"], shape="generate")  # fmt: skip
        elif path == "/v1/completions" and self.kind == "vllm":
            await self._generate(request, receive, send, prompt=request["prompt"],
                                 params=request, shape="completions")  # fmt: skip
        elif path == "/completion" and self.kind == "llama-server":
            params = {**request, "max_tokens": request.get("n_predict", -1),
                      "n": request.get("n_cmpl", 1)}  # fmt: skip
            await self._generate(request, receive, send, prompt=request["prompt"],
                                 params=params, shape="llama")  # fmt: skip
        else:
            await _json(send, 404, {"error": {"message": "Not Found", "code": 404}})

    async def _get(self, path: str, send: Send) -> None:
        owned = {} if self.faults.owned_by is None else {"owned_by": self.faults.owned_by}
        model: dict[str, Any] = {"id": self.model, "object": "model", **owned}
        if self.kind == "vllm":
            model["max_model_len"] = MAX_MODEL_LEN
        else:
            model["meta"] = {"n_vocab": VOCAB, "n_ctx": MAX_MODEL_LEN}
        running, waiting = self.counts.running, 0
        if path == "/v1/models":
            await _json(send, 200, {"object": "list", "data": [model]})
        elif path == "/version" and self.kind == "vllm":
            await _json(send, 200, {"version": "0.32.0"})
        elif path == "/metrics" and self.kind == "vllm":
            text = (
                "# HELP vllm:num_requests_running Requests running.\n"
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}.0\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}.0\n'
                'vllm:num_requests_waiting_by_reason{engine="0",reason="capacity"} 7.0\n'
                'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            )
            await _send(send, 200, text.encode(), b"text/plain")
        elif path == "/props" and self.kind == "llama-server":
            settings = {"n_ctx": MAX_MODEL_LEN, "params": {}}
            props = {"default_generation_settings": settings, "total_slots": 2,
                     "endpoint_metrics": False}  # fmt: skip
            await _json(send, 200, props)
        elif path == "/slots" and self.kind == "llama-server":
            slots = [{"id": i, "is_processing": i < running} for i in range(2)]
            await _json(send, 200, slots)
        else:
            await _json(send, 404, {"error": {"message": "Not Found", "code": 404}})

    def _cached(self, prompt: list[int]) -> int:
        best = 0
        for seen in self._prompts:
            shared = 0
            for a, b in zip(seen, prompt, strict=False):
                if a != b:
                    break
                shared += 1
            best = max(best, shared)
        self._prompts.append(list(prompt))
        return best // 16 * 16

    async def _generate(
        self,
        request: dict[str, Any],
        receive: Receive,
        send: Send,
        *,
        prompt: list[int],
        params: dict[str, Any],
        shape: str,
    ) -> None:
        counts, faults = self.counts, self.faults
        counts.requests += 1
        if faults.status is not None:
            await _json(
                send, faults.status, {"error": {"message": "injected", "code": faults.status}}
            )
            return
        n = int(params.get("n") or 1)
        budget = params.get("max_tokens")
        budget = 16 if budget is None or budget < 0 else int(budget)
        stops = set(params.get("stop_token_ids") or ())
        cached = self._cached(prompt)
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})  # fmt: skip
        gone = asyncio.Event()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            gone.set()

        watcher = asyncio.ensure_future(watch())
        counts.running += 1
        finished = False
        try:
            outputs = [list(prompt) for _ in range(n)]
            produced = 0
            for step in range(budget):
                for index in range(n):
                    produced += 1
                    await self._fault(send, produced)
                    token = next_token(outputs[index])
                    outputs[index].append(token)
                    last = step == budget - 1 or token in stops
                    reason = ("stop" if token in stops else "length") if last else None
                    chunk = self._chunk(shape, index, token, reason, cached, step, params)
                    await _event(send, chunk)
                if gone.is_set():
                    return
                await asyncio.sleep(self.delay)
            if shape == "llama":
                for index in range(n):
                    final = {"index": index, "stop": True, "stop_type": "limit", "tokens": []}
                    await _event(send, final)
            else:
                usage = {"prompt_tokens": len(prompt), "completion_tokens": budget * n,
                         "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
                await _event(send, {"choices": [], "usage": usage})
                await _send(send, 200, b"data: [DONE]\n\n", more=True)
            finished = True
            await send({"type": "http.response.body", "body": b""})
        finally:
            counts.running -= 1
            watcher.cancel()
            if not finished:
                counts.aborted += 1

    async def _fault(self, send: Send, produced: int) -> None:
        faults = self.faults
        if faults.reset_after is not None and produced > faults.reset_after:
            raise _Break("injected reset")
        if faults.garbage_after is not None and produced > faults.garbage_after:
            await _send(send, 200, b"data: {not json\n\n", more=True)
            raise _Break("after garbage")
        if faults.eof_after is not None and produced > faults.eof_after:
            await send({"type": "http.response.body", "body": b""})
            raise _Break("eof")
        if faults.error_after is not None and produced > faults.error_after:
            await _event(send, {"error": {"message": "injected failure", "code": 500}})
            raise _Break("error event")

    def _chunk(
        self,
        shape: str,
        index: int,
        token: int,
        reason: str | None,
        cached: int,
        step: int,
        params: dict[str, Any],
    ) -> dict[str, Any]:
        k = params.get("n_probs" if shape == "llama" else "logprobs")
        # the sampled token is the most likely, then the next ids, each less likely
        best = [(token + i, -0.5 * (i + 1)) for i in range(max(k or 0, 1))]
        if shape == "llama":
            chunk: dict[str, Any] = {"index": index, "tokens": [token], "content": "x",
                                     "stop": False, "tokens_predicted": step + 1}  # fmt: skip
            if step == 0:
                chunk["timings"] = {"cache_n": cached}
            if k:
                tops = [{"id": t, "logprob": lp} for t, lp in best]
                chunk["completion_probabilities"] = [
                    {"id": token, "logprob": -0.5, "top_logprobs": tops}
                ]
            return chunk
        choice: dict[str, Any] = {"index": index, "token_ids": [token], "finish_reason": reason}
        if shape == "completions":
            choice["text"] = "x"
            if k is not None:
                choice["logprobs"] = {
                    "token_logprobs": [-0.5],
                    "top_logprobs": [{f"token_id:{t}": lp for t, lp in best[: k + 1]}],
                }
        elif k is not None:
            tops = [{"token_id": t, "logprob": lp, "rank": i + 1} for i, (t, lp) in enumerate(best)]
            choice["logprobs"] = {
                "content": [{"token_id": token, "logprob": -0.5, "top_logprobs": tops[:k]}]
            }
        return {"choices": [choice]}


async def _event(send: Send, data: dict[str, Any]) -> None:
    await _send(send, 200, f"data: {json.dumps(data)}\n\n".encode(), more=True)


async def _send(
    send: Send, status: int, body: bytes, content_type: bytes = b"", *, more: bool = False
) -> None:
    if not more:
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", content_type)]})  # fmt: skip
    await send({"type": "http.response.body", "body": body, "more_body": more})


async def _json(send: Send, status: int, body: Any) -> None:
    await _send(send, status, json.dumps(body).encode(), b"application/json")
