"""``--connector local``: worker processes on this machine (:class:`LocalConnector`).

Each pool (model, role) has a command template, run with ``/bin/sh -c`` after its fields
are filled in (Python's format syntax, each value shell-quoted)::

    {model}  {role}  {worker_id}  {nats}  {drain_timeout}

``{worker_id}`` must be passed to the worker (``--worker-id {worker_id}``): it is how the
planner recognizes, in discovery, the worker it started. A worker runs in a session of its
own (the planner's terminal signals do not reach it), its output goes where the planner's
does, and a fresh worker id names each process.

- **A crash is restarted** after a back-off: 1 s, doubling to 60 s while the processes die
  young (within a minute of their start), back to 1 s after one lived longer. So a command
  that cannot start (a typo, a model that does not load) is reported at each attempt (its
  exit code, how long it ran, when the next try is) and retried ever more slowly, never in
  a tight loop; and a worker killed by something else is replaced a second later.
- **A worker leaves by draining**: it gets SIGTERM, which a worker answers by leaving
  discovery and draining (one the planner told to drain over NATS already is draining:
  for it the signal changes nothing), and exits once drained, with code 0. One still
  there ``drain_timeout`` + 10 s later is killed (SIGKILL): a worker that hangs does not
  hold the pool forever.

A simple command (no ``;``, ``&``, ``|``, parentheses or redirections outside quotes, one
line, no leading ``NAME=value``) is run as ``exec COMMAND``, so the worker is the process the
connector started: SIGTERM reaches it alone (not the processes it started itself, a vLLM
engine core, which it stops in its own time), and its exit code is its own. A compound
command runs under its shell: SIGTERM goes to the whole process group (the shell dies at
once, its worker drains on: the connector waits until the group is empty, and the exit
code it reports is the shell's).
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import shlex
import signal
import subprocess
import time
from collections.abc import AsyncGenerator, Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from types import TracebackType
from typing import Final, final

import anyio
from anyio.abc import Process, TaskGroup

from .connector import ManagedWorker, WorkerState

__all__ = ("BACKOFF_FIRST", "BACKOFF_MAX", "LocalConnector", "check_template")

logger = logging.getLogger(__name__)

#: seconds before the first restart of a crashed worker; doubled at each early death ...
BACKOFF_FIRST: Final = 1.0
#: ... up to this
BACKOFF_MAX: Final = 60.0
#: a worker that ran this long before it died starts the back-off over
_LIVED: Final = 60.0
#: seconds beyond the drain timeout a leaving worker is given before SIGTERM, then SIGKILL
_GRACE: Final = 10.0
#: the template's fields
FIELDS: Final = ("model", "role", "worker_id", "nats", "drain_timeout")
#: a shell word that is a control operator or a redirection, and a leading assignment:
#: what keeps a command from being exec'd
_OPERATOR: Final = re.compile(r"[();<>|&]+")
_ASSIGNMENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*=")

Pool = tuple[str, str]


def check_template(template: str) -> None:
    """Raise ValueError (naming the problem) unless ``template`` is a usable command."""
    try:
        filled = template.format(**{name: name for name in FIELDS})
    except (KeyError, IndexError) as exc:
        raise ValueError(
            f"unknown field {exc} (the fields are {', '.join('{' + f + '}' for f in FIELDS)})"
        ) from None
    except ValueError as exc:
        raise ValueError(f"not a format string: {exc}") from None
    if "{worker_id}" not in template.replace("{{", "").replace("}}", ""):
        raise ValueError(
            "it must pass {worker_id} to the worker (--worker-id {worker_id}): that is how "
            "the planner recognizes the workers it started"
        )
    if not filled.strip():
        raise ValueError("it is empty")


@final
class _Slot:
    """One worker of a pool, through its restarts."""

    __slots__ = (
        "detail",
        "escalation",
        "exec",
        "leaving",
        "pool",
        "process",
        "restarts",
        "state",
        "wake",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.process: Process | None = None
        self.state: WorkerState = "running"
        self.restarts = 0
        self.detail = ""
        self.leaving = False
        self.wake = anyio.Event()
        #: the watch over a leaving process (:meth:`LocalConnector._escalate`), cancelled
        #: once the process is gone
        self.escalation = anyio.CancelScope()
        #: whether the process is the worker itself (a simple command, exec'd)
        self.exec = False


@final
class LocalConnector:
    """Runs each pool's workers as processes of ``commands[(model, role)]`` (a template: see
    the module docstring); ``fields`` fills ``{nats}``. Enter it to use it; leaving drains
    every worker it runs (SIGTERM), waiting up to ``drain_timeout`` + 10 s for each.

    ``on_restart(model, role)`` is told of every restart (for a metric).
    """

    def __init__(
        self,
        commands: Mapping[Pool, str],
        *,
        nats: str,
        drain_timeout: float,
        on_restart: Callable[[str, str], None] = lambda model, role: None,
    ) -> None:
        for (model, role), template in commands.items():
            try:
                check_template(template)
            except ValueError as exc:
                raise ValueError(f"the worker command of {model!r} ({role}): {exc}") from None
        self._commands = dict(commands)
        self._nats = nats
        self._drain_timeout = drain_timeout
        self._on_restart = on_restart
        self._slots: dict[str, _Slot] = {}  # by the worker id it runs now
        self._tg: TaskGroup | None = None
        self._cm: AbstractAsyncContextManager[LocalConnector] | None = None

    async def __aenter__(self) -> LocalConnector:
        if self._cm is not None:
            raise RuntimeError(f"{self!r} is already running; a connector runs once")
        self._cm = self._running_workers()
        return await self._cm.__aenter__()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        assert self._cm is not None, "__aexit__ without __aenter__"
        return await self._cm.__aexit__(exc_type, exc, tb)

    @asynccontextmanager
    async def _running_workers(self) -> AsyncGenerator[LocalConnector]:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                yield self
            finally:
                self._tg = None
                for slot in list(self._slots.values()):
                    self._leave(slot, tg)

    # -- the Connector protocol

    async def scale_to(self, model: str, role: str, n: int, *, leaving: Sequence[str] = ()) -> None:
        """Keep ``n`` workers of ``model`` in ``role`` (see :class:`~.connector.Connector`).

        Raises:
            ValueError: a pool this connector has no command for, or ``n`` below 0.
        """
        pool = (model, role)
        if pool not in self._commands:
            raise ValueError(f"no worker command for {model!r} ({role})")
        if n < 0:
            raise ValueError(f"cannot run {n} workers")
        tg = self._running()
        staying = [slot for slot in self._slots.values() if slot.pool == pool and not slot.leaving]
        for worker_id in leaving:
            slot = self._slots.get(worker_id)
            if slot is not None and slot in staying:
                staying.remove(slot)
                self._leave(slot, tg)
        # Too many still: those restarting go first, then the newest.
        staying.sort(key=lambda slot: slot.state == "restarting")
        while len(staying) > n:
            self._leave(staying.pop(), tg)
        for _ in range(n - len(staying)):
            tg.start_soon(self._supervise, _Slot(pool))

    def list(self) -> list[ManagedWorker]:
        """Every worker it runs now (those restarting and leaving included)."""
        return [
            ManagedWorker(
                slot.pool[0], slot.pool[1], worker_id, slot.state, slot.restarts, slot.detail
            )
            for worker_id, slot in self._slots.items()
        ]

    # -- one worker, through its restarts

    def _running(self) -> TaskGroup:
        if self._tg is None:
            raise RuntimeError("use the connector inside `async with connector:`")
        return self._tg

    async def _supervise(self, slot: _Slot) -> None:
        model, role = slot.pool
        early_deaths = 0
        worker_id = ""
        try:
            while not slot.leaving:
                worker_id = f"{role}-{secrets.token_hex(4)}"
                self._slots[worker_id] = slot
                slot.state = "running"
                started = time.monotonic()
                outcome = await self._run(slot, worker_id)
                if slot.leaving:
                    logger.info(
                        "planner: worker %s of %r (%s) left: %s", worker_id, model, role, outcome
                    )
                    return
                ran = time.monotonic() - started
                early_deaths = early_deaths + 1 if ran < _LIVED else 1
                delay = min(BACKOFF_FIRST * 2 ** (early_deaths - 1), BACKOFF_MAX)
                slot.restarts += 1
                slot.state = "restarting"
                slot.detail = f"{outcome} after {ran:.1f} s; restarting in {delay:g} s"
                logger.warning(
                    "planner: worker %s of %r (%s) %s after %.1f s: starting another in %g s",
                    worker_id,
                    model,
                    role,
                    outcome,
                    ran,
                    delay,
                )
                self._on_restart(model, role)
                with anyio.move_on_after(delay):
                    await slot.wake.wait()
                del self._slots[worker_id]
        finally:
            self._slots.pop(worker_id, None)

    async def _run(self, slot: _Slot, worker_id: str) -> str:
        """Run one worker process to its end; what ended it."""
        model, role = slot.pool
        command = self._commands[slot.pool].format(
            model=shlex.quote(model),
            role=shlex.quote(role),
            worker_id=worker_id,
            nats=shlex.quote(self._nats),
            drain_timeout=f"{self._drain_timeout:g}",
        )
        slot.exec = _simple(command)
        try:
            process = await anyio.open_process(
                ["/bin/sh", "-c", f"exec {command}" if slot.exec else command],
                stdin=subprocess.DEVNULL,
                stdout=None,
                stderr=None,
                start_new_session=True,
            )
        except OSError as exc:
            return f"could not be started ({exc})"
        slot.process = process
        if slot.leaving:  # (asked to leave while it was being started)
            _terminate(slot, process.pid)
        logger.info(
            "planner: started worker %s of %r (%s), process group %d: %s",
            worker_id,
            model,
            role,
            process.pid,
            command,
        )
        try:
            code = await process.wait()
            if slot.leaving:
                await self._emptied(process.pid)
        except BaseException:  # cancelled: the planner is forced out (a second signal)
            _signal_group(process.pid, signal.SIGKILL)
            raise
        finally:
            slot.process = None
            slot.escalation.cancel()
            with anyio.CancelScope(shield=True):
                await process.aclose()
        return f"exit code {code}" if code >= 0 else f"killed by {signal.Signals(-code).name}"

    def _leave(self, slot: _Slot, tg: TaskGroup) -> None:
        """Take ``slot`` out of its pool: SIGTERM (a drain), SIGKILL if it is still there
        ``drain_timeout`` + 10 s later."""
        if slot.leaving:
            return
        slot.leaving = True
        slot.state = "leaving"
        slot.wake.set()
        if slot.process is not None:
            _terminate(slot, slot.process.pid)
            slot.escalation = anyio.CancelScope()
            tg.start_soon(self._escalate, slot, slot.process.pid)

    async def _escalate(self, slot: _Slot, pid: int) -> None:
        """SIGKILL for a worker that did not leave in time."""
        wait = self._drain_timeout + _GRACE
        with slot.escalation:
            await anyio.sleep(wait)
            if _group_alive(pid):
                logger.warning(
                    "planner: a worker of %r (%s), process group %d, still there %g s after "
                    "SIGTERM: SIGKILL",
                    slot.pool[0],
                    slot.pool[1],
                    pid,
                    wait,
                )
                _signal_group(pid, signal.SIGKILL)

    async def _emptied(self, pgid: int) -> None:
        """Wait until no process of group ``pgid`` is left (the shell ended before its
        worker: it was signalled)."""
        while _group_alive(pgid):  # noqa: ASYNC110 - other processes: no event to wait on
            await anyio.sleep(0.1)

    def __repr__(self) -> str:
        return f"LocalConnector({sorted(self._commands)})"


def _simple(command: str) -> bool:
    """Whether ``command`` is one simple command, which ``exec`` may prefix: no control
    operator or redirection outside quotes, no newline, no leading assignment."""
    if "\n" in command:
        return False
    try:
        words = list(shlex.shlex(command, posix=True, punctuation_chars=True))
    except ValueError:  # unbalanced quotes: let the shell say so
        return False
    if not words or _ASSIGNMENT.match(words[0]):
        return False
    return not any(_OPERATOR.fullmatch(word) for word in words)


def _terminate(slot: _Slot, pid: int) -> None:
    """SIGTERM to the worker (exec'd), or to its shell's whole group."""
    if slot.exec:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    else:
        _signal_group(pid, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, signum: signal.Signals) -> None:
    try:
        os.killpg(pgid, signum)
    except ProcessLookupError:
        pass
