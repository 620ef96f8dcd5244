"""RemoteEngine: our engine contract over an unmodified vLLM or llama-server process.

The graph in front of it renders, tokenizes, detokenizes and jails stop strings as for
every engine; the server gets token ids and answers token ids (:mod:`._vllm`,
:mod:`._llama`). One pooled ``httpx.AsyncClient`` per server carries every request, each a
streamed response. What this module adds is the contract's edges:

- **Every way out aborts upstream.** However ``generate`` ends before the server finished
  (a kill, a closed stream, ``stop_generating()``, an error), the response is closed in
  ``finally``, shielded: an unfinished HTTP response cannot go back to the pool, so its
  connection is closed, and both servers abort a request whose connection closed (vLLM's
  ``with_cancellation``, llama-server's ``should_stop``). Its KV is freed at once.
- **A lost server is a lost worker.** A reset, an end of stream before the finish, a line
  that is not JSON, a 5xx, silence longer than ``stall_timeout``: ``WorkerLost`` errors
  (``ConnectFailed`` before any output), which Migration retries on another upstream from
  prompt + output so far. ``on_lost`` is told at once (the fleet takes the server out of
  its worker set until it answers again).
- **The conversation goes along** (``PreprocessedRequest.affinity``, as the
  ``x-session-affinity`` header): an upstream that routes (another ``serve``, a router)
  keeps it on one worker too; vLLM and llama-server ignore the header.
- **What it says of itself.** :meth:`poll` reads the server's load (:mod:`._load`),
  :meth:`load_report` is the last report in the router's unit (:class:`pipeline.WorkerLoad`),
  :meth:`upstream_load` as the server said it; with ``kv_events`` (vLLM's ZMQ
  endpoint, :class:`~operators.engines._vllm_kv_events.KvEventListener`) it reports its
  prefix cache as our block ids, like the in-process engines, for ``--router kv``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import anyio
import httpx

from operators.contracts.llm import CONSTRAINED_DECODING, EngineOutput, PreprocessedRequest
from operators.engines._kv_delivery import KvDelivery
from operators.engines._prefix_cache import DEFAULT_BLOCK_SIZE
from operators.engines._vllm_kv_events import BlockTranslator, KvEventListener
from operators.engines.vllm._sampling import EngineLimits
from pipeline import RequestError, StreamDisconnected, WorkerLoad

from ._detect import UpstreamInfo, describe
from ._gaps import GapFiller
from ._http import events, refusal, transport_error
from ._llama import LlamaReader, llama_call
from ._load import UpstreamLoad, llama_load, vllm_load
from ._spec import Upstream
from ._vllm import VllmReader, vllm_call

if TYPE_CHECKING:
    from operators.text.tokenizer import Tokenizer
    from pipeline import Context, KvEventSink, KvSnapshot, Stream

__all__ = ("CONNECT_TIMEOUT", "STALL_TIMEOUT", "RemoteEngine", "RemoteStatistics")

logger = logging.getLogger("operators.engines.remote")

#: the header naming a request's conversation, for an upstream that routes (``serve``'s)
SESSION_AFFINITY: Final = "x-session-affinity"
#: how long connecting to an upstream, and a request's first bytes to it, may take
CONNECT_TIMEOUT: Final = 10.0
#: the longest silence of a streaming upstream before it counts as lost (a long prompt's
#: prefill sends nothing until its first token)
STALL_TIMEOUT: Final = 300.0
#: vocabularies are smaller than this; an id above it is refused before it is sent
_NO_VOCAB: Final = 2**31 - 1


class RemoteStatistics(NamedTuple):
    """Counters of a :class:`RemoteEngine` since it was created, and its server's load."""

    #: requests sent to the server
    requests: int
    #: requests lost there (the server unreachable, a broken stream, a 5xx)
    lost: int
    #: tokens received, over all choices
    generated_tokens: int
    #: prompt tokens the server reported finding in its cache
    cached_prompt_tokens: int
    #: whether the server answered its last poll (and no request lost it since)
    up: bool
    #: its last load report (None: none yet)
    load: UpstreamLoad | None


@final
class RemoteEngine:
    """An Engine[PreprocessedRequest, EngineOutput] whose model runs in another server.

    Args:
        upstream: where the server is, and its KV event endpoint (vLLM).
        info: what it is and serves (:func:`~._detect.describe`; :meth:`connect` asks it).
        tokenizer: the served model's tokenizer, to recover token ids llama-server leaves out
            of its stream (:mod:`._gaps`) and to check prompt ids when the server does not
            say its vocabulary. None: neither.
        block_size: tokens per block in the KV events (the KV router's ``--kv-block-size``).
        stall_timeout: the longest silence of a stream before the server counts as lost.
        client: the HTTP client (None: one of its own, pooled, closed by :meth:`aclose`).
        on_lost: called when a request loses the server (the fleet's membership hook).

    Create it with :meth:`connect` (which asks the server what it is); free it with
    :meth:`aclose` (or ``async with``).
    """

    #: structured output is mapped (a JSON value; vLLM also text around it)
    features: Final = frozenset({CONSTRAINED_DECODING})

    def __init__(
        self,
        upstream: Upstream,
        info: UpstreamInfo,
        *,
        tokenizer: Tokenizer | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        stall_timeout: float = STALL_TIMEOUT,
        client: httpx.AsyncClient | None = None,
        on_lost: Callable[[RemoteEngine], None] | None = None,
    ) -> None:
        self.upstream = upstream
        self.info = info
        self.on_lost = on_lost
        self._owns_client = client is None
        self._client = client or _client(upstream.url, stall_timeout)
        vocab = info.vocab_size or (tokenizer.vocab_size if tokenizer is not None else _NO_VOCAB)
        self._limits = EngineLimits(vocab_size=vocab, max_model_len=info.max_model_len or _NO_VOCAB)
        self._gaps = GapFiller(tokenizer) if tokenizer is not None else None
        self._generate = info.generate
        self._translator = BlockTranslator(block_size)  # validates block_size
        self._kv = KvDelivery()
        self._listener: KvEventListener | None = None
        if upstream.kv_events is not None:  # (started by connect(), or follow_kv_events())
            self._listener = KvEventListener(upstream.kv_events, self._translator, self._kv)
        self._load: UpstreamLoad | None = None
        #: prompt tokens a request of ours prefilled there lately (a running mean; None: no
        #: request yet): the load report's estimate of a queued request
        self._prefill_mean: float | None = None
        self._up = True
        self._requests = self._lost = self._generated = self._cached = 0

    @classmethod
    async def connect(
        cls,
        upstream: Upstream,
        *,
        tokenizer: Tokenizer | None = None,
        block_size: int = DEFAULT_BLOCK_SIZE,
        stall_timeout: float = STALL_TIMEOUT,
        on_lost: Callable[[RemoteEngine], None] | None = None,
    ) -> RemoteEngine:
        """Ask ``upstream`` what it is (:func:`~._detect.describe`) and make its engine.

        Raises:
            httpx.HTTPError: the server cannot be reached, or answers errors.
            ValueError: it is neither vLLM nor llama-server, as far as it says.
            ImportError: ``kv=`` was given without pyzmq and msgspec.
        """
        client = _client(upstream.url, stall_timeout)
        try:
            info = await describe(client, upstream)
            engine = cls(
                upstream,
                info,
                tokenizer=tokenizer,
                block_size=block_size,
                stall_timeout=stall_timeout,
                client=client,
                on_lost=on_lost,
            )
            await engine.follow_kv_events()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await client.aclose()
            raise
        engine._owns_client = True
        return engine

    # ------------------------------------------------------------------------ properties

    @property
    def name(self) -> str:
        """The upstream's name (``host:port``): its worker id and metric label."""
        return self.upstream.name

    @property
    def where(self) -> str:
        """What and where the server is, for the status page."""
        return f"{self.info.kind} at {self.upstream.url}"

    @property
    def up(self) -> bool:
        """Whether the server answered its last poll, and no request lost it since."""
        return self._up

    @property
    def block_size(self) -> int:
        """Tokens per block in the KV events."""
        return self._translator.block_size

    def load_report(self) -> WorkerLoad | None:
        """The server's last load report in the router's unit (None: none yet): its
        requests not decoding yet at what ours prefilled there lately, sequences."""
        report = self._load
        if report is None:
            return None
        mean = self._prefill_mean
        return report.worker_load(0.0 if mean is None else mean)

    def upstream_load(self) -> UpstreamLoad | None:
        """The server's last load report, as it said it (None: none yet)."""
        return self._load

    def statistics(self) -> RemoteStatistics:
        """Counters since the engine was created, and the server's last load report."""
        return RemoteStatistics(
            requests=self._requests,
            lost=self._lost,
            generated_tokens=self._generated,
            cached_prompt_tokens=self._cached,
            up=self._up,
            load=self._load,
        )

    # --------------------------------------------------------------------------- KV events

    @property
    def kv_events(self) -> KvEventSink | None:
        """Where the KV events go (only with a ``kv=`` endpoint: setting a sink on an engine
        without one leaves this None, which tells the router to approximate)."""
        return self._kv.sink

    @kv_events.setter
    def kv_events(self, sink: KvEventSink | None) -> None:
        self._kv.set_sink(sink if self._listener is not None else None)

    async def follow_kv_events(self, wait: float = 1.0) -> None:
        """Subscribe to the server's KV events (``kv=``; nothing without): waits up to
        ``wait`` seconds for its publisher (in a thread), then goes on without it (ZMQ
        connects whenever it comes up). :meth:`connect` calls it.

        Raises:
            ImportError: pyzmq or msgspec is missing (the ``[remote]`` extra).
        """
        listener = self._listener
        if listener is not None:
            await anyio.to_thread.run_sync(
                functools.partial(listener.start, timeout=wait, required=False)
            )

    def kv_snapshot(self) -> KvSnapshot:
        """Every block held as of the last KV event delivered, with that event's ``seq``."""
        self._kv.bind()
        return self._kv.snapshot()

    # ------------------------------------------------------------------------ the server

    async def poll(self) -> UpstreamLoad:
        """Read the server's load now; it is up again if it answers.

        Raises:
            httpx.HTTPError: it cannot be reached or answers an error (it is then down).
            ValueError: it answers something that is no load report.
        """
        try:
            report = await self._read_load()
        except (httpx.HTTPError, ValueError):
            self._up = False
            raise
        self._load, self._up = report, True
        return report

    async def _read_load(self) -> UpstreamLoad:
        # Stamped when the answer came: a request sent before may not be in it, which only
        # makes the router count it once, as its own (:meth:`pipeline.LoadLedger.others`).
        client = self._client
        if self.info.kind == "vllm":
            response = await client.get("/metrics")
            response.raise_for_status()
            return vllm_load(response.text, anyio.current_time())
        slots = await client.get("/slots")
        slots.raise_for_status()
        metrics: str | None = None
        if self.info.metrics:
            response = await client.get("/metrics")
            metrics = response.text if response.status_code == 200 else None
        return llama_load(slots.json(), metrics, anyio.current_time())

    # ------------------------------------------------------------------------ generation

    async def generate(self, ctx: Context[PreprocessedRequest], /) -> Stream[EngineOutput]:
        """Stream ``ctx``'s completion from the server: one output per token per choice
        (choices of ``n > 1`` interleave).

        Raises:
            InvalidRequest: the request cannot run there (naming the field).
            WorkerLost: the server was lost (Migration retries elsewhere).
            EngineError: the server failed the request, or refused our configuration.
        """
        request = ctx.data
        kind = self.info.kind
        if kind == "vllm":
            call: Any = vllm_call(request, ctx.id, self.info, self._limits, generate=self._generate)
            reader: Any = VllmReader(call.plan.n, call.plan.params.get("logprobs"), ctx.id)
        else:
            call = llama_call(request, ctx.id, self.info, self._limits)
            k = call.plan.params.get("logprobs")
            reader = LlamaReader(call.plan.n, k, ctx.id, self._gaps, call.plan.budget)
        if call.plan.budget == 0:
            for index in range(call.plan.n):
                yield EngineOutput([], None, None, "length", index)
            return
        self._requests += 1
        response = await self._send(call, ctx)
        started = False
        cached = 0
        try:
            async with aclosing(events(response, ctx.id)) as stream:
                async for event in stream:
                    for output in reader.feed(event):
                        started = True
                        if output.cached_tokens:
                            cached = output.cached_tokens
                            self._cached += cached
                        yield output
                    if ctx.is_stopped and not reader.done:
                        return  # (the connection closes: the server aborts the request)
                # (done, the rest is read to its end: the connection goes back to the pool)
            for output in reader.end():
                yield output
        except httpx.HTTPError as exc:
            self._lose()
            raise transport_error(exc, started=started, request_id=ctx.id) from exc
        except StreamDisconnected:
            self._lose()
            raise
        finally:
            self._generated += reader.generated
            if started:
                self._learn_prefill(len(request.token_ids) - cached)
            with anyio.CancelScope(shield=True):
                await response.aclose()  # (events() closed it already, unless never read)

    async def _send(self, call: Any, ctx: Context[PreprocessedRequest]) -> httpx.Response:
        """POST ``call`` and return the streaming response once its status is 200 (a vLLM
        that refuses the tokens-in/tokens-out route is asked again on ``/v1/completions``).

        Raises:
            RequestError: the server refused the request, or could not be reached.
        """
        client = self._client
        conversation = ctx.data.affinity  # (for a server that routes: a router, our serve)
        headers = {SESSION_AFFINITY: conversation} if conversation is not None else None
        while True:
            try:
                response = await client.send(
                    client.build_request("POST", call.path, json=call.body, headers=headers),
                    stream=True,
                )
            except httpx.HTTPError as exc:
                self._lose()
                raise transport_error(exc, started=False, request_id=ctx.id) from exc
            if response.status_code == 200:
                return response
            try:
                body = await response.aread()
            except httpx.HTTPError:
                body = b""
            finally:
                await response.aclose()
            if call.path == "/inference/v1/generate" and response.status_code in (403, 404):
                logger.warning(
                    "%s does not serve /inference/v1/generate (start vLLM with "
                    "--enable-scale-out): using /v1/completions",
                    self.upstream.url,
                )
                self._generate = False
                call = vllm_call(ctx.data, ctx.id, self.info, self._limits, generate=False)
                continue
            error: RequestError = refusal(response.status_code, body, ctx.id)
            if response.status_code >= 500:
                self._lost += 1
            raise error

    def _learn_prefill(self, tokens: int) -> None:
        """A request of ours prefilled ``tokens`` there (its prompt less what the server
        said it found cached): the running mean the load report estimates queued ones by."""
        mean = self._prefill_mean
        self._prefill_mean = tokens if mean is None else mean + (tokens - mean) / 8

    def _lose(self) -> None:
        self._lost += 1
        self._up = False
        if self.on_lost is not None:
            self.on_lost(self)

    # --------------------------------------------------------------------------- closing

    async def aclose(self) -> None:
        """Close the HTTP client (if it is this engine's) and the KV event listener.
        Idempotent."""
        listener, self._listener = self._listener, None
        if listener is not None:
            await anyio.to_thread.run_sync(listener.close)
        if self._owns_client:
            with anyio.CancelScope(shield=True):
                await self._client.aclose()

    async def __aenter__(self) -> RemoteEngine:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        return f"RemoteEngine({self.where!r}, model={self.info.model!r})"


def _client(url: str, stall_timeout: float) -> httpx.AsyncClient:
    """One pooled client per server: every request a streamed response on a connection of
    its own (kept alive for the next), the read timeout the longest silence allowed."""
    return httpx.AsyncClient(
        base_url=url,
        timeout=httpx.Timeout(CONNECT_TIMEOUT, read=stall_timeout, pool=CONNECT_TIMEOUT),
        limits=httpx.Limits(max_connections=1024, max_keepalive_connections=64),
    )
