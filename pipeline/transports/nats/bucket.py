"""The discovery bucket: opened (created when missing), and what says it cannot be used.

Workers register in a JetStream KV bucket (:mod:`.registration`); discovery
(:class:`~.discovery.NatsDiscovery`, one model's workers) and :class:`~.models.NatsModels`
(every model's names) follow it with :func:`.watch.watch_bucket`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final

import nats.errors
import nats.js.errors
from nats.js.api import KeyValueConfig

from .bus import bus_of

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.js import JetStreamContext
    from nats.js.kv import KeyValue

__all__ = (
    "DEFAULT_BUCKET",
    "MARKER_TTL",
    "JetStreamUnavailable",
    "jetstream_unavailable",
    "open_bucket",
)

#: the JetStream KV bucket workers register in
DEFAULT_BUCKET: Final = "llm-pipeline-workers"
#: how long the server keeps the marker of an expired key (what tells watchers of a death)
MARKER_TTL: Final = 60.0


class JetStreamUnavailable(RuntimeError):
    """Discovery's JetStream KV bucket cannot be used: the server has no JetStream, or this
    connection may not create, read or write the bucket. A mistake in the deployment, said
    once at start (the message names the bucket and what the server answered)."""


def jetstream_unavailable(
    what: str, bucket: str, exc: BaseException, nc: Client | None = None
) -> JetStreamUnavailable:
    """The error for ``exc`` while doing ``what`` with ``bucket``, with the server's last
    complaint on ``nc`` (a permissions violation is reported apart from the request it
    made fail, which only times out)."""
    if isinstance(exc, JetStreamUnavailable):
        return exc
    reason = str(exc) or type(exc).__name__
    told = bus_of(nc).last_error if nc is not None else None
    if told is not None:
        reason += f"; the server said: {told}"
    return JetStreamUnavailable(
        f"cannot {what} the JetStream KV bucket {bucket!r} (workers register there): {reason}"
    )


async def open_bucket(
    js: JetStreamContext, bucket: str = DEFAULT_BUCKET, *, nc: Client | None = None
) -> KeyValue:
    """The workers' KV bucket, created when missing (per-key TTLs and expiry markers on).

    Raises:
        JetStreamUnavailable: when the server has no JetStream, or the bucket cannot be
            opened or created (permissions; JetStream's own timeout bounds the wait).
    """
    try:
        try:
            return await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            pass
        config = KeyValueConfig(bucket=bucket, history=1, limit_marker_ttl=MARKER_TTL)
        try:
            return await js.create_key_value(config)
        except nats.js.errors.APIError:
            return await js.key_value(bucket)  # another process created it first
    except nats.js.errors.ServiceUnavailableError as exc:
        raise JetStreamUnavailable(
            "the NATS server has no JetStream, which discovery needs: start nats-server "
            "with -js (from Python, NatsWorker(register=False) serves without discovery)"
        ) from exc
    except (nats.errors.Error, OSError) as exc:
        raise jetstream_unavailable("open", bucket, exc, nc) from exc
