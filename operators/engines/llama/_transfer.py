"""Moving a prompt's KV cells from a prefill worker to a decode worker, over TCP.

The prefill worker keeps the cells of each prompt it prefilled (:class:`TransferStore`,
bounded in bytes and in time) and serves them from a thread of its own
(:class:`TransferServer`): the decode worker connects to the address in the handle and
asks for the cells from the first position it lacks (:func:`pull`)::

    decode worker                                   prefill worker (TransferServer thread)
    {"op": "pull", "transfer": ID, "start": S, "mac": HMAC(secret, op|ID|S)}\\n  -->
                                 <-- {"ok": true, "start": S, "count": C, "layout": L}\\n
                                 <-- C cells' payload (KvCells.payload: K then V per layer)

Why a direct stream rather than NATS: the cells are megabytes (23 KB a token for SmolLM2)
and go to exactly one peer; a TCP stream has no payload limit to chunk around, costs no
broker hop, and works the same between two in-process engines (``serve --prefill-workers
1``) and two worker processes. Requests are authenticated with the transfer secret (a
handle alone, seen on the wire, does not let anyone else take the cells), every socket
operation has a timeout, and a pull is the end of the cells: they are released once sent,
when the connection breaks mid-way (the request died), when the decode side says it has
no use for them (``release``), or when they expire.

Why a thread and blocking sockets on the serving side: the prefill engine has no event
loop of its own (it may serve an in-process graph or a NATS worker), and sending is a
``sendall`` that releases the GIL.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import anyio

from ._kv_cells import KvCells, KvFormatError

if TYPE_CHECKING:
    from ._kv_cells import KvLayout

__all__ = ("TransferError", "TransferServer", "TransferStore", "pull", "release")

logger = logging.getLogger("operators.engines.llama")

#: seconds a socket operation of the server may take
_SOCKET_TIMEOUT: Final = 10.0
#: the longest request line accepted
_MAX_LINE: Final = 4096


class TransferError(Exception):
    """A pull failed: the prefill worker is gone, refused, or the cells are not whole."""


def _mac(secret: bytes, op: str, transfer_id: str, start: int) -> str:
    message = f"{op}\x1f{transfer_id}\x1f{start}".encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


class _Entry(NamedTuple):
    cells: KvCells
    expires: float


@final
class TransferStore:
    """The cells a prefill worker holds for decode workers, by transfer id.

    Bounded by ``capacity_bytes`` (the oldest go first) and by ``ttl`` seconds each.
    Thread-safe: the scheduler puts, the server's threads take.
    """

    def __init__(self, capacity_bytes: int, ttl: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl = ttl
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
        self._used = 0
        self._lock = threading.Lock()
        #: entries let go of unpulled: expired, crowded out, released
        self.dropped = 0

    def put(self, cells: KvCells) -> tuple[str, float]:
        """Keep ``cells``; their transfer id and expiry (seconds since the epoch)."""
        transfer_id = secrets.token_hex(12)
        expires = time.time() + self.ttl
        with self._lock:
            self._sweep()
            self._entries[transfer_id] = _Entry(cells, expires)
            self._used += cells.nbytes
            while self._used > self.capacity_bytes and len(self._entries) > 1:
                self._evict(next(iter(self._entries)))
        return transfer_id, expires

    def take(self, transfer_id: str) -> KvCells | None:
        """The cells of ``transfer_id``, no longer held (None: unknown or expired)."""
        with self._lock:
            self._sweep()
            entry = self._entries.pop(transfer_id, None)
            if entry is None:
                return None
            self._used -= entry.cells.nbytes
            return entry.cells

    def release(self, transfer_id: str) -> bool:
        """Let go of ``transfer_id``'s cells unpulled; False when not held."""
        with self._lock:
            if transfer_id not in self._entries:
                return False
            self._evict(transfer_id)
            return True

    def __len__(self) -> int:
        with self._lock:
            self._sweep()
            return len(self._entries)

    @property
    def used_bytes(self) -> int:
        return self._used

    def _sweep(self) -> None:
        now = time.time()
        for transfer_id in [key for key, entry in self._entries.items() if entry.expires <= now]:
            self._evict(transfer_id)

    def _evict(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id)
        self._used -= entry.cells.nbytes
        self.dropped += 1


@final
class TransferServer:
    """Serves a :class:`TransferStore`'s cells on ``host:port`` (0: any free port) from
    threads of its own, to clients that know ``secret``; :meth:`close` stops it."""

    def __init__(self, store: TransferStore, secret: bytes, host: str = "127.0.0.1", port: int = 0):
        self.store = store
        self._secret = secret
        self._socket = socket.create_server((host, port))
        self._socket.settimeout(0.5)  # how often the accept loop notices close()
        bound_host, bound_port = self._socket.getsockname()[:2]
        #: where decode workers connect (the handle's ``address``)
        self.address = f"{host or bound_host}:{bound_port}"
        self._closed = threading.Event()
        #: pulls served completely, and the bytes they sent
        self.served = 0
        self.sent_bytes = 0
        self._thread = threading.Thread(target=self._accept, name="llama-kv-transfer", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting (pulls under way finish or time out); blocks until the accept
        loop has ended."""
        self._closed.set()
        self._thread.join()
        self._socket.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                connection, _ = self._socket.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._closed.is_set():
                    return
                continue
            threading.Thread(
                target=self._serve, args=(connection,), name="llama-kv-pull", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            connection.settimeout(_SOCKET_TIMEOUT)
            transfer_id = None
            try:
                request = _read_line(connection)
                op = request.get("op")
                transfer_id = str(request.get("transfer", ""))
                start = int(request.get("start", 0))
                mac = str(request.get("mac", ""))
                if op not in ("pull", "release"):
                    raise ValueError(f"unknown op {op!r}")
                if not hmac.compare_digest(mac, _mac(self._secret, op, transfer_id, start)):
                    _send_line(connection, {"ok": False, "error": "not authenticated"})
                    transfer_id = None  # someone else's: leave the cells alone
                    return
                if op == "release":
                    _send_line(connection, {"ok": self.store.release(transfer_id)})
                    return
                cells = self.store.take(transfer_id)
                if cells is None:
                    _send_line(connection, {"ok": False, "error": "unknown or expired"})
                    return
                if not cells.start <= start < cells.end:
                    _send_line(connection, {"ok": False, "error": f"no cells from {start}"})
                    return
                payload = cells.slice(start, cells.end).payload()
                header = {
                    "ok": True,
                    "start": start,
                    "count": cells.end - start,
                    "bytes": len(payload),
                    "layout": cells.layout.fingerprint,
                }
                _send_line(connection, header)
                connection.sendall(payload)
                self.served += 1
                self.sent_bytes += len(payload)
            except (OSError, ValueError, TypeError) as exc:
                # A broken pull is the request's end: its cells were taken and are gone.
                logger.info("KV transfer %s not served: %r", transfer_id, exc)


def _read_line(connection: socket.socket) -> dict[str, Any]:
    data = b""
    while not data.endswith(b"\n"):
        chunk = connection.recv(_MAX_LINE)
        if not chunk:
            raise ValueError("the connection closed before the request was whole")
        data += chunk
        if len(data) > _MAX_LINE:
            raise ValueError("request line too long")
    request = json.loads(data)
    if not isinstance(request, dict):
        raise ValueError("a request is a JSON object")
    return request


def _send_line(connection: socket.socket, message: dict[str, Any]) -> None:
    connection.sendall(json.dumps(message).encode() + b"\n")


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise TransferError(f"not a host:port address: {address!r}")
    return host.strip("[]"), int(port)


async def pull(
    address: str,
    transfer_id: str,
    start: int,
    *,
    secret: bytes,
    layout: KvLayout,
    within: float,
) -> KvCells:
    """The cells of ``transfer_id`` from position ``start`` on, from the prefill worker at
    ``address``, within ``within`` seconds.

    Raises:
        TransferError: unreachable, refused, too slow, or not cells of ``layout``.
    """
    host, port = _split(address)
    try:
        with anyio.fail_after(within):
            async with await anyio.connect_tcp(host, port) as stream:
                line = {
                    "op": "pull",
                    "transfer": transfer_id,
                    "start": start,
                    "mac": _mac(secret, "pull", transfer_id, start),
                }
                await stream.send(json.dumps(line).encode() + b"\n")
                buffer = bytearray()
                while b"\n" not in buffer:
                    buffer += await stream.receive()
                    if len(buffer) > _MAX_LINE and b"\n" not in buffer:
                        raise TransferError("the answer's header is too long")
                head, _, rest = bytes(buffer).partition(b"\n")
                header = json.loads(head)
                if not header.get("ok"):
                    raise TransferError(f"refused: {header.get('error')}")
                if header["layout"] != layout.fingerprint or header["start"] != start:
                    raise TransferError("the cells are not of this model's layout")
                size = int(header["bytes"])
                payload = bytearray(rest)
                while len(payload) < size:
                    payload += await stream.receive(size - len(payload))
                if len(payload) != size:
                    raise TransferError(f"{len(payload)} bytes for {size}")
    except TimeoutError:
        raise TransferError(f"no cells from {address} within {within:g}s") from None
    except (OSError, anyio.EndOfStream, anyio.BrokenResourceError) as exc:
        raise TransferError(f"{address}: {exc!r}") from None
    except (ValueError, KeyError) as exc:  # JSON, a header without its fields
        raise TransferError(f"{address}: a malformed answer: {exc!r}") from None
    try:
        cells = KvCells.from_payload(layout, start, payload)
    except KvFormatError as exc:
        raise TransferError(str(exc)) from None
    if cells.count != int(header["count"]):
        raise TransferError(f"{cells.count} cells for {header['count']}")
    return cells


async def release(address: str, transfer_id: str, *, secret: bytes, within: float) -> bool:
    """Tell the prefill worker at ``address`` to let go of ``transfer_id`` (best effort:
    False when it could not be told; the cells expire anyway)."""
    try:
        host, port = _split(address)
        with anyio.fail_after(within):
            async with await anyio.connect_tcp(host, port) as stream:
                line = {
                    "op": "release",
                    "transfer": transfer_id,
                    "start": 0,
                    "mac": _mac(secret, "release", transfer_id, 0),
                }
                await stream.send(json.dumps(line).encode() + b"\n")
                answer = await stream.receive()
        return bool(json.loads(answer.partition(b"\n")[0]).get("ok"))
    except (TimeoutError, OSError, anyio.EndOfStream, ValueError, TransferError) as exc:
        logger.debug("KV transfer %s not released: %r", transfer_id, exc)
        return False
