"""Transports: serving engines to other processes, and engines that call them.

- :mod:`pipeline.transports.codec` — how payloads become bytes (:class:`Codec`,
  :class:`MsgpackCodec`, :class:`DataclassCodec`).
- :mod:`pipeline.transports.nats` — NATS: ``serve(engine, ...)`` / ``NatsWorker`` on the
  worker side, ``RemoteEngine`` on the client side, ``NatsDiscovery`` feeding a WorkerSet
  (import it explicitly: it loads nats-py).
- :mod:`pipeline.transports.roles` — the roles a worker serves (needs no extra).

In one process no transport is needed: engines are plain objects. Both modules need the
``nats`` extra (``pip install 'llm-pipeline[nats]'``: nats-py, msgpack and the server
binary). Importing this package needs nothing: the codec names below are loaded when first
used, so ``pipeline.transports.roles`` (which the command line's ``--help`` reads) works on
a bare install.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .codec import Codec as Codec
    from .codec import DataclassCodec as DataclassCodec
    from .codec import MsgpackCodec as MsgpackCodec

__all__ = ("Codec", "DataclassCodec", "MsgpackCodec")


def __getattr__(name: str) -> Any:
    """The codec names, imported from :mod:`.codec` (which needs msgpack) when first used."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.codec"), name)
    globals()[name] = value
    return value
