"""Does one large prompt stall the others? Small requests timed while a large one is served.

    python benchmarks/bench_large_prompt.py [--sizes-mb 2 20] [--max-model-len N] \\
        [--text ascii|unicode] [--probes 4]

For each size, a fresh ``llm-pipeline serve --engine echo`` (plus ``--max-model-len`` when
given) on a free loopback port. ``--probes`` client threads send small non-streamed chat
requests back to back (each on its own kept-alive connection) for the whole run; after a
second of them, one chat request whose single message is ``SIZE`` MB of random words is sent
(``max_tokens`` 8). Printed per size:

* the large request's status and wall time;
* the small requests' latency p50 before the first large request, and the worst one while a
  large one was being served (the median over ``--repeat`` large requests, one after the
  other, on one server); ``delay`` is that worst minus the p50 before: how long the large
  request held the others, ``max delay`` the largest over the repeats;
* the server's peak RSS over its RSS just before the large request, divided by the body size.

The goal (issue 11): a delay of at most 50 ms and at most 10x the body in peak RSS. The
client threads share this machine's cores with the server.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench_nats_http import CLI, process

_BANNER = re.compile(r"http://(?P<host>[\d.]+):(?P<port>\d+)")
_WORDS = (
    "the of and to in is was for on that with as by at from his her an which this be are "
    "river mountain seventeen quickly yesterday tokenizer pipeline engine answer question "
    "model stream context window batch prefill decode cache router worker frontend"
).split()
_UNICODE = "naïve café größe 東京 данные ☃ émigré".split()


def rss_kib(pid: int, field: str) -> int:
    """``VmRSS`` or ``VmHWM`` (the peak) of process ``pid``, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} for {pid}")


def large_text(size: int, unicode: bool, seed: int = 7) -> str:
    """About ``size`` bytes of random words (UTF-8)."""
    rng = random.Random(seed)
    words = _WORDS + (_UNICODE if unicode else [])
    chunk = " ".join(rng.choice(words) for _ in range(20_000)) + ". "
    repeat = -(-size // len(chunk.encode()))
    return (chunk * repeat)[:size]


def post(connection: http.client.HTTPConnection, body: bytes) -> tuple[int, bytes]:
    connection.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
    response = connection.getresponse()
    return response.status, response.read()


def run_size(args: argparse.Namespace, megabytes: float) -> dict[str, Any]:
    command = [*CLI, "serve", "--engine", "echo", "--port", "0", "--host", "127.0.0.1"]
    if args.max_model_len:
        command += ["--max-model-len", str(args.max_model_len)]
    with process(command, ready="http://") as (pid, banner):
        match = _BANNER.search(banner)
        if match is None:
            raise RuntimeError(f"no URL in {banner!r}")
        host, port = match["host"], int(match["port"])
        small = json.dumps(
            {"messages": [{"role": "user", "content": "Hello there, how are you?"}],
             "max_tokens": 8}
        ).encode()  # fmt: skip
        text = large_text(int(megabytes * 1_000_000), args.text == "unicode")
        large = json.dumps(
            {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
        ).encode()
        del text
        samples: list[tuple[float, float]] = []  # (start, latency)
        stop = threading.Event()

        def probe() -> None:
            connection = http.client.HTTPConnection(host, port, timeout=120)
            while not stop.is_set():
                started = time.perf_counter()
                status, _ = post(connection, small)
                if status != 200:
                    raise RuntimeError(f"a small request got {status}")
                samples.append((started, time.perf_counter() - started))
            connection.close()

        probes = [threading.Thread(target=probe) for _ in range(args.probes)]
        for thread in probes:
            thread.start()
        time.sleep(1.0)
        baseline_rss = rss_kib(pid, "VmRSS")
        connection = http.client.HTTPConnection(host, port, timeout=600)
        worsts = []
        first_started = time.perf_counter()
        for _ in range(args.repeat):
            large_started = time.perf_counter()
            status, reply = post(connection, large)
            large_ended = time.perf_counter()
            time.sleep(0.3)
            during = [
                lat for start, lat in list(samples)
                if start < large_ended and start + lat > large_started
            ]  # fmt: skip
            worsts.append(max(during, default=0.0))
        peak_rss = rss_kib(pid, "VmHWM")
        stop.set()
        for thread in probes:
            thread.join()
        before = [lat for start, lat in samples if start + lat < first_started]
        p50 = statistics.median(before)
        worst = statistics.median(worsts)
        worst_of_all = max(worsts)
        error = None if status == 200 else json.loads(reply)["error"]["message"][:90]
        return {
            "size_mb": megabytes,
            "status": status,
            "error": error,
            "large_s": large_ended - large_started,
            "small_p50_ms": p50 * 1e3,
            "small_worst_ms": worst * 1e3,
            "delay_ms": (worst - p50) * 1e3,
            "max_delay_ms": (worst_of_all - p50) * 1e3,
            "small_during": len(during),
            "peak_rss_x_body": (peak_rss - baseline_rss) * 1024 / len(large),
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[2.0, 20.0])
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--text", choices=("ascii", "unicode"), default="ascii")
    parser.add_argument("--probes", type=int, default=4)
    parser.add_argument(
        "--repeat", type=int, default=3, help="large requests per server (the median is shown)"
    )
    args = parser.parse_args()
    print(f"max_model_len={args.max_model_len} text={args.text} probes={args.probes}")
    print(f"{'MB':>5} {'status':>6} {'large s':>8} {'small p50 ms':>12} {'worst ms':>9} "
          f"{'delay ms':>9} {'max delay':>9} {'n during':>8} {'peak RSS/body':>13}")  # fmt: skip
    for size in args.sizes_mb:
        r = run_size(args, size)
        print(f"{r['size_mb']:>5g} {r['status']:>6} {r['large_s']:>8.2f} "
              f"{r['small_p50_ms']:>12.2f} {r['small_worst_ms']:>9.1f} {r['delay_ms']:>9.1f} "
              f"{r['max_delay_ms']:>9.1f} "
              f"{r['small_during']:>8} {r['peak_rss_x_body']:>13.1f}"
              + (f"  {r['error']}" if r["error"] else ""), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
