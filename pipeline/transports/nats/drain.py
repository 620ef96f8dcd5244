"""Asking a worker to drain from another process: :func:`drain_worker`.

A planner that scales a pool down picks the worker to go and tells it so on its control
subject (``[DRAIN]``, :mod:`.wire`); the worker then does what SIGTERM makes it do: it
leaves discovery at once, lets its in-flight streams finish for up to its drain timeout,
cuts off the rest with an ERR frame (so Migration continues them on another worker), and
its process exits. Over NATS rather than by a signal because the planner need not own the
worker's process (a pod, a process on another machine); a drain, never a kill, because a
kill loses what the worker was serving.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import nats.errors

from . import wire
from .wire import DEFAULT_NAMESPACE, control_codec

if TYPE_CHECKING:
    from nats.aio.client import Client

__all__ = ("drain_worker",)


async def drain_worker(
    nc: Client, worker_id: str, *, namespace: str = DEFAULT_NAMESPACE, within: float = 2.0
) -> bool:
    """Tell ``worker_id`` to drain; True once it acknowledged, False when it is not there
    (nobody on its control subject) or did not answer within ``within`` seconds.

    Raises:
        ValueError: ``worker_id`` is not a subject token (``[A-Za-z0-9_-]+``).
    """
    subject = wire.Subjects(namespace).control(wire.check_token("worker_id", worker_id))
    try:
        reply = await nc.request(subject, control_codec.encode([wire.DRAIN]), timeout=within)
    except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
        return False
    return reply.data == wire.KNOWN
