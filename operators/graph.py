"""The default serving graph: what ``llm-pipeline serve`` runs behind its HTTP edge.

::

    OpenAI request -> [OpenAIPreprocessor] -> [Migration] -> [Backend] -> [EncoderRouter]
                   -> [PrefillRouter] -> engine (one engine, or a Router over decode workers)

Backward, every operator sees the engine's outputs on their way out:

* the preprocessor renders and tokenizes the request and turns text into OpenAI chunks;
* Migration retries on another worker when one is lost mid-stream;
* the Backend detokenizes and enforces stop conditions (its state lives in the Context, so
  Migration's retries resume it);
* the EncoderRouter runs image requests on an encode worker first, when there are any;
* the PrefillRouter runs the prompt on a prefill worker first, when there are any.

The routers are passthroughs when their worker sets are empty or absent. The result is an
ordinary Engine: serve it with :class:`operators.openai.server.OpenAIApp`, drive it with
``pipeline.open_stream``, or link more operators in front of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pipeline import link

from .backend import Backend
from .encoder_router import EncoderRouter
from .migration import Migration, MigrationEvent
from .openai.preprocessor import OpenAIPreprocessor, OpenAIRequest
from .prefill_router import PrefillRouter

if TYPE_CHECKING:
    from pipeline import Engine, WorkerSet

    from .llm import EngineOutput, PreprocessedRequest
    from .openai.events import OpenAIEvent
    from .openai.images import ImagePolicy
    from .tokenizer import Tokenizer

__all__ = ("default_graph",)


def default_graph(
    engine: Engine[PreprocessedRequest, EngineOutput],
    tokenizer: Tokenizer,
    *,
    model_name: str,
    max_model_len: int | None = None,
    default_max_tokens: int | None = None,
    chat_template: str | None = None,
    migration_limit: int = 3,
    on_migration: MigrationEvent | None = None,
    encode_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None,
    prefill_workers: WorkerSet[PreprocessedRequest, EngineOutput] | None = None,
    disagg_min_prompt_tokens: int = 0,
    images: ImagePolicy | None = None,
) -> Engine[OpenAIRequest, OpenAIEvent]:
    """The full default graph around ``engine``, all sharing ``tokenizer``.

    ``model_name`` is reported in responses; ``max_model_len`` bounds prompt plus output
    (and stops migrating a request that outgrew it); ``default_max_tokens`` applies when a
    request sets no limit; ``chat_template`` (Jinja source) overrides the tokenizer's;
    ``migration_limit`` is the retries per request (0 disables); ``on_migration`` hears of
    each lost worker; ``encode_workers``/``prefill_workers`` turn on the encoder hop and
    disaggregated prefill (for prompts of at least ``disagg_min_prompt_tokens``);
    ``images`` says which image inputs are accepted.
    """
    preprocessor = OpenAIPreprocessor(
        tokenizer,
        model_name=model_name,
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        chat_template=chat_template,
        images=images,
    )
    return link(
        preprocessor,
        Migration(migration_limit, max_seq_len=max_model_len, on_event=on_migration),
        Backend(tokenizer),
        EncoderRouter(encode_workers),
        PrefillRouter(prefill_workers, min_prompt_tokens=disagg_min_prompt_tokens),
        engine,
    )
