"""A generation request's life, the same for every edge: :class:`Generations`.

An edge only says how its API's body becomes a graph request and how the graph's events
become its API's response (an :class:`~.routes.Exchange` carrying a
:class:`~.routes.Reply`). Everything else happens here, once, for chat completions,
Responses, Messages and a user's own edge (``host.generate(call, prepare, errors)``)::

    read the body (bounded: 413)        -> edge: prepare(body) -> Exchange   (400, 404, ...)
                                           (its model resolved: its graph, :mod:`.models`,
                                           among the ones its key may use)
    draining? (503)
    no engine of its model can answer? (503 engine_unavailable, Retry-After: pipeline.health)
    no priority given? the API key's default (its Tenant)
    admission (:mod:`.admission`): the key's limits (429), a slot of max_inflight or a
        wait in the fair queue for one (the edge says 503 or 529; 504 at the deadline)
    x-request-id (unique in flight), the deadline (Guard), a Context
    run the graph under open_stream, a watcher task killing it when the client leaves
        stream:  the reply renders each event; sse_writer decides when bytes leave
        whole:   the reply folds the events into one body
        the graph's first event (the prompt tokenized, the engine not yet asked): the
        prompt's tokens and the output it may generate are reserved of the key's tokens
        per minute (429 before any byte)
    a kill by the server (deadline: timeout, drain's abort: unavailable) or a failure
        -> the edge's ErrorStyle (before any byte) or the reply's failure event (after)
    the end: the ticket is settled (the tokens its usage says; the slot freed, the next
        waiting request admitted; the key's usage counted)

:meth:`Generations.drain` refuses new requests and lets the in-flight ones finish;
:meth:`Generations.abort` kills what is left, each ending with an error, never a finish
it did not earn. Every request counts in ``llm_pipeline_inflight_requests`` and
``llm_pipeline_request_duration_seconds`` (by model, as its other per-request series).

With a :class:`~pipeline.tracing.Tracer`, every generation request, whichever its edge,
gets a span (:mod:`.request_span`: HTTP and GenAI attributes, the first token, the usage)
that the graph's stages hang under.
"""

from __future__ import annotations

from time import perf_counter
from typing import TYPE_CHECKING, Any, final

import anyio

from pipeline import Context, InvalidRequest, open_stream
from pipeline.priority import priority_of

from .admission import Admission
from .asgi import (
    BodyTooLarge,
    conversation_key,
    id_header,
    kill_on_disconnect,
    read_body,
    request_identity,
    send_json,
)
from .failures import (
    ApiError,
    ClientGone,
    ErrorStyle,
    Refusal,
    body_too_large,
    describe_failure,
    draining,
    rate_headers,
    shut_down,
    timed_out,
)
from .ledger import UsageLedger
from .request_span import (
    finish_request,
    record_admission,
    record_first_token,
    record_request,
    record_usage,
    start_request,
)
from .reservation import estimate
from .running import Running
from .sse_writer import CLIENT_GONE, StreamState, WriteFailed, keep_alive, stream_response

if TYPE_CHECKING:
    from pipeline import Engine
    from pipeline.health import Health
    from pipeline.tracing import Span, Tracer

    from .admission import Ticket
    from .guard import Guard
    from .metrics import ServerMetrics
    from .models import Models
    from .routes import Call, Exchange, Prepare

__all__ = ("Generations",)


@final
class Generations:
    """The generation requests in flight, and the rules they all run under.

    Args:
        models: the models served: an exchange runs on its model's graph (unless
            it brings its own), the default model's when it names none.
        guard: admission control, deadlines, the API keys' terms (keys are checked
            before dispatch).
        metrics: in-flight gauge, durations, tokens, rejections, timeouts.
        max_body_bytes: larger bodies get a 413.
        tracer: traces every generation request (None: none is traced, nothing is done).
        ledger: where each key's usage is counted (a fresh one if None).
        health: refuses a request at once when no engine of its model can answer.
    """

    def __init__(
        self,
        models: Models,
        *,
        guard: Guard,
        metrics: ServerMetrics,
        max_body_bytes: int,
        tracer: Tracer | None = None,
        ledger: UsageLedger | None = None,
        health: Health | None = None,
    ) -> None:
        self.models = models
        self.health = health
        self.guard = guard
        self.metrics = metrics
        #: who may run now, on what terms, and each key's use counted
        self.admission = Admission(guard, metrics, UsageLedger() if ledger is None else ledger)
        self.max_body_bytes = max_body_bytes
        #: what traces the requests (None: untraced)
        self.tracer = tracer
        self._contexts: set[Context[Any]] = set()
        #: in-flight requests ended by :meth:`abort` (they get an error, not a 499)
        self._aborted: set[Context[Any]] = set()
        self.draining = False

    @property
    def inflight(self) -> int:
        """Generation requests running now."""
        return len(self._contexts)

    @property
    def contexts(self) -> tuple[Context[Any], ...]:
        """The Contexts of the generation requests running now."""
        return tuple(self._contexts)

    def drain(self) -> None:
        """Refuse new generation requests; the in-flight ones run on to their end."""
        self.draining = True

    def abort(self) -> None:
        """End every in-flight generation request now, down to the engine, each with an
        error (a stream's failure event, or a whole response's error body); the ones
        waiting for a slot are refused (503)."""
        self.admission.close()
        for ctx in list(self._contexts):
            self._aborted.add(ctx)
            ctx.kill()

    async def read_body(self, call: Call) -> bytes:
        """The request's body, at most ``max_body_bytes``.

        Raises:
            Refusal: a larger body (413).
            ClientGone: the client left before it was read.
        """
        try:
            body = await read_body(call.receive, self.max_body_bytes)
        except BodyTooLarge:
            raise Refusal(body_too_large(self.max_body_bytes)) from None
        if body is None:
            raise ClientGone
        return body

    async def run(
        self, call: Call, errors: ErrorStyle, prepare: Prepare, *, route: str | None = None
    ) -> int:
        """Serve one generation request; the status it ended with (499: the client left).

        ``errors`` says what went wrong before the response started; ``prepare`` turns the
        body into the :class:`~.routes.Exchange` to run; ``route`` names the endpoint in
        its span (the path if None). ``call.model`` is set to the model it runs on.
        """
        started = perf_counter()
        metrics = self.metrics
        metrics.inflight.inc()
        tracer = self.tracer
        scope = call.scope
        span = None
        if tracer is not None:
            span = start_request(tracer, scope, route or scope["path"], owner=call.owner)
        status = 500
        error: BaseException | None = None
        try:
            status = await self._serve(call, errors, prepare, started, span)
            return status
        except BaseException as exc:
            error = exc
            raise
        finally:
            metrics.inflight.dec()
            metrics.for_model(call.model).request_duration.observe(perf_counter() - started)
            if span is not None:
                finish_request(span, status, error)

    async def _serve(
        self, call: Call, errors: ErrorStyle, prepare: Prepare, started: float, span: Span | None
    ) -> int:
        scope, receive, send = call.scope, call.receive, call.send

        async def refuse(error: ApiError, request_id: str | None = None) -> int:
            rendered = errors.render(error, request_id)
            await send_json(send, rendered.status, rendered.body, rendered.headers)
            return rendered.status

        try:
            body = await self.read_body(call)
        except Refusal as exc:
            return await refuse(exc.error)
        except ClientGone:
            return CLIENT_GONE
        try:
            exchange = await prepare(body)
        except Refusal as exc:
            return await refuse(exc.error)
        except Exception as exc:  # InvalidRequest, or a store failing under the edge
            return await refuse(describe_failure(exc, "(not started)"))
        graph = exchange.graph
        model_name = exchange.model
        tenant = call.tenant
        if graph is None or model_name is None:
            try:
                model = self.models.resolve(model_name, tenant.may_use if tenant.models else None)
            except Refusal as exc:
                return await refuse(exc.error)
            model_name = model.name
            graph = model.graph if graph is None else graph
        call.model = model_name
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            return await refuse(draining())
        unavailable = None if self.health is None else self.health.refusal(model_name)
        if unavailable is not None:
            self.metrics.rejected.labels("engine_unavailable").inc()
            return await refuse(describe_failure(unavailable, "(not started)"))
        request = exchange.request
        if getattr(request, "priority", 0) is None:  # the API key's default, else 0
            request.priority = tenant.priority
        context = self._context_of(model_name)
        known, cost = estimate(request, len(body), context, tenant.limits.tokens_per_minute)
        time_limit = self.guard.timeout_for(scope, stream=exchange.stream)
        arrived = anyio.current_time()
        try:
            ticket = await self.admission.enter(
                tenant,
                receive,
                model=model_name,
                tokens=known,
                cost=cost,
                priority=priority_of(request),
                slot=True,
                time_limit=time_limit,
            )
        except Refusal as exc:
            return await refuse(exc.error)
        except ClientGone:
            return CLIENT_GONE
        status = 500
        try:
            status = await self._admitted(
                call, errors, exchange, graph, ticket, context, started, span, arrived, time_limit
            )
            return status
        finally:
            await ticket.settle(status, getattr(exchange.reply, "usage", None))

    async def _admitted(
        self,
        call: Call,
        errors: ErrorStyle,
        exchange: Exchange,
        graph: Engine[Any, Any],
        ticket: Ticket,
        context: int | None,
        started: float,
        span: Span | None,
        arrived: float,
        time_limit: float | None,
    ) -> int:
        """Run an admitted request (``ticket``), through its graph."""
        scope, receive, send = call.scope, call.receive, call.send
        model_name = ticket.model
        rates = ticket.rates

        async def refuse(error: ApiError, request_id: str | None = None) -> int:
            rendered = errors.render(error, request_id)
            headers = rendered.headers + rate_headers(errors, rates)
            await send_json(send, rendered.status, rendered.body, headers)
            return rendered.status

        try:
            request_id, metadata = request_identity(scope)
            if request_id is not None and any(c.id == request_id for c in self._contexts):
                raise InvalidRequest(
                    f"a request with x-request-id {request_id!r} is already in flight",
                    param="x-request-id",
                )
            conversation = conversation_key(metadata)
        except InvalidRequest as exc:
            return await refuse(ApiError("invalid_request", exc.message, param=exc.param))
        request = exchange.request
        if conversation is not None:
            _name_conversation(request, conversation)
        tracer = self.tracer
        ctx = Context.new(
            request,
            id=request_id,
            metadata=metadata,
            deadline=None if time_limit is None else arrived + time_limit,
            span=span if tracer is not None and tracer.stages else None,
        )
        if span is not None:
            record_request(
                span, request, ctx.id, model_name, exchange.response_id, stream=exchange.stream
            )
            record_admission(span, ticket.tenant.name, ticket.arrival, ticket.admission)
        self._contexts.add(ctx)
        status = CLIENT_GONE
        failed: BaseException | None = None

        def ended_by_server(ctx: Context[Any]) -> ApiError | None:
            return self._ended_by_server(ctx, time_limit)

        async def on_head(head: Any) -> None:
            prompt = getattr(head, "prompt_tokens", None)
            if isinstance(prompt, int):
                await ticket.reserve(prompt, request, context)

        def headers() -> tuple[tuple[bytes, bytes], ...]:
            return rate_headers(errors, ticket.rates)

        run = Running(
            graph=graph,
            ctx=ctx,
            send=send,
            reply=exchange.reply,
            errors=errors,
            started=started,
            metrics=self.metrics.for_model(model_name),
            ended_by_server=ended_by_server,
            span=span,
            on_head=on_head,
            headers=headers,
        )
        try:
            async with anyio.create_task_group() as watcher:
                watcher.start_soon(kill_on_disconnect, receive, ctx)
                try:
                    if exchange.stream:
                        state = StreamState()
                        if exchange.keep_alive is not None:
                            watcher.start_soon(
                                keep_alive,
                                send,
                                ctx,
                                state,
                                exchange.keep_alive.data,
                                exchange.keep_alive.interval,
                            )
                        status = await stream_response(run, state)
                    else:
                        status = await self._complete(run)
                except WriteFailed as exc:
                    failed = exc.__cause__  # re-raised below, not as part of a task group's
                finally:
                    watcher.cancel_scope.cancel()
        finally:
            self._contexts.discard(ctx)
            self._aborted.discard(ctx)
        if failed is not None:
            raise failed
        usage = getattr(exchange.reply, "usage", None)
        if span is not None and usage is not None:
            record_usage(span, usage, list(getattr(usage, "finish_reasons", ())))
        return status

    def _context_of(self, model: str) -> int | None:
        """The context length of the served model ``model`` (None: unknown)."""
        served = self.models.get(model)
        if served is None:
            return None
        preprocessor = served.preprocessor
        known = getattr(preprocessor, "max_model_len", None) if preprocessor is not None else None
        return known if isinstance(known, int) else served.context

    def _ended_by_server(self, ctx: Context[Any], time_limit: float | None) -> ApiError | None:
        """Why a killed request was killed, if the server did it; None when the client
        went away."""
        if ctx in self._aborted:
            return shut_down()
        deadline = ctx.deadline
        if time_limit is not None and deadline is not None and anyio.current_time() >= deadline:
            self.metrics.timed_out.inc()
            return timed_out(time_limit)
        return None

    async def _complete(self, run: Running) -> int:
        """Run the graph to the end and send the folded response as one JSON body."""
        ctx, send, reply, span = run.ctx, run.send, run.reply, run.span
        error: ApiError | None = None
        try:
            async with open_stream(run.graph, ctx) as stream:
                events: list[Any] = []
                async for head in stream:  # the first event (it may refuse the request)
                    if run.on_head is not None:
                        await run.on_head(head)
                    events.append(head)
                    break
                if span is None:
                    events.extend([event async for event in stream])
                else:  # (noting on the span when the first text came)
                    seen = False
                    for event in events:
                        seen = seen or reply.visible(event)
                    if seen:
                        record_first_token(span, run.started)
                    async for event in stream:
                        events.append(event)
                        if not seen and reply.visible(event):
                            seen = True
                            record_first_token(span, run.started)
            if not ctx.is_killed:
                body = await reply.body(events)
        except Exception as exc:
            if not ctx.is_killed:
                error = describe_failure(exc, ctx.id)
        if ctx.is_killed:
            error = run.ended_by_server(ctx)
            if error is None:
                return CLIENT_GONE
        if error is not None:
            rendered = run.errors.render(error, ctx.id)
            await send_json(send, rendered.status, rendered.body, rendered.headers + id_header(ctx))
            return rendered.status
        tokens = reply.output_tokens
        if tokens:
            run.metrics.output_tokens.inc(tokens)
        headers = id_header(ctx) if run.headers is None else id_header(ctx) + run.headers()
        await send_json(send, 200, body, headers)
        return 200


#: where a graph's request keeps its conversation: the OpenAI models' field, the token
#: request's (``PreprocessedRequest.affinity``: the tokens-in/tokens-out edge's)
_CONVERSATION_FIELDS = ("prompt_cache_key", "affinity")


def _name_conversation(request: Any, key: str) -> None:
    """The ``x-session-affinity`` header names ``request``'s conversation, unless its body
    did (every edge's: a request of any API carries it to the router)."""
    for field in _CONVERSATION_FIELDS:
        if hasattr(request, field):
            if getattr(request, field) is None:
                setattr(request, field, key)
            return
