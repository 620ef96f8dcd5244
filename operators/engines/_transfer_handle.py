"""Transfer handles: what a prefill worker gives a decode worker for a request.

The mocker's stand in for the KV cache a real decode worker would pull; the llama engine's
(``operators.engines.llama._kv_handle``) say where to pull it. Both are signed with HMAC
so that a decode worker can refuse a handle that was forged, or issued for another request
or prompt. Apart from :class:`~operators.engines.mocker.MockerEngine` because it is a
small protocol of its own: what a handle holds and when it is valid.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from operators.contracts.llm import PreprocessedRequest
    from pipeline import Context

__all__ = ("PROCESS_SECRET", "digest", "handle_problem", "issue_handle", "sign", "sign_all")

_HANDLE_KIND: Final = "mocker.kv/1"
#: the key of mockers given no ``transfer_secret``: shared by every mocker in this process
PROCESS_SECRET: Final = secrets.token_bytes(32)
_HANDLE_FIELDS: Final = ("kind", "worker_id", "request_id", "prompt_tokens", "prompt_digest")


def sign(secret: bytes, handle: dict[str, Any]) -> str:
    """The HMAC of a handle's fields: only a holder of ``secret`` can issue one."""
    message = "\x1f".join(str(handle[key]) for key in (*_HANDLE_FIELDS, "first_token"))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def sign_all(secret: bytes, handle: dict[str, Any]) -> str:
    """The HMAC of every field of ``handle`` but its ``signature`` (JSON values)."""
    fields = {key: value for key, value in handle.items() if key != "signature"}
    message = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hmac.new(secret, message.encode(), hashlib.sha256).hexdigest()


def issue_handle(
    secret: bytes, worker_id: str, ctx: Context[PreprocessedRequest], first_token: int
) -> dict[str, Any]:
    """The handle a prefill worker returns for ``ctx`` (its first token included)."""
    token_ids = ctx.data.token_ids
    handle: dict[str, Any] = {
        "kind": _HANDLE_KIND,
        "worker_id": worker_id,
        "request_id": ctx.id,
        "prompt_tokens": len(token_ids),
        "prompt_digest": digest(token_ids),
        "first_token": first_token,
    }
    handle["signature"] = sign(secret, handle)
    return handle


def handle_problem(
    secret: bytes, ctx: Context[PreprocessedRequest], first_token: int
) -> str | None:
    """What is wrong with ``ctx``'s ``prefill_result`` as a handle for it (None: nothing);
    ``first_token`` is the token the handle must carry."""
    request = ctx.data
    handle = request.prefill_result
    problem = None
    if not isinstance(handle, dict) or any(
        key not in handle for key in (*_HANDLE_FIELDS, "first_token", "signature")
    ):
        problem = "not a mocker transfer handle"
    elif not hmac.compare_digest(str(handle["signature"]), sign(secret, handle)):
        problem = "bad signature (forged, or issued with another transfer_secret)"
    elif handle["kind"] != _HANDLE_KIND:
        problem = f"unknown kind {handle['kind']!r}"
    elif handle["request_id"] != ctx.id:
        problem = f"issued for request {handle['request_id']!r}"
    elif handle["prompt_tokens"] != len(request.token_ids):
        problem = (
            f"issued for {handle['prompt_tokens']} prompt tokens, "
            f"the request has {len(request.token_ids)}"
        )
    elif handle["prompt_digest"] != digest(request.token_ids):
        problem = "issued for another prompt"
    elif handle["first_token"] != first_token:
        problem = "its first token does not continue this request's sequence"
    return problem


def digest(token_ids: list[int]) -> str:
    """A short fingerprint of a prompt (also seeds the mocker's "random" tokens)."""
    return hashlib.sha256(" ".join(map(str, token_ids)).encode()).hexdigest()[:16]
