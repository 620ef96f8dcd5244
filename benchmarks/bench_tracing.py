"""What tracing costs: CPU-µs per token and per request, off against on, in process.

Run on demand: ``.venv/bin/python benchmarks/bench_tracing.py [--requests 200]
[--max-tokens 256] [--rounds 3]``.

The whole OpenAI app (the HTTP edge, SSE writer and default graph over the echo engine) is
driven through ASGI without a socket, one streamed chat request after another, on uvloop
as ``llm-pipeline serve`` runs. CPU time is the process's (every thread: the OTLP
exporter's converting and sending thread is counted), best of ``--rounds`` with the
configurations interleaved:

* ``off``       no tracer: what ``serve --no-ui`` runs without an OTLP endpoint;
* ``buffer``    spans kept in process for the web UI's status view (``serve``'s default);
* ``otlp``      the buffer plus the real OTLP/HTTP exporter, sending to a collector in
                another process (its CPU is not counted, the exporter's encoding is).

Reported: µs of CPU per token and per request, and what each adds over ``off``. The
budget (issue 28): tracing on adds at most 1 CPU-µs per token; spans are per request and
per stage, so the per-token figure is the per-request cost over the answer's length.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import anyio
import orjson

from operators.engines import EchoEngine
from operators.serving import build_app
from operators.telemetry import SpanBuffer, TracingOptions, make_tracer
from operators.text.tokenizer import Tokenizer

#: a collector that answers every export with 200 and forgets it (another process)
_COLLECTOR = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
    def log_message(self, *a):
        pass
server = ThreadingHTTPServer(("127.0.0.1", 0), H)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


async def serve_requests(app: Any, body: bytes, requests: int) -> int:
    """Send ``requests`` streamed chats through ``app``; the bytes it answered."""
    answered = 0
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "scheme": "http",
        "client": ("127.0.0.1", 50000),
        "headers": [(b"content-type", b"application/json")],
    }
    for _ in range(requests):
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await anyio.sleep_forever()
            raise AssertionError  # (unreachable: the watcher is cancelled)

        async def send(message: dict[str, Any]) -> None:
            nonlocal answered
            answered += len(message.get("body", b""))

        await app(dict(scope), receive, send)
    return answered


def make_app(kind: str, tokenizer: Tokenizer, endpoint: str) -> tuple[Any, Any]:
    engine = EchoEngine.from_tokenizer(tokenizer, cycle=True)
    tracer = exporter = None
    if kind != "off":
        options = TracingOptions(endpoint if kind == "otlp" else None)
        tracer, exporter = make_tracer(options, buffer=SpanBuffer())
    return build_app(engine, tokenizer, model_name="echo", tracer=tracer), exporter


async def measure(
    kind: str, tokenizer: Tokenizer, args: argparse.Namespace, endpoint: str
) -> float:
    """CPU seconds for ``args.requests`` requests (after a warm-up) with tracing ``kind``."""
    app, exporter = make_app(kind, tokenizer, endpoint)
    body = orjson.dumps(
        {
            "model": "echo",
            "messages": [{"role": "user", "content": "the quick brown fox jumps " * 16}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens,
        }
    )
    await serve_requests(app, body, 20)
    if exporter is not None:
        exporter.force_flush()
    start = time.process_time()
    await serve_requests(app, body, args.requests)
    if exporter is not None:
        exporter.force_flush()  # the spans of these requests are encoded and sent
    used = time.process_time() - start
    if exporter is not None:
        exporter.shutdown()
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    collector = subprocess.Popen(
        [sys.executable, "-c", _COLLECTOR], stdout=subprocess.PIPE, text=True
    )
    try:
        assert collector.stdout is not None
        endpoint = f"http://127.0.0.1:{collector.stdout.readline().strip()}/v1/traces"
        tokenizer = Tokenizer.default()
        kinds = ("off", "buffer", "otlp")
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.rounds):
            for kind in kinds:
                used = anyio.run(
                    measure,
                    kind,
                    tokenizer,
                    args,
                    endpoint,
                    backend="asyncio",
                    backend_options={"use_uvloop": True},
                )
                best[kind] = min(best[kind], used)
    finally:
        collector.kill()
        collector.wait()
    tokens = args.requests * args.max_tokens
    print(
        f"{args.requests} streamed chat requests of {args.max_tokens} tokens, echo engine, "
        f"in process on uvloop; CPU best of {args.rounds}"
    )
    print(f"{'tracing':<10}{'µs/token':>10}{'µs/request':>12}{'+µs/token':>11}{'+µs/request':>13}")
    for kind in kinds:
        per_token = best[kind] / tokens * 1e6
        per_request = best[kind] / args.requests * 1e6
        added = (best[kind] - best["off"]) / tokens * 1e6
        added_request = (best[kind] - best["off"]) / args.requests * 1e6
        print(
            f"{kind:<10}{per_token:>10.2f}{per_request:>12.0f}{added:>11.3f}{added_request:>13.0f}"
        )


if __name__ == "__main__":
    main()
