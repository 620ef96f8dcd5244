"""The default serving graph: what ``llm-pipeline serve`` runs behind its HTTP edge.

::

    OpenAI request --> [OpenAIPreprocessor] --> [Backend] --> engine
    OpenAI chunks  <-- [OpenAIPreprocessor] <-- [Backend] <-- EngineOutput

The preprocessor renders and tokenizes the request and turns text back into OpenAI chunks;
the Backend detokenizes and enforces stop conditions; the engine (echo, mocker, llama or a
user's own) turns token ids into token ids. The result is an ordinary Engine, so it can be
served by :class:`operators.openai.server.OpenAIApp`, driven in-process with
``pipeline.open_stream``, or linked behind more operators.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline import link

from .backend import Backend
from .openai.preprocessor import OpenAIPreprocessor, OpenAIRequest

if TYPE_CHECKING:
    from pipeline import Engine

    from .llm import EngineOutput, PreprocessedRequest
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
) -> Engine[OpenAIRequest, dict[str, Any]]:
    """OpenAI preprocessor -> Backend -> ``engine``, all sharing ``tokenizer``.

    ``model_name`` is reported in responses; ``max_model_len`` bounds prompt plus output;
    ``default_max_tokens`` applies when a request sets no limit; ``chat_template``
    (Jinja source) overrides the tokenizer's.
    """
    preprocessor = OpenAIPreprocessor(
        tokenizer,
        model_name=model_name,
        max_model_len=max_model_len,
        default_max_tokens=default_max_tokens,
        chat_template=chat_template,
    )
    return link(preprocessor, Backend(tokenizer), engine)
