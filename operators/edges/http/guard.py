"""Who may call the server, how many generations run at once, and how long each may take.

:class:`Guard` holds the three protections the app applies before a request reaches the
graph, whichever edge it came through:

* **API keys.** With keys configured, every guarded path (``/v1/*``, ``/tokenize``...)
  needs one of them, as ``Authorization: Bearer KEY`` (OpenAI's clients) or ``x-api-key:
  KEY`` (Anthropic's); anything else is a 401 in the edge's own words. Each key is a
  :class:`~.tenants.Tenant` (``--api-keys FILE``, or plain ``--api-key`` flags): a name,
  a default priority, limits, the models it may use, whether it is an admin's. A key is
  found by its digest (:mod:`.tenants` says why that is safe). ``/health`` and
  ``/metrics`` stay open: load balancers and Prometheus probe them without credentials,
  and they carry no model output. What a key may see of stored state is scoped by
  :meth:`Guard.owner`: a digest of the key, never the key. An *admin* key may also see
  every key's requests in the status view and every key's usage (others their own only).
  The keys can be replaced while serving (:meth:`Guard.reload`, on SIGHUP).
* **Limits.** A key's requests and tokens per minute and requests in flight are kept in
  :attr:`Guard.budgets` (this process's, or every frontend's over NATS) and enforced by
  :mod:`.admission` before any work.
* **Origins.** Browsers let any web page send a "simple" request (a form, ``text/plain``)
  to any server, a local one too; JSON routes refuse those bodies (415), so only a request
  the browser asked the server about first (CORS) gets through, and CORS is off unless
  ``allowed_origins`` names the pages that may call (``*``: any).
* **Admission.** With ``max_inflight``, a generation request arriving while that many are
  in flight waits, fair-queued by key (:mod:`.fair_queue`), if fewer than ``max_queued``
  wait already; otherwise it is refused at once (OpenAI: 503 with ``Retry-After``;
  Anthropic: 529): an overloaded server answers "later" instead of queueing without bound.
* **Priorities.** A key may carry a default scheduling priority (``--api-key KEY:PRIORITY``;
  lower runs earlier, vLLM's convention): a generation request that sets no ``priority`` of
  its own gets its key's (0 without one). The engine and the routers admit waiting requests
  by priority, then arrival.
* **Deadlines.** With ``request_timeout``, a generation request is killed down to the
  engine once it has run that long, and ends with a timeout error. A client may ask for
  less: the official OpenAI SDKs send their own timeout as ``X-Stainless-Read-Timeout``
  (seconds), and a non-streamed request's deadline is the smaller of the two. (For a
  stream that header is the longest *gap* between chunks the client waits for, not a
  limit on the whole answer, so it does not set the deadline.)

The key is never logged: only whether a request carried one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, Final, final

from .budgets import LocalBudgets
from .tenants import ANONYMOUS, Tenant, Tenants

if TYPE_CHECKING:
    from .budgets import Budgets

__all__ = ("CLIENT_TIMEOUT_HEADER", "Guard")

#: the header through which OpenAI's SDKs tell the server their own timeout, in seconds
CLIENT_TIMEOUT_HEADER: Final = b"x-stainless-read-timeout"
_BEARER: Final = b"bearer "
#: what an owner digest is salted with (so it is no plain hash of the key)
_OWNER_SALT: Final = b"llm-pipeline owner:"


@final
class Guard:
    """The server's protections; each is off unless configured.

    Args:
        api_keys: the keys that may call ``/v1/*`` (none: no authentication); a mapping
            gives each key its default priority.
        max_inflight: most generation requests in flight; more wait or get 503 (None: no
            limit).
        request_timeout: seconds a generation request may run (None: no limit).
        admin_keys: keys that may also see every key's requests (``/status``) and usage;
            each is an API key too.
        allowed_origins: the web origins (``https://app.example``) whose pages may call
            the server from a browser (CORS); ``*`` any; none: CORS is off.
        tenants: more keys, each with its terms (``--api-keys FILE``:
            :func:`~.tenants.load_tenants`); :meth:`reload` replaces them.
        max_queued: generation requests that may wait for one of ``max_inflight``'s slots
            (0: none; a request finding them all taken is refused at once).
        budgets: where each key's use of its limits is kept (this process's by default).

    Raises:
        ValueError: an empty key, a key given twice, a ``max_inflight`` below 1, a timeout
            not above 0, a negative ``max_queued``.
    """

    __slots__ = (
        "_fixed",
        "_origins",
        "_tenants",
        "budgets",
        "max_inflight",
        "max_queued",
        "request_timeout",
    )

    def __init__(
        self,
        *,
        api_keys: Iterable[str] | Mapping[str, int] = (),
        max_inflight: int | None = None,
        request_timeout: float | None = None,
        admin_keys: Iterable[str] = (),
        allowed_origins: Iterable[str] = (),
        tenants: Tenants | None = None,
        max_queued: int = 0,
        budgets: Budgets | None = None,
    ) -> None:
        if max_inflight is not None and max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if request_timeout is not None and not request_timeout > 0:
            raise ValueError(f"request_timeout must be > 0, got {request_timeout}")
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self._fixed = Tenants.of_keys(api_keys, admin_keys)
        self._tenants = self._fixed if tenants is None else self._fixed + tenants
        self._origins = frozenset(origin.rstrip("/").encode() for origin in allowed_origins)
        self.max_inflight = max_inflight
        self.max_queued = max_queued
        self.request_timeout = request_timeout
        #: each key's use of its limits
        self.budgets: Budgets = budgets if budgets is not None else LocalBudgets()

    @property
    def tenants(self) -> Tenants:
        """Every key the server accepts, with its terms."""
        return self._tenants

    def reload(self, tenants: Tenants) -> None:
        """Accept ``tenants`` instead of the ones given before (the keys of ``api_keys``
        and ``admin_keys`` stay). Requests already admitted run on under their old terms.

        Raises:
            ValueError: a key or a name of ``tenants`` is one of the fixed keys' (the old
                ones are kept).
        """
        self._tenants = self._fixed + tenants

    @property
    def requires_key(self) -> bool:
        """Whether ``/v1/*`` requests need an API key."""
        return bool(self._tenants)

    def identify(self, scope: MutableMapping[str, Any]) -> tuple[Tenant | None, bool]:
        """(the request's tenant, or None when it may not proceed; whether it presented a
        key at all). Without keys every request is :data:`~.tenants.ANONYMOUS`."""
        tenants = self._tenants
        if not tenants:
            return ANONYMOUS, False
        presented = _presented_key(scope)
        if presented is None:
            return None, False
        return tenants.find(presented), True

    def check_key(self, scope: MutableMapping[str, Any]) -> tuple[bool, bool]:
        """(whether the request may proceed, whether it presented a key at all)."""
        tenant, presented = self.identify(scope)
        return tenant is not None, presented

    def is_admin(self, scope: MutableMapping[str, Any]) -> bool:
        """Whether the request holds an admin key; True for every request of a server
        without keys (all clients are one)."""
        tenant = self.identify(scope)[0]
        return tenant is not None and tenant.admin

    @property
    def cors(self) -> bool:
        """Whether any web origin may call the server from a browser."""
        return bool(self._origins)

    def origin_allowed(self, origin: bytes) -> bool:
        """Whether pages of ``origin`` (an ``Origin`` header) may call the server."""
        return b"*" in self._origins or origin.rstrip(b"/") in self._origins

    def priority_for(self, scope: MutableMapping[str, Any]) -> int:
        """The default priority of the request's API key (0: no keys, or a key without
        one)."""
        tenant = self.identify(scope)[0]
        return 0 if tenant is None else tenant.priority

    def owner(self, scope: MutableMapping[str, Any]) -> str:
        """Who a request acts for, as stored state is scoped: a digest of its API key
        (which :meth:`check_key` let through), or "" when the server has no keys (every
        client is the same one). The same on every frontend configured with that key."""
        if not self._tenants:
            return ""
        presented = _presented_key(scope) or b""
        return hashlib.sha256(_OWNER_SALT + presented).hexdigest()[:32]

    def timeout_for(self, scope: MutableMapping[str, Any], *, stream: bool) -> float | None:
        """Seconds the request may run: the server's limit, or for a non-streamed request
        the client's when that is smaller."""
        limit = self.request_timeout
        asked = None if stream else _client_timeout(scope)
        if asked is None:
            return limit
        return asked if limit is None else min(limit, asked)

    def __repr__(self) -> str:  # never the keys themselves
        admins = sum(1 for tenant in self._tenants if tenant.admin)
        return (
            f"Guard(api_keys={len(self._tenants)}, admin_keys={admins}, "
            f"max_inflight={self.max_inflight}, max_queued={self.max_queued}, "
            f"request_timeout={self.request_timeout}, "
            f"allowed_origins={sorted(o.decode() for o in self._origins)})"
        )


def _header(scope: MutableMapping[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _presented_key(scope: MutableMapping[str, Any]) -> bytes | None:
    """``Authorization: Bearer KEY``, else ``x-api-key: KEY`` (Anthropic's header)."""
    value = _header(scope, b"authorization")
    if value is not None and value[: len(_BEARER)].lower() == _BEARER:
        return value[len(_BEARER) :].strip()
    value = _header(scope, b"x-api-key")
    return None if value is None else value.strip() or None


def _client_timeout(scope: MutableMapping[str, Any]) -> float | None:
    value = _header(scope, CLIENT_TIMEOUT_HEADER)
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if seconds > 0 and math.isfinite(seconds) else None
