"""Transports: serving engines to other processes, and engines that call them.

- :mod:`pipeline.transports.codec` — how payloads become bytes (:class:`Codec`,
  :class:`MsgpackCodec`, :class:`DataclassCodec`).
- :mod:`pipeline.transports.nats` — NATS: ``serve(engine, ...)`` / ``NatsWorker`` on the
  worker side, ``RemoteEngine`` on the client side, ``NatsDiscovery`` feeding a WorkerSet
  (import it explicitly: it loads nats-py).

In one process no transport is needed: engines are plain objects. Both modules need the
``nats`` extra (``pip install llm-pipeline[nats]``: nats-py, msgpack and the server binary).
"""

from __future__ import annotations

from .codec import Codec as Codec
from .codec import DataclassCodec as DataclassCodec
from .codec import MsgpackCodec as MsgpackCodec

__all__ = ("Codec", "DataclassCodec", "MsgpackCodec")
