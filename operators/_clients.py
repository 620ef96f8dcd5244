"""In-process clients for an app: the official ``openai`` and ``anthropic`` SDKs over
``httpx.ASGITransport`` (re-exported by :mod:`operators.testing`, which documents them).

Apart from the conformance suite and the request builder because they are the one part of
the test helpers that needs the HTTP edge and a client package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import anthropic
    import openai

    from .edges.http.app import EdgeApp

__all__ = ("anthropic_client", "openai_client")


def openai_client(app: EdgeApp, *, api_key: str = "test", **options: Any) -> openai.AsyncOpenAI:
    """An ``openai.AsyncOpenAI`` client for ``app``, in-process; close it (``async with``).

    ``options`` go to the client (``max_retries`` is 0 unless given: a test sees the first
    error).

    Raises:
        ImportError: the ``openai`` package is not installed.
    """
    try:
        import openai
    except ImportError as exc:  # a test dependency, not the framework's
        raise ImportError("openai_client needs the openai package: pip install openai") from exc
    options.setdefault("max_retries", 0)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app/v1")
    # (openai's annotations name its own httpx fork; an httpx client is what it takes)
    client: Any = http
    return openai.AsyncOpenAI(
        base_url="http://app/v1", api_key=api_key, http_client=client, **options
    )


def anthropic_client(
    app: EdgeApp, *, api_key: str = "test", **options: Any
) -> anthropic.AsyncAnthropic:
    """An ``anthropic.AsyncAnthropic`` client for ``app`` (its Messages edge), in-process;
    close it (``async with``). ``max_retries`` is 0 unless given.

    Raises:
        ImportError: the ``anthropic`` package is not installed.
    """
    try:
        import anthropic
    except ImportError as exc:  # a test dependency, not the framework's
        raise ImportError("anthropic_client needs the anthropic package") from exc
    try:  # the SDK's own httpx (recent versions ship a fork, httpx2)
        http_module: Any = importlib.import_module("httpx2")
    except ImportError:
        http_module = httpx
    options.setdefault("max_retries", 0)
    http = http_module.AsyncClient(
        transport=http_module.ASGITransport(app=app), base_url="http://app"
    )
    return anthropic.AsyncAnthropic(
        base_url="http://app", api_key=api_key, http_client=http, **options
    )
