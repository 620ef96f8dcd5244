"""The llama engine's transfer handles: a prefill worker's promise of a prompt's KV cells.

A prefill worker returns its first token with a handle in ``EngineOutput.prefill_result``;
the decode worker it reaches verifies it, pulls the cells it lacks from the handle's
``address`` and continues after ``first_token``. The handle is signed (HMAC-SHA256 of all
its fields, ``--transfer-secret``), so a decode worker refuses one that was forged, altered
or issued for another request or prompt; it carries what the decode worker needs to
continue exactly as the prefill worker would have: the first token, the sampler's random
state after it, and the cells' layout (a worker of another model cannot load them).
"""

from __future__ import annotations

import hmac
import time
from typing import TYPE_CHECKING, Any, Final, NamedTuple

from operators.engines._transfer_handle import digest, sign_all

if TYPE_CHECKING:
    from operators.contracts.llm import PreprocessedRequest

__all__ = ("KIND", "Handle", "expired", "handle_problem", "issue")

#: the ``kind`` of the llama engine's handles
KIND: Final = "llama.kv/1"
_FIELDS: Final = (
    "kind",
    "worker_id",
    "request_id",
    "prompt_tokens",
    "prompt_digest",
    "first_token",
    "address",
    "transfer_id",
    "expires",
    "layout",
    "rng",
    "signature",
)


class Handle(NamedTuple):
    """A verified handle, as the decode side uses it."""

    first_token: int
    #: ``host:port`` of the prefill worker's transfer server
    address: str
    transfer_id: str
    #: when the prefill worker lets go of the cells (seconds since the epoch)
    expires: float
    #: the cells' layout fingerprint (:attr:`._kv_cells.KvLayout.fingerprint`)
    layout: str
    #: the first choice's random generator state after the first token (None: greedy)
    rng: dict[str, Any] | None


def issue(
    secret: bytes,
    *,
    worker_id: str,
    request_id: str,
    token_ids: list[int],
    first_token: int,
    address: str,
    transfer_id: str,
    expires: float,
    layout: str,
    rng: dict[str, Any] | None,
) -> dict[str, Any]:
    """A signed handle for the cells of ``token_ids`` (the prompt of ``request_id``)."""
    handle: dict[str, Any] = {
        "kind": KIND,
        "worker_id": worker_id,
        "request_id": request_id,
        "prompt_tokens": len(token_ids),
        "prompt_digest": digest(token_ids),
        "first_token": first_token,
        "address": address,
        "transfer_id": transfer_id,
        "expires": expires,
        "layout": layout,
        "rng": rng,
    }
    handle["signature"] = sign_all(secret, handle)
    return handle


def handle_problem(
    secret: bytes, request_id: str, request: PreprocessedRequest
) -> tuple[Handle | None, str | None]:
    """``(handle, None)`` when ``request.prefill_result`` is a valid handle issued for this
    request, else ``(None, what is wrong)``."""
    raw = request.prefill_result
    if not isinstance(raw, dict) or any(key not in raw for key in _FIELDS):
        return None, "not a llama transfer handle"
    if not hmac.compare_digest(str(raw["signature"]), sign_all(secret, raw)):
        return None, "bad signature (forged, altered, or issued with another transfer_secret)"
    if raw["kind"] != KIND:
        return None, f"unknown kind {raw['kind']!r}"
    if raw["request_id"] != request_id:
        return None, f"issued for request {raw['request_id']!r}"
    if raw["prompt_tokens"] != len(request.token_ids):
        return None, (
            f"issued for {raw['prompt_tokens']} prompt tokens, "
            f"the request has {len(request.token_ids)}"
        )
    if raw["prompt_digest"] != digest(request.token_ids):
        return None, "issued for another prompt"
    try:
        handle = Handle(
            first_token=int(raw["first_token"]),
            address=str(raw["address"]),
            transfer_id=str(raw["transfer_id"]),
            expires=float(raw["expires"]),
            layout=str(raw["layout"]),
            rng=raw["rng"] if isinstance(raw["rng"], dict) else None,
        )
    except (TypeError, ValueError) as exc:
        return None, f"malformed: {exc}"
    return handle, None


def expired(handle: Handle) -> bool:
    """Whether the prefill worker has let go of the cells by now."""
    return handle.expires <= time.time()
