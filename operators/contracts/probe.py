"""What a probe asks an LLM engine: :func:`one_token_probe`, the
:data:`pipeline.health.Probe` of every engine of the engine contract.

:mod:`pipeline.health` judges engines without knowing what they take; the probe is the one
thing it must be given, and for an engine of :class:`~.llm.PreprocessedRequest` it is one
prompt token and one greedy output token: the cheapest request that still runs a whole
step (a prefill and a sample), so an engine that answers it is an engine that works.
It enters at the engine (through its :class:`~pipeline.health.Supervised` gate), not
through a model's whole graph, because the engine is what is judged: in front of several
workers a graph would reach one of them, not necessarily the one in doubt.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Final

from pipeline import Context, EngineError, open_stream

from .llm import PreprocessedRequest, SamplingOptions, StopConditions

if TYPE_CHECKING:
    from pipeline import Engine

    from .llm import EngineOutput

__all__ = ("PROBE_PROMPT", "one_token_probe")

#: the probe's prompt: one token id every vocabulary has
PROBE_PROMPT: Final = (1,)

_ids = itertools.count()


async def one_token_probe(engine: Engine[PreprocessedRequest, EngineOutput]) -> None:
    """Ask ``engine`` for one greedy token after :data:`PROBE_PROMPT`; returns once it
    answered with a finished choice.

    Raises:
        EngineError: it answered, but never finished the choice.
        RequestError: whatever the engine raised (a dead engine's ``EngineDead``).
    """
    request = PreprocessedRequest(
        token_ids=list(PROBE_PROMPT),
        stop=StopConditions(max_tokens=1, ignore_eos=True),
        sampling=SamplingOptions(temperature=0.0),
    )
    finished = False
    ctx = Context.new(request, id=f"probe-{next(_ids)}", metadata={"llm_pipeline.probe": "1"})
    async with open_stream(engine, ctx) as stream:
        async for output in stream:
            finished = finished or output.finish_reason is not None
    if not finished:
        raise EngineError("the engine ended the probe without finishing it", request_id=ctx.id)
