"""Load generator for OpenAI-compatible streaming servers: TTFT, ITL, tokens/s, CPU per token.

    python benchmarks/loadgen.py --url http://127.0.0.1:8000 --concurrency 64 --requests 2000 \\
        --prompt-tokens 128 --max-tokens 256 --chat --server-pid PID

``--api`` picks the edge: ``chat`` (the default), ``completions``, ``responses`` (OpenAI's
Responses API, ``--store`` or not) or ``messages`` (Anthropic's): the same workload through
each, so their server CPU per token compares directly (``benchmarks/bench_edges.py``).

Each of ``--concurrency`` workers sends streamed requests back to back until ``--requests``
have been sent. The client is raw HTTP/1.1 on an asyncio Protocol (uvloop when installed)
with keep-alive connections, so it costs a few microseconds per token and is not the
bottleneck: SSE bodies are never JSON-parsed except for the final usage event, which gives
the exact completion-token count.

Measured per request: TTFT = request written -> first read carrying a non-empty token; ITL =
gap between consecutive reads carrying tokens (one sample per read); output tokens from
``usage.completion_tokens`` (``stream_options.include_usage`` is always set). With
``--server-pid`` the server's CPU time (utime + stime from ``/proc/PID/stat``) over the
measured run is divided by the output tokens: CPU-µs per token for the whole server
process. The generator's own CPU time is reported too, to show it was not saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
    uvloop = None  # type: ignore[assignment]

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int | str) -> float:
    """utime + stime of process ``pid`` ("self" for this one), in seconds."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime and stime are fields 14 and 15
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


@dataclass(slots=True)
class RequestResult:
    ok: bool = False
    status: int = 0
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str | None = None
    #: ``usage.prompt_tokens``, and its ``prompt_tokens_details.cached_tokens`` (None: not said)
    prompt_tokens: int = 0
    cached_tokens: int | None = None


_HEADERS, _SIZE, _DATA, _DATA_END, _TRAILER, _FIXED = range(6)


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection; one request at a time."""

    def __init__(self, markers: tuple[bytes, bytes], api: Api) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._marker, self._empty = markers
        self._api = api
        self._buffer = b""
        self._state = _HEADERS
        self._remaining = 0
        self._result: RequestResult | None = None
        self._done: asyncio.Future[RequestResult] | None = None
        self._sent_at = 0.0
        self._last = 0.0
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast("asyncio.Transport", transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        if self._done is not None and not self._done.done():
            assert self._result is not None
            self._result.error = f"connection lost: {exc}"
            self._done.set_result(self._result)
        if not self.closed.done():
            self.closed.set_result(None)

    def request(self, payload: bytes) -> asyncio.Future[RequestResult]:
        assert self.transport is not None
        self._result = RequestResult()
        self._done = asyncio.get_running_loop().create_future()
        self._state = _HEADERS
        self._buffer = b""
        self._tail = b""
        self._sent_at = time.perf_counter()
        self.transport.write(payload)
        return self._done

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        buffer = self._buffer + data if self._buffer else data
        while True:
            state = self._state
            if state == _HEADERS:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    break
                self._head(buffer[:end])
                buffer = buffer[end + 4 :]
            elif state == _SIZE:
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                size = int(buffer[:end].split(b";", 1)[0], 16)
                buffer = buffer[end + 2 :]
                if size == 0:
                    self._state = _TRAILER
                else:
                    self._remaining = size
                    self._state = _DATA
            elif state == _DATA:
                if not buffer:
                    break
                piece = buffer[: self._remaining]
                buffer = buffer[len(piece) :]
                self._remaining -= len(piece)
                self._body(piece, now)
                if self._remaining == 0:
                    self._state = _DATA_END
            elif state == _DATA_END:
                if len(buffer) < 2:
                    break
                buffer = buffer[2:]
                self._state = _SIZE
            elif state == _TRAILER:
                end = buffer.find(b"\r\n")
                if end < 0:
                    break
                buffer = buffer[end + 2 :]
                if end == 0:
                    self._finish()
                    break
            else:  # _FIXED: a Content-Length body (an error response)
                take = buffer[: self._remaining]
                buffer = buffer[len(take) :]
                self._remaining -= len(take)
                self._tail += take
                if self._remaining == 0:
                    assert self._result is not None
                    self._result.error = f"HTTP {self._result.status}: {self._tail[:200]!r}"
                    self._finish()
                break
        self._buffer = buffer

    def _head(self, head: bytes) -> None:
        assert self._result is not None
        lines = head.split(b"\r\n")
        self._result.status = int(lines[0].split(b" ", 2)[1])
        chunked = False
        length = 0
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
            elif name == b"content-length":
                length = int(value)
        if chunked:
            self._state = _SIZE
        else:
            self._state = _FIXED
            self._remaining = length
            if length == 0:
                self._result.error = f"HTTP {self._result.status} with an empty body"
                self._finish()

    def _body(self, piece: bytes, now: float) -> None:
        result = self._result
        assert result is not None
        tokens = piece.count(self._marker) - piece.count(self._empty)
        if tokens > 0:
            if result.ttft is None:
                result.ttft = now - self._sent_at
            else:
                result.itl.append(now - self._last)
            self._last = now
        if self._tail or any(mark in piece for mark in self._api.tail_marks):
            self._tail += piece

    def _finish(self) -> None:
        result = self._result
        done = self._done
        assert result is not None
        assert done is not None
        if result.error is None:
            self._read_tail(result)
        self._state = _HEADERS
        if not done.done():
            done.set_result(result)

    def _read_tail(self, result: RequestResult) -> None:
        for block in self._tail.split(b"\n\n"):
            start = block.find(b"data: {")
            if start < 0:
                continue
            event = json.loads(block[start + 6 :])
            error = self._api.error_of(event)
            if error is not None:
                result.error = f"stream error: {error}"
                return
            tokens = self._api.tokens_of(event)
            if tokens:
                result.tokens = tokens
                usage: Any = event.get("usage") or {}
                result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                details = usage.get("prompt_tokens_details") or {}
                cached = details.get("cached_tokens") if isinstance(details, dict) else None
                result.cached_tokens = cached if isinstance(cached, int) else None
        if result.status != 200:
            result.error = f"HTTP {result.status}"
        elif not result.tokens:
            result.error = "no usage in the stream"
        else:
            result.ok = True


@dataclass(frozen=True, slots=True)
class Api:
    """How one edge's streams are asked for and read."""

    path: str
    #: a token-bearing event contains the first, an empty one the second
    markers: tuple[bytes, bytes]
    #: events that carry the usage or an error: kept to be parsed at the end
    tail_marks: tuple[bytes, ...]

    def tokens_of(self, event: dict[str, object]) -> int:
        """The output tokens an end event reports (0: not an end event)."""
        usage: Any = event.get("usage")
        if self.path == "/v1/responses":
            response: Any = event.get("response") or {}
            usage = response.get("usage")
            return int((usage or {}).get("output_tokens") or 0)
        if self.path == "/v1/messages":
            return int((usage or {}).get("output_tokens") or 0)
        return int((usage or {}).get("completion_tokens") or 0)

    def error_of(self, event: dict[str, object]) -> str | None:
        """The message of an error event (None: not one)."""
        error: Any = event.get("error")
        if event.get("type") == "response.failed":
            error = (event.get("response") or {}).get("error")  # type: ignore[union-attr]
        if isinstance(error, dict):
            return str(error.get("message"))
        return None


APIS: dict[str, Api] = {
    "chat": Api(
        "/v1/chat/completions", (b'"content":"', b'"content":""'), (b'"usage":{', b'"error":')
    ),
    "completions": Api("/v1/completions", (b'"text":"', b'"text":""'), (b'"usage":{', b'"error":')),
    "responses": Api(
        "/v1/responses",
        (b'"type":"response.output_text.delta"', b'"delta":"",'),
        (b'"type":"response.completed"', b'"type":"response.incomplete"', b"response.failed"),
    ),
    "messages": Api(
        "/v1/messages",
        (b'"type":"text_delta"', b'"text_delta","text":""'),
        (b'"type":"message_delta"', b'"type":"error"'),
    ),
}


@dataclass(slots=True)
class Workload:
    host: str
    port: int
    path: str
    #: one request per API key (workers take turns: worker i sends payloads[i % n])
    payloads: tuple[bytes, ...]
    markers: tuple[bytes, bytes]
    reuse: bool
    api: Api


def request_body(api: str, model: str, prompt: str, max_tokens: int, store: bool) -> dict[str, Any]:
    """The streamed request of ``api`` for ``prompt``."""
    if api == "responses":
        return {
            "model": model,
            "input": prompt,
            "max_output_tokens": max_tokens,
            "stream": True,
            "store": store,
        }
    if api == "messages":
        messages = [{"role": "user", "content": prompt}]
        return {"model": model, "max_tokens": max_tokens, "messages": messages, "stream": True}
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if api == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def build_workload(args: argparse.Namespace) -> Workload:
    url = urlsplit(args.url)
    host = url.hostname or "127.0.0.1"
    port = url.port or 80
    prompt = build_prompt(args.prompt_tokens)
    api = APIS[args.api]
    path = api.path
    markers = api.markers
    body = request_body(args.api, args.model, prompt, args.max_tokens, args.store)
    data = json.dumps(body).encode()
    connection = b"keep-alive" if args.reuse_connections else b"close"
    payloads = []
    for key in args.api_key or [None]:
        auth = b"" if key is None else b"Authorization: Bearer %s\r\n" % key.encode()
        payloads.append(
            b"POST %s HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
            b"Accept: text/event-stream\r\n%sConnection: %s\r\nContent-Length: %d\r\n\r\n"
            % (path.encode(), host.encode(), port, auth, connection, len(data))
            + data
        )
    return Workload(host, port, path, tuple(payloads), markers, args.reuse_connections, api)


def build_prompt(tokens: int) -> str:
    """A prompt of ``tokens`` tokens for the bundled tokenizer (when importable)."""
    words = [f" w{i % 97}" for i in range(tokens * 2)]
    try:
        from operators.text.tokenizer import Tokenizer
    except ImportError:
        return "".join(words[: tokens // 2]).strip()
    tokenizer = Tokenizer.default()
    ids = tokenizer.encode("".join(words))[:tokens]
    return tokenizer.decode(ids)


class Worker:
    """One request at a time, on its own connection (kept alive unless ``reuse`` is off)."""

    def __init__(self, workload: Workload, number: int = 0) -> None:
        self._workload = workload
        self._payload = workload.payloads[number % len(workload.payloads)]
        self._connection: _Connection | None = None

    async def connect(self) -> None:
        """Open the connection now (so that a measured run does not pay for it)."""
        connection = self._connection
        if connection is None or connection.transport is None or connection.closed.done():
            loop = asyncio.get_running_loop()
            workload = self._workload
            _, self._connection = await loop.create_connection(
                lambda: _Connection(workload.markers, workload.api), workload.host, workload.port
            )

    async def run(self, counter: list[int], results: list[RequestResult]) -> None:
        """Send requests until ``counter`` (shared by the workers) runs out."""
        while counter[0] > 0:
            counter[0] -= 1
            try:
                await self.connect()
            except OSError as exc:
                results.append(RequestResult(error=f"connect: {exc}"))
                continue
            assert self._connection is not None
            result = await self._connection.request(self._payload)
            results.append(result)
            if not self._workload.reuse or not result.ok:
                await self.close()

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None and connection.transport is not None:
            connection.transport.close()
            await connection.closed


async def run(workers: list[Worker], requests: int) -> list[RequestResult]:
    counter = [requests]
    results: list[RequestResult] = []
    await asyncio.gather(*(worker.run(counter, results) for worker in workers))
    return results


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    workload = build_workload(args)
    workers = [Worker(workload, number) for number in range(args.concurrency)]
    if args.reuse_connections:
        await asyncio.gather(*(worker.connect() for worker in workers))
    if args.warmup:
        await run(workers, args.warmup)
    server_cpu = cpu_seconds(args.server_pid) if args.server_pid else 0.0
    own_cpu = cpu_seconds("self")
    start = time.perf_counter()
    results = await run(workers, args.requests)
    elapsed = time.perf_counter() - start
    await asyncio.gather(*(worker.close() for worker in workers))
    own_cpu = cpu_seconds("self") - own_cpu
    server_cpu = cpu_seconds(args.server_pid) - server_cpu if args.server_pid else 0.0
    ok = [r for r in results if r.ok]
    tokens = sum(r.tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [gap for r in ok for gap in r.itl]
    errors = [r.error for r in results if not r.ok]
    report: dict[str, object] = {
        "concurrency": args.concurrency,
        "requests": len(results),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(ok) / elapsed, 1),
        "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / elapsed),
        "ttft_ms": {q: round(percentile(ttfts, q) * 1e3, 2) for q in (50, 90, 99)},
        "itl_ms": {q: round(percentile(itls, q) * 1e3, 3) for q in (50, 99)},
        "client_cpu_s": round(own_cpu, 2),
    }
    if args.server_pid:
        report["server_cpu_s"] = round(server_cpu, 2)
        report["server_cpu_us_per_token"] = round(server_cpu * 1e6 / tokens, 1) if tokens else None
    return report


def print_report(report: dict[str, object]) -> None:
    ttft = report["ttft_ms"]
    itl = report["itl_ms"]
    assert isinstance(ttft, dict)
    assert isinstance(itl, dict)
    print(
        f"concurrency {report['concurrency']}: {report['requests']} requests, "
        f"{report['errors']} errors, {report['elapsed_s']} s"
    )
    print(f"  output tokens/s   {report['output_tokens_per_s']}")
    print(f"  requests/s        {report['requests_per_s']}")
    print(f"  TTFT ms p50/p90/p99  {ttft[50]} / {ttft[90]} / {ttft[99]}")
    print(f"  ITL ms p50/p99       {itl[50]} / {itl[99]}")
    if "server_cpu_us_per_token" in report:
        print(
            f"  server CPU        {report['server_cpu_s']} s = "
            f"{report['server_cpu_us_per_token']} µs/token"
        )
    print(f"  client CPU        {report['client_cpu_s']} s")
    if report["first_error"]:
        print(f"  first error: {report['first_error']}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default="echo", help="the model name to request")
    parser.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    parser.add_argument("--requests", type=int, default=100, help="requests to measure")
    parser.add_argument("--warmup", type=int, default=16, help="unmeasured requests first")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="prompt length")
    parser.add_argument("--max-tokens", type=int, default=256, help="output tokens")
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--api", choices=sorted(APIS), default="chat", help="the edge to drive")
    kind.add_argument("--chat", dest="api", action="store_const", const="chat")
    kind.add_argument("--completions", dest="api", action="store_const", const="completions")
    parser.add_argument(
        "--store",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="--api responses: ask the server to store each response",
    )
    parser.add_argument(
        "--reuse-connections",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep connections alive between requests",
    )
    parser.add_argument(
        "--api-key",
        action="append",
        default=None,
        metavar="KEY",
        help="send 'Authorization: Bearer KEY' (repeatable: the workers take turns)",
    )
    parser.add_argument("--server-pid", type=int, default=None, help="for CPU accounting")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if uvloop is not None:
        report = uvloop.run(main_async(args))
    else:  # pragma: no cover
        report = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)


if __name__ == "__main__":
    main()
