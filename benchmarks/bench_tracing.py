"""What tracing costs: CPU-µs per token and per request, off against on, in process.

Run on demand: ``.venv/bin/python benchmarks/bench_tracing.py [--requests 300]
[--max-tokens 256]``.

The whole OpenAI app (the HTTP edge, SSE writer and default graph over the echo engine) is
driven through ASGI without a socket, streamed chat requests one after another, on uvloop
as ``llm-pipeline serve`` runs. Three apps, one per configuration, take turns request by
request (so a change in the machine's load hits them alike):

* ``off``       no tracer: what ``serve --no-ui`` runs without an OTLP endpoint;
* ``buffer``    spans kept in process for the web UI's status view (``serve``'s default);
* ``otlp``      the buffer plus the OTLP/HTTP exporter, sending to a collector in another
                process (its CPU is not counted; the exporter's encoding and sending is).

Each request's CPU time on the event loop's thread is measured around it
(``time.thread_time``); the exporter's own thread counts its CPU (``cpu_seconds``), added
to the ``otlp`` row. Reported: µs of CPU per token and per request, and what each adds
over ``off``. The budget (issue 28): tracing on adds at most 1 CPU-µs per token; spans
are per request and per stage, so the per-token figure is the per-request cost over the
answer's length.
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
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
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
KINDS = ("off", "buffer", "otlp")


async def one_request(app: Any, body: bytes) -> None:
    """Send one streamed chat through ``app`` (ASGI, no socket)."""
    delivered = False
    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "scheme": "http",
        "client": ("127.0.0.1", 50000),
        "headers": [(b"content-type", b"application/json")],
    }

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        await anyio.sleep_forever()
        raise AssertionError  # (unreachable: the watcher is cancelled)

    async def send(message: dict[str, Any]) -> None:
        pass

    await app(scope, receive, send)


async def measure(args: argparse.Namespace, endpoint: str) -> dict[str, float]:
    """CPU seconds per configuration for ``args.requests`` requests each."""
    tokenizer = Tokenizer.default()
    apps: dict[str, Any] = {}
    exporter = None
    for kind in KINDS:
        tracer = None
        if kind != "off":
            options = TracingOptions(endpoint if kind == "otlp" else None)
            tracer, made = make_tracer(options, buffer=SpanBuffer())
            exporter = made or exporter
        engine = EchoEngine.from_tokenizer(tokenizer, cycle=True)
        apps[kind] = build_app(engine, tokenizer, model_name="echo", tracer=tracer)
    assert exporter is not None
    body = orjson.dumps(
        {
            "model": "echo",
            "messages": [{"role": "user", "content": "the quick brown fox jumps " * 16}],
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": args.max_tokens,
        }
    )
    for _ in range(20):  # warm-up
        for kind in KINDS:
            await one_request(apps[kind], body)
    exporter.force_flush()
    exporter_before = exporter.cpu_seconds
    used = dict.fromkeys(KINDS, 0.0)
    for index in range(args.requests):
        order = KINDS[index % 3 :] + KINDS[: index % 3]  # each goes first in turn
        for kind in order:
            start = time.thread_time()
            await one_request(apps[kind], body)
            used[kind] += time.thread_time() - start
    exporter.force_flush()
    used["otlp"] += exporter.cpu_seconds - exporter_before
    exporter.shutdown()
    return used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--max-tokens", type=int, default=256)
    args = parser.parse_args()
    collector = subprocess.Popen(
        [sys.executable, "-c", _COLLECTOR], stdout=subprocess.PIPE, text=True
    )
    try:
        assert collector.stdout is not None
        endpoint = f"http://127.0.0.1:{collector.stdout.readline().strip()}/v1/traces"
        used = anyio.run(
            measure, args, endpoint, backend="asyncio", backend_options={"use_uvloop": True}
        )
    finally:
        collector.kill()
        collector.wait()
    tokens = args.requests * args.max_tokens
    print(
        f"{args.requests} streamed chat requests of {args.max_tokens} tokens per configuration, "
        "echo engine, in process on uvloop, taking turns"
    )
    print(f"{'tracing':<10}{'µs/token':>10}{'µs/request':>12}{'+µs/token':>11}{'+µs/request':>13}")
    for kind in KINDS:
        per_token = used[kind] / tokens * 1e6
        per_request = used[kind] / args.requests * 1e6
        added = (used[kind] - used["off"]) / tokens * 1e6
        added_request = (used[kind] - used["off"]) / args.requests * 1e6
        print(
            f"{kind:<10}{per_token:>10.2f}{per_request:>12.0f}{added:>11.3f}{added_request:>13.0f}"
        )


if __name__ == "__main__":
    main()
