"""The multi-turn trace against ours with and without a host KV tier, and llama-server with
and without its host-memory prompt cache: TTFT and prompt tokens computed.

    .venv/bin/python benchmarks/bench_kv_tiers.py [--llama-server PATH] [--parallel 2] \\
        [--conversations 8] [--turns 4] [--system-tokens 256] [--question-tokens 32] \\
        [--max-tokens 32] [--runs 2] [--host-mb 512]

The trace is ``bench_kv_http.py``'s (a shared system prompt, each turn the whole
conversation so far plus a new question, closed loop with think time), with more
conversations than slots, so a conversation's next turn usually finds its slot taken by
another: without a tier its history is prefilled again; with ``--kv-host-cache-mb`` it is
restored from host memory. The servers, one at a time, each fresh:

- ``ours``: ``serve --engine llama --parallel P``;
- ``ours-host``: the same with ``--kv-host-cache-mb``;
- ``llama-server``: ``-np P -fa off`` with its default ``--cache-ram`` (8 GiB);
- ``llama-server-no-ram``: the same with ``--cache-ram 0`` (its slots' prefix caches only).

Prompt tokens computed are ours' ``llm_pipeline_llama_prefill_tokens_total`` and
llama-server's own ``timings.prompt_n`` (the tokens it evaluated); both servers report
``usage.prompt_tokens_details.cached_tokens``. Printed: ``bench_kv_http.py``'s table per
server (medians of ``--runs``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_llama_http import free_port, server, smollm2_gguf

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-server", type=Path, default=None)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=2048, help="per sequence")
    parser.add_argument("--host-mb", type=int, default=512)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--think-ms", type=float, default=200.0)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--servers", nargs="+", default=None, help="a subset, by name")
    args = parser.parse_args()
    ours = [
        sys.executable, "-m", "operators.cli", "serve", "--engine", "llama",
        "--threads", str(args.threads), "--parallel", str(args.parallel),
        "--n-ctx", str(args.n_ctx), "--model-name", "smollm2", "--host", "127.0.0.1",
    ]  # fmt: skip
    servers = {
        "ours": ours,
        "ours-host": [*ours, "--kv-host-cache-mb", str(args.host_mb)],
    }
    if args.llama_server is not None:
        theirs = [
            str(args.llama_server), "-m", str(smollm2_gguf()), "-t", str(args.threads),
            "-np", str(args.parallel), "-c", str(args.n_ctx * args.parallel), "-fa", "off",
            "--host", "127.0.0.1",
        ]  # fmt: skip
        servers["llama-server"] = theirs
        servers["llama-server-no-ram"] = [*theirs, "--cache-ram", "0"]
    chosen = args.servers or list(servers)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as record:
        path = Path(record.name)
    for name in chosen:
        port = free_port()
        with server([*servers[name], "--port", str(port)], port):
            subprocess.run(
                [
                    sys.executable, str(HERE / "bench_kv_http.py"),
                    "--url", f"http://127.0.0.1:{port}", "--model", "smollm2",
                    "--conversations", str(args.conversations), "--turns", str(args.turns),
                    "--system-tokens", str(args.system_tokens),
                    "--question-tokens", str(args.question_tokens),
                    "--max-tokens", str(args.max_tokens), "--think-ms", str(args.think_ms),
                    "--runs", str(args.runs), "--label", name, "--json", str(path),
                ],
                check=True,
            )  # fmt: skip
    print()
    subprocess.run(
        [sys.executable, str(HERE / "bench_kv_http.py"), "--report", str(path)], check=True
    )
    print(f"(runs recorded in {path})")


if __name__ == "__main__":
    main()
