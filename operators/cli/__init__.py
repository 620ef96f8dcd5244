"""The ``llm-pipeline`` command line: ``serve`` runs an OpenAI-compatible server, ``worker``
serves an engine to such servers over NATS.

::

    llm-pipeline serve [--host H] [--port P] [--engine echo] [--model-name NAME] ...
    llm-pipeline serve --nats URL [--model-name NAME] ...
    llm-pipeline worker --nats URL [--engine echo] [--role aggregated] [--worker-id ID] ...

``serve`` builds the default graph (:func:`operators.graph.default_graph`: OpenAI
preprocessor -> Migration -> Backend -> EncoderRouter -> PrefillRouter -> engine) with the
bundled SmolLM2 tokenizer (or ``--tokenizer``) and, by default, in-process workers of the
embedded echo engine, so it needs no other service. With ``--nats`` it builds no workers:
it discovers them (:func:`operators.contracts.transport.discover_workers`) and routes to the
aggregated/decode, prefill and encode workers registered for its model. ``worker`` serves
one raw engine (EngineOutput, never the Backend) for a model and role until SIGINT/SIGTERM,
then drains its in-flight requests.

One module per concern: :mod:`~operators.cli.args` parses (and nothing else does),
:mod:`~operators.cli.config` turns the arguments into typed configs,
:mod:`~operators.cli.engines` builds engines, :mod:`~operators.cli.serve` and
:mod:`~operators.cli.worker` are the two lifecycles, :mod:`~operators.cli.nats` connects,
:mod:`~operators.cli.command` is ``main``.
"""

from __future__ import annotations

from .args import build_parser, check_args
from .command import main
from .config import EngineConfig, ServeConfig, WorkerConfig
from .defaults import (
    API_KEY_ENV,
    DEFAULT_LLAMA_MODEL_NAME,
    DEFAULT_MODEL_NAME,
    ENGINES,
    NATS_CONNECT_TIMEOUT,
    TRANSFER_SECRET_ENV,
)
from .serve import build_graph

#: the single-module CLI's name for :func:`operators.cli.args.check_args`
_check_args = check_args

__all__ = (
    "API_KEY_ENV",
    "DEFAULT_LLAMA_MODEL_NAME",
    "DEFAULT_MODEL_NAME",
    "ENGINES",
    "NATS_CONNECT_TIMEOUT",
    "TRANSFER_SECRET_ENV",
    "EngineConfig",
    "ServeConfig",
    "WorkerConfig",
    "build_graph",
    "build_parser",
    "main",
)
