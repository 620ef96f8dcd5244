"""What ``--upstream URL[,kv=tcp://HOST:PORT]`` says: one upstream server, parsed once.

The URL is the server's root (``http://host:8000``, no ``/v1``): the engine appends the
paths it speaks. ``kv=`` names the ZMQ endpoint a vLLM server publishes its KV cache events
on (its ``--kv-events-config`` binds ``tcp://*:PORT``; we connect to ``tcp://HOST:PORT``).
Parsing is strict, so that a typo is a usage error naming the flag rather than a server
that silently routes without events.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal, final
from urllib.parse import urlsplit

__all__ = ("KINDS", "Upstream", "UpstreamKind", "parse_upstream")

UpstreamKind = Literal["vllm", "llama-server"]
#: the servers ``--engine remote`` speaks to
KINDS: Final[tuple[UpstreamKind, ...]] = ("vllm", "llama-server")


@final
@dataclass(frozen=True, slots=True)
class Upstream:
    """One upstream server: where, what it is (None: ask it), where its KV events are."""

    url: str
    kind: UpstreamKind | None = None
    #: a vLLM server's KV event endpoint (``tcp://HOST:PORT``), or None
    kv_events: str | None = None

    @property
    def name(self) -> str:
        """``host:port`` (and the path, if any): the upstream's worker id and metric label."""
        parts = urlsplit(self.url)
        return f"{parts.netloc}{parts.path.rstrip('/')}"


def parse_upstream(text: str, kind: UpstreamKind | None = None) -> Upstream:
    """``URL[,kv=tcp://HOST:PORT]`` as an :class:`Upstream` of ``kind``.

    Raises:
        ValueError: not an http(s) URL with a host, an unknown option, or a ``kv=`` that is
            not ``tcp://HOST:PORT``.
    """
    url, *options = (part.strip() for part in text.split(","))
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"expected an http(s) URL such as http://127.0.0.1:8000, got {url!r}")
    if parts.query or parts.fragment:
        raise ValueError(f"the URL is the server's root, without a query: {url!r}")
    kv: str | None = None
    for option in options:
        key, sep, value = option.partition("=")
        if key != "kv" or not sep:
            raise ValueError(f"unknown option {option!r} (expected kv=tcp://HOST:PORT)")
        endpoint = urlsplit(value)
        if endpoint.scheme != "tcp" or not endpoint.hostname or endpoint.port is None:
            raise ValueError(f"kv= takes a ZMQ endpoint tcp://HOST:PORT, got {value!r}")
        if endpoint.hostname == "*":
            raise ValueError(f"kv= connects to a host: tcp://HOST:PORT, not {value!r}")
        kv = value
    return Upstream(url.rstrip("/"), kind, kv)
