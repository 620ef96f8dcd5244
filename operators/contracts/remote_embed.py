"""Embeddings over NATS: a worker answers ``embed`` calls (:func:`serve_embeddings`), a
frontend makes them (:class:`RemoteEmbedder`).

Generation streams; an embedding is one question and one answer, so it is plain NATS
request/reply on its own subject, ``{namespace}.embed.{model}``, in a queue group: NATS
hands each call to one of the model's workers whose engine embeds (a worker whose engine
has no ``embed`` does not subscribe). The request is ``{"inputs": [[token ids], ...]}``
(msgpack); the answer ``{"vectors": [float32 little-endian bytes, ...]}`` or ``{"error":
class name, "message", "param"}``, and the error comes back as the same
:mod:`pipeline.errors` class (an ``InvalidRequest`` naming ``input.<i>`` stays a 400).

A frontend with no embedding worker to ask gets "no responders": a 400 naming ``model``
when the model has workers (none of them embeds), a 503 while it has none at all.
"""

from __future__ import annotations

import logging
import re
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, final

import msgpack
import nats.errors

from pipeline import CapacityExhausted, EngineError, InvalidRequest, WorkerLost
from pipeline.transports.nats import DEFAULT_NAMESPACE

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription

    from pipeline import WorkerSet

    from .llm import Embedder

__all__ = ("EMBED_TIMEOUT", "RemoteEmbedder", "embed_subject", "serve_embeddings")

logger = logging.getLogger(__name__)

#: seconds a frontend waits for a worker's embeddings
EMBED_TIMEOUT: Final = 60.0
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9_-]")


def embed_subject(model: str, namespace: str = DEFAULT_NAMESPACE) -> str:
    """The subject ``model``'s embedding calls go to (the name escaped into one token)."""
    token = _UNSAFE.sub(lambda match: f"={ord(match.group()):x}=", model)
    return f"{namespace}.embed.{token}"


def _pack_vector(vector: Sequence[float]) -> bytes:
    return struct.pack(f"<{len(vector)}f", *vector)


def _unpack_vector(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


async def serve_embeddings(nc: Client, engine: Embedder, *, model: str) -> Subscription:
    """Answer ``model``'s embedding calls with ``engine.embed`` until the subscription
    (or the connection) is closed."""

    async def answer(msg: Msg) -> None:
        reply: dict[str, Any]
        try:
            request = msgpack.unpackb(msg.data)
            vectors = await engine.embed(request["inputs"])
            reply = {"vectors": [_pack_vector(vector) for vector in vectors]}
        except InvalidRequest as exc:
            reply = {"error": "InvalidRequest", "message": exc.message, "param": exc.param}
        except Exception as exc:  # the engine failed: the frontend says so as a 500
            logger.warning("embed for %s failed: %r", model, exc)
            reply = {"error": type(exc).__name__, "message": str(exc)}
        await msg.respond(msgpack.packb(reply))

    return await nc.subscribe(embed_subject(model), queue="embed", cb=answer)


@final
class RemoteEmbedder:
    """An :class:`~.llm.Embedder` that asks ``model``'s workers over NATS; ``workers``
    (the frontend's discovered set) tells "no worker embeds" from "no worker yet"."""

    __slots__ = ("_model", "_nc", "_subject", "_workers", "timeout")

    def __init__(
        self,
        nc: Client,
        *,
        model: str,
        workers: WorkerSet[Any, Any] | None = None,
        timeout: float = EMBED_TIMEOUT,
    ) -> None:
        self._nc = nc
        self._model = model
        self._subject = embed_subject(model)
        self._workers = workers
        self.timeout = timeout

    async def embed(self, token_ids: Sequence[Sequence[int]], /) -> list[list[float]]:
        """The vectors a worker computed.

        Raises:
            InvalidRequest: an input the worker refused, inputs too large for one NATS
                message, or a model whose workers do not embed (``param: model``).
            CapacityExhausted: no worker of the model is registered.
            WorkerLost: the worker did not answer in time.
            EngineError: the worker's engine failed.
        """
        payload = msgpack.packb({"inputs": [list(tokens) for tokens in token_ids]})
        try:
            msg = await self._nc.request(self._subject, payload, timeout=self.timeout)
        except nats.errors.NoRespondersError:
            if self._workers is not None and len(self._workers) == 0:
                raise CapacityExhausted(
                    f"no worker of model {self._model!r} is registered"
                ) from None
            raise InvalidRequest(
                f"no worker of model {self._model!r} serves embeddings (their engines have "
                "no embed)",
                param="model",
            ) from None
        except nats.errors.MaxPayloadError:
            raise InvalidRequest(
                "the inputs are too large for one message to a worker: send fewer at once",
                param="input",
            ) from None
        except nats.errors.TimeoutError:
            raise WorkerLost(
                f"no embeddings from a worker of {self._model!r} within {self.timeout:g} s"
            ) from None
        reply = msgpack.unpackb(msg.data)
        error = reply.get("error")
        if error == "InvalidRequest":
            raise InvalidRequest(reply["message"], param=reply.get("param"))
        if error is not None:
            raise EngineError(f"the worker's engine failed: {error}: {reply.get('message')}")
        return [_unpack_vector(vector) for vector in reply["vectors"]]

    def __repr__(self) -> str:
        return f"RemoteEmbedder({self._model!r})"
