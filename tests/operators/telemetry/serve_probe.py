"""Run ``llm-pipeline serve`` in this process, send it requests, and report what it loaded.

``python -m tests.operators.telemetry.serve_probe [serve options]`` (from the repository's
root): the command line's own ``main`` serves on the main thread (signals and all); a
helper thread waits for its banner, sends a few chat requests over HTTP (streamed and not),
then reports on stdout, as one JSON line, which ``opentelemetry`` modules are loaded and
how many spans were made, and stops the server with SIGTERM. The tests use it to show that
tracing that is off costs nothing: no import, no span.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import sys
import threading
import urllib.request
from typing import Any

import pipeline.tracing
from operators.cli import main

_BANNER = re.compile(r"on (http://\S+)")
spans_made = 0
_init = pipeline.tracing.Span.__init__


def _counting_init(self: Any, *args: Any, **kwargs: Any) -> None:
    global spans_made
    spans_made += 1
    _init(self, *args, **kwargs)


pipeline.tracing.Span.__init__ = _counting_init  # type: ignore[method-assign]


class Banner(io.TextIOBase):
    """stdout: tells the helper thread the server's URL once it is printed."""

    def __init__(self, out: Any) -> None:
        self.out = out
        self.url: str | None = None
        self.ready = threading.Event()

    def write(self, text: str) -> int:
        match = _BANNER.search(text)
        if match is not None and self.url is None:
            self.url = match[1]
            self.ready.set()
        return len(text)


def requests(url: str) -> None:
    for stream in (False, True, False):
        body = {
            "model": "echo",
            "messages": [{"role": "user", "content": "Hello probe"}],
            "max_tokens": 8,
            "stream": stream,
        }
        request = urllib.request.Request(
            f"{url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            response.read()


def probe(banner: Banner, report: Any) -> None:
    try:
        if not banner.ready.wait(60) or banner.url is None:
            report.write(json.dumps({"error": "no banner"}) + "\n")
            return
        requests(banner.url)
        loaded = sorted(name for name in sys.modules if name.split(".")[0] == "opentelemetry")
        report.write(json.dumps({"opentelemetry": loaded, "spans": spans_made}) + "\n")
        report.flush()
    finally:
        os.kill(os.getpid(), signal.SIGTERM)


if __name__ == "__main__":
    report = sys.stdout
    banner = Banner(report)
    sys.stdout = banner  # type: ignore[assignment]
    threading.Thread(target=probe, args=(banner, report), daemon=True).start()
    code = main(["serve", "--engine", "echo", "--port", "0", *sys.argv[1:]])
    sys.exit(code)
