"""What each key used, by model: :class:`UsageLedger`, and ``GET /v1/usage``.

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
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, final
from urllib.parse import parse_qs

import orjson

from .asgi import send_json
from .failures import ApiError, Refusal
from .routes import Call, Route

if TYPE_CHECKING:
    from .failures import ErrorStyle

__all__ = ("RETENTION", "USAGE", "Tally", "UsageLedger", "parse_since", "usage_routes")

USAGE: Final = "/v1/usage"
#: how long the per-minute counts are kept (seconds)
RETENTION: Final = 24 * 3600.0
#: the latest ``since`` accepted (Unix seconds; a larger number is no moment of this era)
_LATEST: Final = 1e11


@dataclass(slots=True)
class Tally:
    """One key's use of one model over some minutes."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    statuses: dict[int, int] = field(default_factory=dict)

    def add(self, other: Tally) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.cached_tokens += other.cached_tokens
        self.output_tokens += other.output_tokens
        for status, count in other.statuses.items():
            self.statuses[status] = self.statuses.get(status, 0) + count


@final
class UsageLedger:
    """Each key's use, by model and minute, for ``retention`` seconds (``clock``: the wall
    clock's seconds)."""

    __slots__ = ("_clock", "_minutes", "retention")

    def __init__(self, *, retention: float = RETENTION, clock: Callable[[], float] = time.time):
        self.retention = retention
        self._clock = clock
        #: (minute, {(key, model): tally}), oldest first
        self._minutes: deque[tuple[int, dict[tuple[str, str], Tally]]] = deque()

    def record(
        self,
        key: str,
        model: str,
        *,
        status: int,
        prompt: int = 0,
        cached: int = 0,
        output: int = 0,
    ) -> None:
        """Count one request of ``key`` on ``model`` that ended with ``status``."""
        minute = int(self._clock() // 60)
        minutes = self._minutes
        if not minutes or minutes[-1][0] != minute:
            minutes.append((minute, {}))
            oldest = minute - math.ceil(self.retention / 60)
            while minutes and minutes[0][0] < oldest:
                minutes.popleft()
        tallies = minutes[-1][1]
        tally = tallies.get((key, model))
        if tally is None:
            tally = tallies[key, model] = Tally()
        tally.requests += 1
        tally.prompt_tokens += prompt
        tally.cached_tokens += cached
        tally.output_tokens += output
        tally.statuses[status] = tally.statuses.get(status, 0) + 1

    def totals(
        self, since: float | None = None, keys: Collection[str] | None = None
    ) -> tuple[float, dict[tuple[str, str], Tally]]:
        """(the moment counted from, each (key, model)'s tally since then) for ``keys``
        (None: every key). ``since`` counts from the start of its minute, and from the
        retention's start at the earliest."""
        now = self._clock()
        earliest = (math.floor((now - self.retention) / 60) + 1) * 60
        start = earliest if since is None else max(earliest, math.floor(since / 60) * 60)
        first = int(start // 60)
        found: dict[tuple[str, str], Tally] = {}
        for minute, tallies in self._minutes:
            if minute < first:
                continue
            for (key, model), tally in tallies.items():
                if keys is not None and key not in keys:
                    continue
                total = found.get((key, model))
                if total is None:
                    total = found[key, model] = Tally()
                total.add(tally)
        return start, found

    def report(self, since: float | None = None, keys: Collection[str] | None = None) -> bytes:
        """``/v1/usage``'s answer (see the module's docstring)."""
        start, found = self.totals(since, keys)
        data = [
            {
                "key": key,
                "model": model,
                "requests": tally.requests,
                "statuses": {str(s): n for s, n in sorted(tally.statuses.items())},
                "prompt_tokens": tally.prompt_tokens,
                "cached_tokens": tally.cached_tokens,
                "output_tokens": tally.output_tokens,
                "total_tokens": tally.prompt_tokens + tally.output_tokens,
            }
            for (key, model), tally in sorted(found.items())
        ]
        return orjson.dumps(
            {"object": "usage", "since": _iso(start), "until": _iso(self._clock()), "data": data}
        )


def _iso(seconds: float) -> str:
    moment = datetime.datetime.fromtimestamp(int(seconds), tz=datetime.UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


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
