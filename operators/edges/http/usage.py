"""What each key used, by model: ``GET /v1/usage``, read off the :class:`~.ledger.UsageLedger`.

Every request that reached admission is counted when it ends, under its key's *name*
(never the key) and the model it ran on: its status, and its prompt, cached and output
tokens as its response's ``usage`` said them. The same counts go to Prometheus
(``llm_pipeline_key_tokens_total{key,model,kind}``, ``llm_pipeline_key_requests_total
{key,model,status}``, kept by :class:`~.metrics.ServerMetrics`), to the JSON request log
(its ``key`` field), and here, per minute for a day, for ``/v1/usage``::

    GET /v1/usage?key=NAME&since=2026-01-02T03:04:05Z      (since: RFC 3339 or Unix seconds)

    {"object": "usage", "since": "2026-01-02T03:04:00Z", "until": "2026-01-02T04:00:00Z",
     "data": [{"key": "team-a", "model": "smollm2", "requests": 12,
               "statuses": {"200": 11, "429": 1}, "prompt_tokens": 340,
               "cached_tokens": 128, "output_tokens": 512, "total_tokens": 852}]}

``since`` counts from the start of its minute, and from a day ago at the earliest (the
answer's ``since`` says from when it counted); left out, the whole day kept. An admin key
reads every key (``key`` names one); another key reads its own usage only, and naming
any other key is a 403 whether that key exists or not. The counts are this frontend's:
with several frontends, sum their answers or their ``/metrics``.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Collection
from typing import TYPE_CHECKING, Final
from urllib.parse import parse_qs

from .asgi import send_json
from .failures import ApiError, Refusal
from .routes import Call, Route

if TYPE_CHECKING:
    from .failures import ErrorStyle
    from .ledger import UsageLedger

__all__ = ("USAGE", "parse_since", "usage_routes")

USAGE: Final = "/v1/usage"
#: the latest ``since`` accepted (Unix seconds; a larger number is no moment of this era)
_LATEST: Final = 1e11


def parse_since(text: str) -> float:
    """A ``since`` parameter: RFC 3339 (``2026-01-02T03:04:05Z``, an offset, a fraction) or
    Unix seconds, as Unix seconds.

    Raises:
        Refusal: 400 naming ``since`` for anything else, or a moment before 1970 or past
            the year 5000.
    """
    value: float | None = None
    try:
        value = float(text)
    except ValueError:
        try:
            moment = datetime.datetime.fromisoformat(text.strip())
        except ValueError:
            value = None
        else:
            if moment.tzinfo is None:
                raise _bad_since(f"{text!r} has no time zone (add Z for UTC)") from None
            value = moment.timestamp()
    if value is None:
        raise _bad_since(f"{text[:64]!r} is neither RFC 3339 nor Unix seconds")
    if not math.isfinite(value) or not 0 <= value <= _LATEST:
        raise _bad_since(f"{text[:64]!r} is no moment between 1970 and the year 5000")
    return value


def _bad_since(message: str) -> Refusal:
    return Refusal(ApiError("invalid_request", f"since: {message}", param="since"))


def usage_routes(ledger: UsageLedger, errors: ErrorStyle) -> list[Route]:
    """``GET /v1/usage`` over ``ledger``, refusing in ``errors``' words."""

    async def usage(call: Call) -> int:
        try:
            since, keys = _query(call)
        except Refusal as exc:
            rendered = errors.render(exc.error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status
        await send_json(call.send, 200, ledger.report(since, keys))
        return 200

    return [Route(USAGE, frozenset({"GET"}), usage, errors)]


def _query(call: Call) -> tuple[float | None, Collection[str] | None]:
    """(since, the keys to count: None for all) of a ``/v1/usage`` call.

    Raises:
        Refusal: a malformed query (400), or another key's usage asked by a key that is
            not an admin's (403).
    """
    try:
        query: dict[str, list[str]] = parse_qs(
            call.query.decode("latin-1"), keep_blank_values=True, strict_parsing=False
        )
    except ValueError:  # (too many fields)
        raise Refusal(ApiError("invalid_request", "the query string is malformed")) from None
    unknown = sorted(set(query) - {"key", "since"})
    if unknown:
        raise Refusal(
            ApiError(
                "invalid_request",
                f"unknown query parameter {unknown[0][:64]!r} (the parameters are key, since)",
                param=unknown[0][:64],
            )
        )
    for name, values in query.items():
        if len(values) > 1:
            raise Refusal(
                ApiError(
                    "invalid_request", f"give {name} once, not {len(values)} times", param=name
                )
            )
    since = parse_since(query["since"][0]) if "since" in query else None
    tenant = call.tenant
    asked = query["key"][0] if "key" in query else None
    if tenant.admin:
        return since, None if asked is None else (asked,)
    if asked is not None and asked != tenant.name:
        raise Refusal(
            ApiError(
                "forbidden",
                "this key may read its own usage only (an admin key reads every key's)",
                param="key",
                code="permission_denied",
            )
        )
    return since, (tenant.name,)
