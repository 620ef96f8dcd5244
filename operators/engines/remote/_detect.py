"""What an upstream server is and serves, asked of the server itself.

The kind is read from ``GET /v1/models``, which both kinds answer: vLLM names itself as the
models' ``owned_by`` ("vllm"), llama-server as "llamacpp"; another of our servers
("llm-pipeline") serves vLLM's tokens-in/tokens-out route and is spoken to as a vLLM. A
server that says neither (a proxy in between, an older build) is asked what only one kind
answers: ``GET /props``
(llama-server's ``default_generation_settings``) or ``GET /version`` (vLLM's
``{"version": ...}``). ``--upstream-kind`` skips the guessing, never the facts below.

Then what the engine needs to check requests before sending them:

- vLLM: the model's context (``max_model_len`` in ``/v1/models``), and whether it serves the
  tokens-in/tokens-out endpoint (``POST /inference/v1/generate``, only with
  ``--enable-scale-out``: an empty request is answered 403 without it, 400 with it).
- llama-server: its slots (``GET /props``: ``total_slots``, each slot's ``n_ctx``; ``n``
  cannot exceed the slots), its vocabulary (``/v1/models``' ``meta.n_vocab``) and whether
  ``/metrics`` is on (``--metrics``; the load poll reads queued requests there).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any, final

import httpx

from ._spec import Upstream, UpstreamKind

__all__ = ("UpstreamInfo", "describe")


@final
@dataclass(frozen=True, slots=True)
class UpstreamInfo:
    """What one upstream server is, as it said when asked."""

    kind: UpstreamKind
    #: the model name the server answers to (requests to its OpenAI routes must use it)
    model: str
    #: prompt and output of one sequence together (None: not said)
    max_model_len: int | None = None
    #: token ids it accepts (None: not said; the server refuses others itself)
    vocab_size: int | None = None
    #: llama-server: sequences it runs at once (``n`` may not exceed it)
    slots: int | None = None
    #: vLLM: ``POST /inference/v1/generate`` is served (else ``/v1/completions``)
    generate: bool = False
    #: llama-server: ``/metrics`` is served
    metrics: bool = False

    @property
    def display_model(self) -> str:
        """The model name to serve it as: a llama-server without ``--alias`` answers to its
        GGUF's path; its file name without ``.gguf`` is what a client would ask for."""
        if "/" in self.model and self.model.endswith(".gguf"):
            return PurePosixPath(self.model).stem
        return self.model


async def describe(client: httpx.AsyncClient, upstream: Upstream) -> UpstreamInfo:
    """Ask ``upstream`` what it is and serves.

    Raises:
        httpx.HTTPError: it cannot be reached, or answers an error.
        ValueError: it answers something neither vLLM nor llama-server would (set its kind).
    """
    models = await _get_json(client, "/v1/models")
    data = models.get("data") if isinstance(models, dict) else None
    if not isinstance(data, list) or not data or not isinstance(data[0], dict):
        raise ValueError(f"{upstream.url}/v1/models lists no model")
    first: dict[str, Any] = data[0]
    kind = upstream.kind or await _kind(client, upstream, first)
    model = str(first.get("id"))
    if kind == "vllm":
        return UpstreamInfo(
            kind,
            model,
            max_model_len=_int(first.get("max_model_len")),
            generate=await _serves_generate(client),
        )
    props = await _get_json(client, "/props")
    settings = props.get("default_generation_settings") or {}
    meta = first.get("meta") or {}
    return UpstreamInfo(
        kind,
        model,
        max_model_len=_int(settings.get("n_ctx")) or _int(meta.get("n_ctx")),
        vocab_size=_int(meta.get("n_vocab")),
        slots=_int(props.get("total_slots")),
        metrics=bool(props.get("endpoint_metrics")),
    )


async def _kind(
    client: httpx.AsyncClient, upstream: Upstream, model: dict[str, Any]
) -> UpstreamKind:
    owner = model.get("owned_by")
    if owner in ("vllm", "llm-pipeline"):  # (our serve speaks vLLM's tokens-in/tokens-out)
        return "vllm"
    if owner == "llamacpp":
        return "llama-server"
    props = await client.get("/props")
    if props.status_code == 200 and "default_generation_settings" in _json(props):
        return "llama-server"
    version = await client.get("/version")
    if version.status_code == 200 and "version" in _json(version):
        return "vllm"
    raise ValueError(
        f"{upstream.url} is neither vLLM nor llama-server as far as it says (owned_by "
        f"{owner!r}): give --upstream-kind"
    )


async def _serves_generate(client: httpx.AsyncClient) -> bool:
    response = await client.post("/inference/v1/generate", json={})
    return response.status_code not in (403, 404, 405)


async def _get_json(client: httpx.AsyncClient, path: str) -> Any:
    response = await client.get(path)
    response.raise_for_status()
    return _json(response)


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
