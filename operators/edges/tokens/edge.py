"""``POST /inference/v1/generate``: token ids in, token ids out, through the graph below the
preprocessor.

::

    body --parse_generate--> GenerateRequest --preprocessed--> PreprocessedRequest
         --[Tallied -> Migration -> Backend -> routers -> engine]--> outputs, a Tally
         --TokensReply--> vLLM's chunks (or one object)

vLLM 0.32's shapes (``vllm/entrypoints/scale_out/token_in_token_out/``), so any of our
servers, whatever its engine, is an upstream of another (``--engine remote``: its vLLM
kind speaks this route) and of any router that speaks it. The template, the tokenizer and
the output parsers are skipped (the client brings ids and wants ids); the rest is the
graph's and the app's as for every API: admission, API keys, deadlines, request ids,
disconnects (a closed connection aborts the request down to the engine), the drain,
metrics, Migration, the stop rules on ids (``stop_token_ids``, the model's end ids,
``min_tokens``, ``max_tokens``) and on text (``stop``, the Backend decodes anyway), the
``x-session-affinity`` header (the router keeps a conversation on one worker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Final, final

from operators.backend import CACHED_TOKENS
from operators.contracts.llm import BackendOutput, PreprocessedRequest
from operators.edges.http.failures import ApiError, Refusal
from operators.edges.http.routes import Call, Exchange, Host, Route, resolve_model
from operators.edges.openai import OpenAIPreprocessor
from pipeline import link

from .errors import VLLM_ERRORS
from .protocol import parse_generate, preprocessed
from .reply import Tally, TokensReply

if TYPE_CHECKING:
    from pipeline import Context, Engine, Stream

__all__ = ("GENERATE", "Tallied", "TokensEdge")

#: vLLM's path for it
GENERATE: Final = "/inference/v1/generate"
_POST: Final = frozenset({"POST"})


@final
class Tallied:
    """Operator: the Backend's outputs, then a :class:`Tally` of the request (its prompt,
    the tokens generated, the cached prompt tokens the engine reported: what the
    preprocessor's usage event says for the other APIs)."""

    __slots__ = ()

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput | Tally]:
        """``downstream``'s outputs, then the tally."""
        generated = 0
        async for output in downstream.generate(ctx):
            generated += len(output.token_ids)
            yield output
        prompt = ctx.data.prompt_tokens
        cached = ctx.state.get(CACHED_TOKENS, None)
        yield Tally(prompt, generated, None if cached is None else min(cached, prompt))


@final
class TokensEdge:
    """The tokens-in/tokens-out route over every model's graph below its preprocessor."""

    def routes(self, host: Host) -> list[Route]:
        """``POST /inference/v1/generate`` on ``host``."""
        tally = Tallied()

        async def generate(call: Call) -> int:
            async def prepare(body: bytes) -> Exchange:
                request = await host.offload(len(body), parse_generate, body)
                model = resolve_model(call, request.model, host)
                preprocessor = model.preprocessor
                if model.tokens is None or not isinstance(preprocessor, OpenAIPreprocessor):
                    raise Refusal(
                        ApiError(
                            "invalid_request",
                            f"the model {model.name!r} is not served token ids in, ids out",
                            param="model",
                        )
                    )
                name = request.name
                graph_request = preprocessed(
                    request,
                    preprocessor,
                    model=model.name,
                    lora=model.name if model.parent is not None else None,
                )
                return Exchange(
                    graph_request,
                    request.stream,
                    TokensReply(request, model=model.name, request_id=name),
                    graph=link(tally, model.tokens),
                    model=model.name,
                    response_id=name,
                )

            return await host.generate(call, prepare, VLLM_ERRORS, route=GENERATE)

        return [Route(GENERATE, _POST, generate, VLLM_ERRORS)]

    def __repr__(self) -> str:
        return "TokensEdge()"
