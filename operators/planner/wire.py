"""What the planner and the frontends say to each other over NATS: subjects and messages.

``ns`` is the NATS transport's namespace (``llm-pipeline``)::

    {ns}.planner.latency   frontend -> planner, every few seconds while it measures:
                           {"frontend": ID, "models": {MODEL: {"ttft": [BUCKET, ...],
                                                               "itl": [BUCKET, ...]}}}
                           BUCKET = [lower bound, upper bound (null: +Inf), count]: what
                           each histogram bucket gained since the last message
    {ns}.planner.status    planner -> frontends, after every decision round: the planner's
                           status document (targets, workers, last decisions), for the
                           status page

JSON (orjson), because both are small and rare, and a person reading the bus with ``nats
sub`` can read them. A worker's load goes on its KV events subject instead
(:class:`pipeline.transports.nats.NatsLoadPublisher`), and a drain on its control subject
(:func:`pipeline.transports.nats.drain_worker`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import orjson

__all__ = (
    "Bucket",
    "KINDS",
    "Summary",
    "decode_summary",
    "encode_summary",
    "latency_subject",
    "status_subject",
)

#: the latencies a summary carries: time to first token, inter-token latency
KINDS: Final = ("ttft", "itl")

Bucket = tuple[float, float | None, int]
"""(lower bound, upper bound or None for +Inf, observations gained), in seconds."""

Summary = Mapping[str, Mapping[str, Sequence[Bucket]]]
"""Model -> kind (``ttft``, ``itl``) -> buckets."""


def latency_subject(namespace: str) -> str:
    """Where frontends publish their latency summaries."""
    return f"{namespace}.planner.latency"


def status_subject(namespace: str) -> str:
    """Where the planner publishes its status document."""
    return f"{namespace}.planner.status"


def encode_summary(frontend: str, summary: Summary) -> bytes:
    """A latency summary message."""
    return orjson.dumps({"frontend": frontend, "models": summary})


def decode_summary(data: bytes) -> dict[str, dict[str, list[Bucket]]]:
    """The summary in a message (kinds other than :data:`KINDS` dropped).

    Raises:
        ValueError: not a summary (malformed JSON, a bucket that is not three numbers, a
            negative count).
    """
    try:
        body: Any = orjson.loads(data)
        models = body["models"]
        found: dict[str, dict[str, list[Bucket]]] = {}
        for model, kinds in models.items():
            found[str(model)] = {
                kind: [_bucket(bucket) for bucket in kinds[kind]] for kind in KINDS if kind in kinds
            }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"not a latency summary: {exc!r}") from exc
    return found


def _bucket(raw: Any) -> Bucket:
    lower, upper, count = raw
    bucket = (float(lower), None if upper is None else float(upper), int(count))
    if count < 0:
        raise TypeError(f"a negative count in {raw!r}")
    return bucket
