"""KV tiers: where an engine keeps KV blocks its working cache had to let go of.

An engine's working cache (its slots, its GPU memory) is small; a prefix it evicts must be
prefilled again when the conversation comes back, which costs far more than copying the
cells back in. A :class:`KvTier` keeps evicted blocks, each named by the same chained id
as the KV events (``operators.routing.kv_blocks``), as opaque bytes: what the bytes are
(llama.cpp's cells of one block, a GPU page) is the engine's business. Tiers stack: a
:class:`MemoryKvTier` in host RAM hands what it evicts to the tier ``below`` it, e.g. a
:class:`DiskKvTier`.

A tier reports what it holds as KV events with its ``name`` as the ``tier``
(``KvStored`` when a block comes in, ``KvRemoved`` when it goes), unnumbered, through
``on_event``; the engine numbers them with its own, so a
:class:`~pipeline.prefix_index.PrefixIndex` and a :class:`~pipeline.kv_routing.KvRouter`
know which worker can restore a prefix instead of prefilling it.

Both tiers are bounded by size and evict the least recently used block first. Each call
takes a lock, so several threads may share a tier; ``on_event`` is called under it and
must be quick (an engine queues the event).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Final, Protocol, final, runtime_checkable

from .kv_events import BlockId, KvEvent, KvRemoved, KvStored

__all__ = ("DISK_TIER", "HOST_TIER", "DiskKvTier", "KvTier", "MemoryKvTier")

logger = logging.getLogger(__name__)

#: the tier name of host memory, the usual first tier below the device
HOST_TIER: Final = "host"
#: the tier name of local disk
DISK_TIER: Final = "disk"


@runtime_checkable
class KvTier(Protocol):
    """A size-bounded store of KV blocks by block id; the bytes are opaque to it."""

    #: the tier's name in KV events ("host", "disk")
    name: str
    #: receives a ``KvStored``/``KvRemoved`` (``tier=name``) for every block that comes or
    #: goes; None: nobody listens
    on_event: Callable[[KvEvent], None] | None

    def put(self, block_id: BlockId, data: bytes) -> bool:
        """Keep ``data`` as ``block_id`` (a block it holds already is only touched);
        False when it cannot (larger than the whole tier)."""
        ...

    def get(self, block_id: BlockId) -> bytes | None:
        """``block_id``'s bytes, exactly as put (None: not held, or no longer valid)."""
        ...

    def evict(self, block_id: BlockId) -> bool:
        """Drop ``block_id``; False when it was not held."""
        ...

    def __contains__(self, block_id: object) -> bool: ...

    def __len__(self) -> int: ...

    def block_ids(self) -> list[BlockId]:
        """Every block held, least recently used first."""
        ...

    @property
    def used_bytes(self) -> int:
        """Bytes held now."""
        ...

    @property
    def capacity_bytes(self) -> int:
        """Bytes it may hold at most."""
        ...


def _check_capacity(capacity_bytes: int) -> int:
    if capacity_bytes < 0:
        raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
    return capacity_bytes


@final
class MemoryKvTier:
    """A :class:`KvTier` in this process's memory, LRU-evicted at ``capacity_bytes``.

    A block evicted for room goes to ``below`` (say a :class:`DiskKvTier`) when there is
    one; :meth:`evict` drops a block without passing it down.
    """

    def __init__(
        self,
        capacity_bytes: int,
        *,
        name: str = HOST_TIER,
        below: KvTier | None = None,
        on_event: Callable[[KvEvent], None] | None = None,
    ) -> None:
        self.name = name
        self.below = below
        self.on_event = on_event
        self._capacity = _check_capacity(capacity_bytes)
        self._blocks: OrderedDict[BlockId, bytes] = OrderedDict()
        self._used = 0
        self._lock = threading.RLock()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def put(self, block_id: BlockId, data: bytes) -> bool:
        data = bytes(data)
        with self._lock:
            if block_id in self._blocks:
                self._blocks.move_to_end(block_id)
                return True
            if len(data) > self._capacity:
                if self.below is not None:
                    self.below.put(block_id, data)
                return False
            self._blocks[block_id] = data
            self._used += len(data)
            self._report(KvStored((block_id,), tier=self.name))
            while self._used > self._capacity:
                old, old_data = self._blocks.popitem(last=False)
                self._used -= len(old_data)
                self._report(KvRemoved((old,), tier=self.name))
                if self.below is not None:
                    self.below.put(old, old_data)
            return True

    def get(self, block_id: BlockId) -> bytes | None:
        with self._lock:
            data = self._blocks.get(block_id)
            if data is not None:
                self._blocks.move_to_end(block_id)
            return data

    def evict(self, block_id: BlockId) -> bool:
        with self._lock:
            data = self._blocks.pop(block_id, None)
            if data is None:
                return False
            self._used -= len(data)
            self._report(KvRemoved((block_id,), tier=self.name))
            return True

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def block_ids(self) -> list[BlockId]:
        with self._lock:
            return list(self._blocks)

    def _report(self, event: KvEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def __repr__(self) -> str:
        return (
            f"MemoryKvTier({self.name!r}, {len(self._blocks)} blocks, "
            f"{self._used}/{self._capacity} bytes)"
        )


#: a block file: magic, then the key's length and the key, the data's length and its
#: BLAKE2b-128 digest, then the data
_MAGIC: Final = b"LLMPKV01"
_HEADER: Final = struct.Struct("<8sH")
_TRAILER: Final = struct.Struct("<Q16s")
_SUFFIX: Final = ".kv"
_NAMESPACE: Final = re.compile(r"[A-Za-z0-9._-]{1,128}")


def _key(block_id: BlockId) -> str:
    """The file name stem of ``block_id``: reversible, so a restart knows its blocks."""
    if isinstance(block_id, bool) or not isinstance(block_id, int | str):
        raise TypeError(f"DiskKvTier stores blocks named by ints or strs, not {block_id!r}")
    if isinstance(block_id, int):
        return f"i{block_id:x}" if block_id >= 0 else f"n{-block_id:x}"
    raw = block_id.encode()
    if len(raw) > 100:
        raise TypeError(f"a DiskKvTier block id is at most 100 bytes, not {len(raw)}")
    return "s" + raw.hex()


def _block_id(key: str) -> BlockId | None:
    """The block id of file stem ``key`` (None: not one of ours)."""
    try:
        if key[:1] == "i":
            return int(key[1:], 16)
        if key[:1] == "n":
            return -int(key[1:], 16)
        if key[:1] == "s":
            return bytes.fromhex(key[1:]).decode()
    except (ValueError, UnicodeDecodeError):
        pass
    return None


def _digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@final
class DiskKvTier:
    """A :class:`KvTier` in a directory: one file per block, LRU-evicted at ``capacity_bytes``.

    Files live in ``directory/namespace`` (the namespace keeps apart the blocks of models
    or cache layouts that cannot be exchanged: an engine names it after its own). Writes
    are atomic (a temporary file renamed into place), and every file carries its block id,
    length and a BLAKE2b checksum: a file that is truncated, corrupt or not what its name
    says is never returned, but deleted (``KvRemoved``) and reported missing. Blocks
    already in the directory when the tier opens are held (oldest modification first in
    the LRU order); reading a block touches its file, so the order survives a restart.

    One process per directory: a second one would evict the first one's files behind its
    back (which it survives: a missing file is a miss, but the size bound is per process).
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        capacity_bytes: int,
        *,
        name: str = DISK_TIER,
        namespace: str = "default",
        on_event: Callable[[KvEvent], None] | None = None,
    ) -> None:
        if not _NAMESPACE.fullmatch(namespace):
            raise ValueError(f"namespace must match [A-Za-z0-9._-]{{1,128}}, got {namespace!r}")
        self.name = name
        self.on_event = on_event
        self.directory = Path(directory) / namespace
        self._capacity = _check_capacity(capacity_bytes)
        self._files: OrderedDict[BlockId, int] = OrderedDict()  # block -> file size
        self._used = 0
        self._lock = threading.RLock()
        self.directory.mkdir(parents=True, exist_ok=True)
        self._scan()

    @property
    def used_bytes(self) -> int:
        return self._used

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def _path(self, block_id: BlockId) -> Path:
        return self.directory / (_key(block_id) + _SUFFIX)

    def _scan(self) -> None:
        found: list[tuple[float, BlockId, int]] = []
        for entry in os.scandir(self.directory):
            if not entry.is_file():
                continue
            if entry.name.startswith(".tmp-"):  # a write that never finished
                _unlink(Path(entry.path))
                continue
            stem, suffix = os.path.splitext(entry.name)
            block_id = _block_id(stem) if suffix == _SUFFIX else None
            if block_id is None:
                continue
            stat = entry.stat()
            found.append((stat.st_mtime, block_id, stat.st_size))
        for _, block_id, size in sorted(found, key=lambda item: item[0]):
            self._files[block_id] = size
            self._used += size
        self._shrink()

    def put(self, block_id: BlockId, data: bytes) -> bool:
        key = _key(block_id).encode()
        size = _HEADER.size + len(key) + _TRAILER.size + len(data)
        with self._lock:
            if block_id in self._files:
                self._files.move_to_end(block_id)
                return True
            if size > self._capacity:
                return False
            path = self._path(block_id)
            temporary = self.directory / f".tmp-{path.name}-{os.getpid()}-{threading.get_ident()}"
            try:
                with open(temporary, "wb") as file:
                    file.write(_HEADER.pack(_MAGIC, len(key)))
                    file.write(key)
                    file.write(_TRAILER.pack(len(data), _digest(data)))
                    file.write(data)
                os.replace(temporary, path)
            except OSError as exc:  # a full disk, a directory gone: the block is not kept
                logger.warning("KV disk tier %s: cannot write %s: %s", self.directory, path, exc)
                _unlink(temporary)
                return False
            self._files[block_id] = size
            self._used += size
            self._report(KvStored((block_id,), tier=self.name))
            self._shrink()
            return True

    def get(self, block_id: BlockId) -> bytes | None:
        with self._lock:
            if block_id not in self._files:
                return None
            path = self._path(block_id)
            data = self._read(path, _key(block_id).encode())
            if data is None:
                self._drop(block_id, path)
                return None
            self._files.move_to_end(block_id)
            try:
                os.utime(path)  # the LRU order survives a restart
            except OSError:
                pass
            return data

    @staticmethod
    def _read(path: Path, key: bytes) -> bytes | None:
        """The data of the block file at ``path`` if it is whole and named ``key``."""
        try:
            raw = path.read_bytes()
        except OSError as exc:
            logger.warning("KV disk tier: %s is unreadable (%s): dropped", path, exc)
            return None
        problem = None
        start = _HEADER.size + len(key) + _TRAILER.size
        if len(raw) < start:
            problem = "truncated header"
        else:
            magic, key_length = _HEADER.unpack_from(raw)
            length, digest = _TRAILER.unpack_from(raw, _HEADER.size + len(key))
            data = raw[start:]
            if magic != _MAGIC or key_length != len(key):
                problem = "not a KV block file"
            elif raw[_HEADER.size : _HEADER.size + len(key)] != key:
                problem = "holds another block"
            elif length != len(data):
                problem = f"truncated ({len(data)} of {length} bytes)"
            elif _digest(data) != digest:
                problem = "checksum mismatch"
            else:
                return data
        logger.warning("KV disk tier: %s is invalid (%s): deleted, not loaded", path, problem)
        return None

    def evict(self, block_id: BlockId) -> bool:
        with self._lock:
            if block_id not in self._files:
                return False
            self._drop(block_id, self._path(block_id))
            return True

    def _drop(self, block_id: BlockId, path: Path) -> None:
        self._used -= self._files.pop(block_id)
        _unlink(path)
        self._report(KvRemoved((block_id,), tier=self.name))

    def _shrink(self) -> None:
        while self._used > self._capacity and self._files:
            oldest = next(iter(self._files))
            self._drop(oldest, self._path(oldest))

    def __contains__(self, block_id: object) -> bool:
        return block_id in self._files

    def __len__(self) -> int:
        return len(self._files)

    def block_ids(self) -> list[BlockId]:
        with self._lock:
            return list(self._files)

    def _report(self, event: KvEvent) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def __repr__(self) -> str:
        return (
            f"DiskKvTier({self.name!r}, {str(self.directory)!r}, {len(self._files)} blocks, "
            f"{self._used}/{self._capacity} bytes)"
        )


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("KV disk tier: cannot delete %s: %s", path, exc)
