"""A generation request's life, the same for every edge: :class:`Generations`.

An edge only says how its API's body becomes a graph request and how the graph's events
become its API's response (an :class:`~.routes.Exchange` carrying a
:class:`~.routes.Reply`). Everything else happens here, once, for chat completions,
Responses, Messages and a user's own edge (``host.generate(call, prepare, errors)``)::

    read the body (bounded: 413)        -> edge: prepare(body) -> Exchange   (400, 404, ...)
                                           (its model resolved: its graph, :mod:`.models`)
    draining? (503)  at max_inflight? (admission: the edge says 503 or 529)
    no engine of its model can answer? (503 engine_unavailable, Retry-After: pipeline.health)
    no priority given? the API key's default (Guard)
    x-request-id (unique in flight), the deadline (Guard), a Context
    run the graph under open_stream, a watcher task killing it when the client leaves
        stream:  the reply renders each event; sse_writer decides when bytes leave
        whole:   the reply folds the events into one body
    a kill by the server (deadline: timeout, drain's abort: unavailable) or a failure
        -> the edge's ErrorStyle (before any byte) or the reply's failure event (after)

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

from .asgi import (
    BodyTooLarge,
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
    at_capacity,
    body_too_large,
    describe_failure,
    draining,
    shut_down,
    timed_out,
)
from .request_span import (
    finish_request,
    record_first_token,
    record_request,
    record_usage,
    start_request,
)
from .running import Running
from .sse_writer import CLIENT_GONE, StreamState, WriteFailed, keep_alive, stream_response

if TYPE_CHECKING:
    from pipeline.health import Health
    from pipeline.tracing import Span, Tracer

    from .guard import Guard
    from .metrics import ServerMetrics
    from .models import Models
    from .routes import Call, Prepare

__all__ = ("Generations",)


@final
class Generations:
    """The generation requests in flight, and the rules they all run under.

    Args:
        models: the models served: an exchange runs on its model's graph (unless
            it brings its own), the default model's when it names none.
        guard: admission control, deadlines, and the API keys' default priorities (keys
            are checked before dispatch).
        metrics: in-flight gauge, durations, tokens, rejections, timeouts.
        max_body_bytes: larger bodies get a 413.
        tracer: traces every generation request (None: none is traced, nothing is done).
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
        health: Health | None = None,
    ) -> None:
        self.models = models
        self.health = health
        self.guard = guard
        self.metrics = metrics
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
        error (a stream's failure event, or a whole response's error body)."""
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
        if graph is None or model_name is None:
            try:
                model = self.models.resolve(model_name)
            except Refusal as exc:
                return await refuse(exc.error)
            model_name = model.name
            graph = model.graph if graph is None else graph
        call.model = model_name
        metrics = self.metrics.for_model(model_name)
        if self.draining:
            self.metrics.rejected.labels("draining").inc()
            return await refuse(draining())
        limit = self.guard.max_inflight
        if limit is not None and len(self._contexts) >= limit:
            self.metrics.rejected.labels("max_inflight").inc()
            return await refuse(at_capacity(limit))
        unavailable = None if self.health is None else self.health.refusal(model_name)
        if unavailable is not None:
            self.metrics.rejected.labels("engine_unavailable").inc()
            return await refuse(describe_failure(unavailable, "(not started)"))
        try:
            request_id, metadata = request_identity(scope)
            if request_id is not None and any(c.id == request_id for c in self._contexts):
                raise InvalidRequest(
                    f"a request with x-request-id {request_id!r} is already in flight",
                    param="x-request-id",
                )
        except InvalidRequest as exc:
            return await refuse(ApiError("invalid_request", exc.message, param=exc.param))
        time_limit = self.guard.timeout_for(scope, stream=exchange.stream)
        request = exchange.request
        if getattr(request, "priority", 0) is None:  # the API key's default, else 0
            request.priority = self.guard.priority_for(scope)
        tracer = self.tracer
        ctx = Context.new(
            exchange.request,
            id=request_id,
            metadata=metadata,
            deadline=None if time_limit is None else anyio.current_time() + time_limit,
            span=span if tracer is not None and tracer.stages else None,
        )
        if span is not None:
            record_request(span, exchange.request, ctx.id, model_name, exchange.response_id)
        self._contexts.add(ctx)
        status = CLIENT_GONE
        failed: BaseException | None = None

        def ended_by_server(ctx: Context[Any]) -> ApiError | None:
            return self._ended_by_server(ctx, time_limit)

        run = Running(
            graph=graph,
            ctx=ctx,
            send=send,
            reply=exchange.reply,
            errors=errors,
            started=started,
            metrics=metrics,
            ended_by_server=ended_by_server,
            span=span,
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
                if span is None:
                    events = [event async for event in stream]
                else:  # (noting on the span when the first text came)
                    events = []
                    seen = False
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
        await send_json(send, 200, body, id_header(ctx))
        return 200
