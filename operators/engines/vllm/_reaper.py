"""Stopping vLLM's processes when the process that started them dies without stopping them.

vLLM's engine core runs in a process of its own (on CPUs with a worker process under it).
A :class:`~operators.engines.vllm.VllmEngine` closed normally stops them; but a server or
worker that is killed (``SIGKILL``, the OOM killer, a test's ``kill()``) cannot, and vLLM's
engine core does not notice its frontend is gone: it lives on, holding its memory and a
core (seen here: still running, and ignoring ``SIGTERM``, seconds after its parent was
killed). So every engine starts a reaper: a tiny separate Python process holding the read
end of a pipe whose write end only our process holds. When our process dies, for whatever
reason, the kernel closes the pipe; the reaper reads end-of-file and kills the processes vLLM
started (each checked by its start time, so that a reused pid is never killed). A normal
close first tells the reaper to stand down (one byte), then closes the pipe.

Why a process and not a signal set in the children (``PR_SET_PDEATHSIG``): we do not start
vLLM's processes ourselves, and that signal fires when the parent *thread* exits (the engine
is started from a worker thread that the thread pool later retires), not the process.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import subprocess
import sys
from collections.abc import Iterable
from typing import IO, Final, final

__all__ = ("ProcessReaper", "descendants", "start_time")

#: the reaper's program after :func:`start_time` (stdlib only; run with ``-S``: no
#: site-packages, so it starts in milliseconds)
_MAIN: Final = r"""
import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the server's to handle
targets = [tuple(int(part) for part in arg.split(":")) for arg in sys.argv[1:]]
if sys.stdin.buffer.read(1):
    sys.exit(0)  # told to stand down: the engine stopped its processes itself
for pid, started in targets:
    if start_time(pid) == started:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
"""


def start_time(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (None: gone, or not Linux)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int | None = None) -> set[int]:
    """Every process under ``pid`` (default: this one), from ``/proc`` (empty elsewhere),
    but multiprocessing's resource tracker: it outlives an engine, and when its parent dies
    it must live on to free what the engine's processes left in shared memory."""
    root = os.getpid() if pid is None else pid
    parents: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as stat:
                    parent = int(stat.read().rsplit(b")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    frontier = [root]
    while frontier:
        children = parents.get(frontier.pop(), [])
        frontier.extend(child for child in children if child not in found)
        found.update(children)
    return {pid for pid in found if not _is_tracker(pid)}


def _is_tracker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            return b"resource_tracker" in cmdline.read()
    except OSError:
        return False


@final
class ProcessReaper:
    """Kills ``pids`` if this process dies before :meth:`stand_down` (see the module)."""

    def __init__(self, pids: Iterable[int]) -> None:
        targets = [f"{pid}:{started}" for pid in pids if (started := start_time(pid)) is not None]
        self.pids = frozenset(int(target.split(":")[0]) for target in targets)
        self._process: subprocess.Popen[bytes] | None = None
        self._pipe: IO[bytes] | None = None
        if not targets:
            return
        program = f"{inspect.getsource(start_time)}\n{_MAIN}"
        self._process = subprocess.Popen(
            [sys.executable, "-S", "-c", program, *targets],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # its own session: a terminal's signals are not for it
            close_fds=True,
        )
        self._pipe = self._process.stdin

    def stand_down(self) -> None:
        """vLLM's processes were stopped normally: the reaper exits without killing.
        Idempotent."""
        pipe, self._pipe = self._pipe, None
        process, self._process = self._process, None
        if pipe is not None:
            with contextlib.suppress(OSError):  # (it was killed itself)
                pipe.write(b"x")
                pipe.close()
        if process is not None:
            process.wait()
