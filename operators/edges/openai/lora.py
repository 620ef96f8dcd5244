"""``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``: adapters at run time,
in vLLM's shapes.

::

    POST /v1/load_lora_adapter    {"lora_name": "tiny", "lora_path": "/adapters/tiny.gguf"}
                                  -> 200 "Success: LoRA adapter 'tiny' added successfully."
    POST /v1/unload_lora_adapter  {"lora_name": "tiny"}
                                  -> 200 "Success: LoRA adapter 'tiny' removed successfully."

A loaded adapter is served as a model of its own (``/v1/models`` lists it, its ``parent``
the base model), running on its base model's graph; an unloaded one is a 404 like any
unknown model (requests already running with it finish). The base is the model named by
``model`` (our extension; the default model when absent, as in vLLM, which serves one).
Both routes are behind the API key when the server has keys. With a folder given
(``serve --lora-dir DIR``), a path that does not resolve inside it is refused, symbolic
links and ``..`` included; without one, any file the server can read may be loaded.
Errors are OpenAI-shaped: 400 naming ``lora_name``, ``lora_path`` (one that is no path:
a NUL byte, which no engine's file check could take) or ``model``, 404 for an adapter that
is not loaded.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from pydantic import Field, field_validator
from pydantic_core import PydanticCustomError

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import ApiError, Refusal, describe_failure
from operators.edges.http.routes import Call, Host, Route, resolve_model
from operators.edges.http.schema import Model, parse_body
from pipeline import InvalidRequest

from .errors import OPENAI_ERRORS

if TYPE_CHECKING:
    from operators.edges.http.models import ServedModel

__all__ = ("LOAD_LORA", "UNLOAD_LORA", "LoadLoraRequest", "UnloadLoraRequest", "lora_routes")

LOAD_LORA: Final = "/v1/load_lora_adapter"
UNLOAD_LORA: Final = "/v1/unload_lora_adapter"


class LoadLoraRequest(Model):
    """The body of ``POST /v1/load_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    #: the base model to load it into (None: the default model)
    model: str | None = None

    @field_validator("lora_path")
    @classmethod
    def _a_path(cls, path: str) -> str:
        if "\x00" in path:
            raise PydanticCustomError("nul_byte", "a path cannot hold a NUL byte")
        return path


class UnloadLoraRequest(Model):
    """The body of ``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)


def _within(path: str, directory: Path | None) -> str:
    """``path``, resolved; refused when it does not lie inside ``directory`` or is no file.

    Raises:
        InvalidRequest: outside the folder, or no file there, naming ``lora_path``.
    """
    resolved = Path(os.path.realpath(path))
    if directory is not None:
        folder = Path(os.path.realpath(directory))
        if not resolved.is_relative_to(folder):
            raise InvalidRequest(
                f"lora_path {path!r} is outside the folder adapters are loaded from (--lora-dir)",
                param="lora_path",
            )
    if not resolved.is_file():
        raise InvalidRequest(f"no adapter file at {path!r}", param="lora_path")
    return str(resolved)


def lora_routes(directory: Path | None = None) -> Callable[[Host], list[Route]]:
    """The load and unload routes; ``directory``: the only folder adapters may be loaded
    from at run time (None: any)."""

    def routes(host: Host) -> list[Route]:
        async def respond(call: Call, work: Callable[[bytes], Awaitable[str]]) -> int:
            try:
                message = await work(await host.read_body(call))
            except Refusal as exc:
                error = exc.error
            except Exception as exc:  # InvalidRequest, an engine failing to load it
                error = describe_failure(exc, "(lora)")
            else:
                await call.send(
                    {
                        "type": "http.response.start",
                        "status": 200,
                        "headers": [(b"content-type", b"text/plain; charset=utf-8")],
                    }
                )
                await call.send({"type": "http.response.body", "body": message.encode()})
                return 200
            rendered = OPENAI_ERRORS.render(error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status

        def base_of(call: Call, name: str | None) -> ServedModel:
            model = resolve_model(call, name, host)
            if model.parent is not None:
                model = resolve_model(call, model.parent, host)
            if model.lora is None:
                raise InvalidRequest(
                    f"the model {model.name!r} takes no adapters (its engine runs none)",
                    param="model",
                )
            return model

        async def load(call: Call) -> int:
            async def work(body: bytes) -> str:
                request = parse_body(LoadLoraRequest, body)
                base = base_of(call, request.model)
                name = request.lora_name
                if name in host.models:
                    raise InvalidRequest(
                        f"a model or adapter named {name!r} is already served",
                        param="lora_name",
                    )
                path = _within(request.lora_path, directory)
                assert base.lora is not None
                await base.lora.load_lora(name, path)
                host.models.add(base.adapter(name, path))
                return f"Success: LoRA adapter '{name}' added successfully."

            return await respond(call, work)

        async def unload(call: Call) -> int:
            async def work(body: bytes) -> str:
                request = parse_body(UnloadLoraRequest, body)
                name = request.lora_name
                model = host.models.get(name)
                if model is None or model.parent is None:
                    raise Refusal(
                        ApiError(
                            "not_found",
                            f"The lora adapter '{name}' cannot be found.",
                            param="lora_name",
                        )
                    )
                base = base_of(call, model.parent)
                host.models.remove(name)  # new requests: 404 from now on
                assert base.lora is not None
                try:
                    await base.lora.unload_lora(name)
                except KeyError:  # (unloaded meanwhile)
                    pass
                return f"Success: LoRA adapter '{name}' removed successfully."

            return await respond(call, work)

        post = frozenset({"POST"})
        return [
            Route(LOAD_LORA, post, load, OPENAI_ERRORS),
            Route(UNLOAD_LORA, post, unload, OPENAI_ERRORS),
        ]

    return routes
