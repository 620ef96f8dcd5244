"""Test doubles for the LLM layer: an in-process OpenAI client for an app.

:func:`openai_client` is the official ``openai.AsyncOpenAI`` (the ``openai`` package, a test
dependency) talking to an :class:`~operators.openai.server.OpenAIApp` through
``httpx.ASGITransport``: no socket, no server process, the app's own error mapping and
rendering. ``httpx.ASGITransport`` returns a response once the app has finished it, so a
stream's chunks all arrive at the end (use a real server to observe timing)::

    async def test_hello() -> None:          # pytest with asyncio_mode = "auto" (or anyio)
        app = build_app(EchoEngine.from_tokenizer(tokenizer), tokenizer, model_name="echo")
        async with openai_client(app) as client:
            reply = await client.completions.create(model="echo", prompt="hi", max_tokens=2)
        assert reply.choices[0].text == "hi"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    import openai

    from .openai.server import OpenAIApp

__all__ = ("openai_client",)


def openai_client(app: OpenAIApp, *, api_key: str = "test", **options: Any) -> openai.AsyncOpenAI:
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
