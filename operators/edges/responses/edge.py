"""The Responses API's routes: :class:`ResponsesEdge`.

::

    POST   /v1/responses                        ResponsesRequest (+ the stored conversation)
                                                  --[chat request]--> graph --> ResponsesReply
    GET    /v1/responses/{response_id}          the stored response
    DELETE /v1/responses/{response_id}          forget it
    GET    /v1/responses/{response_id}/input_items   the items that produced it (paginated)

A stored response belongs to the API key that created it (:meth:`~operators.edges.http.
guard.Guard.owner`): for another key it does not exist (404, as for an unknown or deleted
id, or one that expired). ``previous_response_id`` naming such an id is a 404 naming
``previous_response_id``. A conversation too large for the store (``store: true``, the
default) is refused before anything is generated: a 400 naming ``input``. Errors are
OpenAI's (:data:`~operators.edges.openai.errors.OPENAI_ERRORS`), with the graph's field
names put back into this API's: a prompt too long for the context names ``input``, an
output limit that does not fit ``max_output_tokens``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Final, final
from urllib.parse import parse_qs

import orjson

from operators.edges.http.asgi import send_json
from operators.edges.http.failures import ApiError, Refusal, Rendered, Rewording
from operators.edges.http.routes import Call, Exchange, Host, Route, resolve_model
from operators.edges.openai.errors import OPENAI_ERRORS
from pipeline import InvalidRequest

from .conversation import chat_request, input_items
from .protocol import FunctionTool, NamedFunctionChoice, ResponsesRequest, parse_responses_request
from .render import ResponseRenderer
from .reply import ResponsesReply
from .store import MemoryResponseStore, ResponseStore, StoredResponse

if TYPE_CHECKING:
    from collections.abc import Mapping

    from operators.edges.http.limits import Rates
    from operators.edges.http.models import ServedModel

__all__ = ("RESPONSES", "ResponsesEdge", "ResponsesErrors", "response_shell", "translate")

RESPONSES: Final = "/v1/responses"
#: the most items one input_items page holds (OpenAI's bound), and the default
_MAX_PAGE: Final = 100
_DEFAULT_PAGE: Final = 20
#: the graph's field names -> this API's
_PARAMS: Final[Mapping[str, str]] = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "reasoning_effort": "reasoning.effort",
}
#: ... and in messages
_REWORD: Final = Rewording(
    {**_PARAMS, "response_format": "text.format"},
    {"the messages": "the input", "the prompt": "the input"},
)


def translate(error: ApiError) -> ApiError:
    """``error`` with the field it blames named as this API names it, in ``param`` and in
    its message."""
    param = error.param
    named = param
    if param is not None:
        head, _, rest = param.partition(".")
        if head == "response_format":  # response_format.json_schema.schema -> text.format.schema
            rest = rest.removeprefix("json_schema").removeprefix(".")
            named = f"text.format.{rest}" if rest else "text.format"
        elif head in _PARAMS:
            named = _PARAMS[head]
    message = _REWORD(error.message)
    if named == param and message == error.message:
        return error
    return ApiError(
        error.kind, message, named, error.code, error.retry_after, error.allow, error.rates
    )


@final
class ResponsesErrors:
    """OpenAI's error style, naming this API's fields."""

    __slots__ = ()

    def render(self, error: ApiError, request_id: str | None = None) -> Rendered:
        """See :meth:`operators.edges.openai.errors.OpenAIErrors.render`."""
        return OPENAI_ERRORS.render(translate(error), request_id)

    def rate_headers(self, rates: Rates) -> tuple[tuple[bytes, bytes], ...]:
        """OpenAI's (:meth:`operators.edges.openai.errors.OpenAIErrors.rate_headers`)."""
        return OPENAI_ERRORS.rate_headers(rates)


_ERRORS: Final = ResponsesErrors()


def _not_found(response_id: str, param: str) -> Refusal:
    return Refusal(
        ApiError("not_found", f"No response found with id '{response_id}'.", param=param)
    )


def _text_config(request: ResponsesRequest) -> dict[str, Any]:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type != "json_schema":
        return {"format": {"type": "text" if fmt is None else fmt.type}, "verbosity": "medium"}
    spec: dict[str, Any] = {"type": "json_schema", "name": fmt.name, "schema": fmt.schema_}
    if fmt.description is not None:
        spec["description"] = fmt.description
    spec["strict"] = fmt.strict
    return {"format": spec, "verbosity": "medium"}


def _tool(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "function",
        "name": tool.name,
        "description": tool.description,
        "parameters": tool.parameters,
        "strict": tool.strict,
    }


def response_shell(request: ResponsesRequest, response_id: str, model: str) -> dict[str, Any]:
    """The response object's fields that do not depend on the answer."""
    choice = request.tool_choice
    effort = request.reasoning.effort if request.reasoning is not None else None
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "background": False,
        "error": None,
        "incomplete_details": None,
        "instructions": request.instructions,
        "max_output_tokens": request.max_output_tokens,
        "max_tool_calls": None,
        "model": model,
        "output": [],
        "parallel_tool_calls": request.parallel_tool_calls is not False,
        "previous_response_id": request.previous_response_id,
        "reasoning": {"effort": effort, "summary": None},  # (no summaries are made)
        "service_tier": "default",
        "store": request.store,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "text": _text_config(request),
        "tool_choice": (
            {"type": "function", "name": choice.name}
            if isinstance(choice, NamedFunctionChoice)
            else (choice or "auto")
        ),
        "tools": [_tool(tool) for tool in request.tools or ()],
        "top_logprobs": request.top_logprobs or 0,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "truncation": request.truncation or "disabled",
        "usage": None,
        "user": request.user,
        "metadata": request.metadata or {},
    }


@final
class ResponsesEdge:
    """OpenAI's Responses API over the app's graph, its responses kept in ``store``.

    Args:
        store: where responses live (an in-memory store of the default size if None).
    """

    def __init__(self, store: ResponseStore | None = None) -> None:
        #: where responses live
        self.store: ResponseStore = MemoryResponseStore() if store is None else store

    async def load(
        self, response_id: str, owner: str, *, param: str, host: Host | None = None
    ) -> StoredResponse:
        """The stored response ``response_id`` of ``owner`` (decoded off the event loop
        through ``host`` when it is large).

        Raises:
            Refusal: 404 naming ``param``: unknown, deleted, expired, or another owner's.
        """
        data = await self.store.get(response_id)
        if data is None:
            raise _not_found(response_id, param)
        if host is None:
            record = StoredResponse.decode(data)
        else:
            record = await host.offload(len(data), StoredResponse.decode, data)
        if record.owner != owner:
            raise _not_found(response_id, param)
        return record

    def _exchange(
        self,
        request: ResponsesRequest,
        earlier: list[dict[str, Any]],
        owner: str,
        model: ServedModel,
    ) -> Exchange:
        """What the graph runs for ``request`` after the ``earlier`` conversation (linear in
        their size: the edge runs it off the event loop when they are large).

        Raises:
            InvalidRequest: the conversation would not fit the store (naming ``input``).
        """
        id_hex = uuid.uuid4().hex
        conversation = [*earlier, *input_items(request, id_hex)]
        if request.store:
            self._check_fits(conversation)
        shell = response_shell(request, f"resp_{id_hex}", request.model or model.name)
        renderer = ResponseRenderer(shell, stream=request.stream, logprobs=request.logprobs)
        reply = ResponsesReply(
            renderer,
            store=self.store,
            owner=owner,
            input_items=conversation if request.store else None,
            translate=translate,
        )
        return Exchange(
            chat_request(request, conversation),
            request.stream,
            reply,
            response_id=shell["id"],
            graph=model.graph,
            model=model.name,
        )

    def _check_fits(self, conversation: list[dict[str, Any]]) -> None:
        """Refuse a conversation whose record the store could not hold, before generating
        (the SDKs retry a 500: a response generated and then not stored would be
        generated three times)."""
        limit: int | None = getattr(self.store, "max_record_bytes", None)
        if limit is None:
            return
        size = len(orjson.dumps(conversation))
        if size > limit:
            raise InvalidRequest(
                f"the conversation ({size} bytes of input items) is larger than the response "
                f"store holds ({limit} bytes): send a shorter input, or 'store': false",
                param="input",
            )

    def routes(self, host: Host) -> list[Route]:
        """The Responses routes on ``host``."""

        async def create(call: Call) -> int:
            async def prepare(body: bytes) -> Exchange:
                size = len(body)
                request = await host.offload(size, parse_responses_request, body)
                model = resolve_model(call, request.model, host)
                earlier: list[dict[str, Any]] = []
                if request.previous_response_id is not None:
                    previous = await self.load(
                        request.previous_response_id,
                        call.owner,
                        param="previous_response_id",
                        host=host,
                    )
                    earlier = previous.conversation
                    size += previous.size
                return await host.offload(size, self._exchange, request, earlier, call.owner, model)

            return await host.generate(call, prepare, _ERRORS, route=RESPONSES)

        async def respond(call: Call, status: int, body: bytes) -> int:
            await send_json(call.send, status, body)
            return status

        async def refuse(call: Call, error: ApiError) -> int:
            rendered = _ERRORS.render(error)
            await send_json(call.send, rendered.status, rendered.body, rendered.headers)
            return rendered.status

        async def retrieve(call: Call) -> int:
            response_id = call.params["response_id"]
            query = parse_qs(call.query.decode("latin-1"))
            if query.get("stream", ["false"])[-1].lower() == "true":
                return await refuse(
                    call,
                    ApiError(
                        "invalid_request",
                        "streaming a stored response again is not supported",
                        param="stream",
                    ),
                )
            try:
                record = await self.load(response_id, call.owner, param="response_id", host=host)
            except Refusal as exc:
                return await refuse(call, exc.error)
            return await respond(call, 200, orjson.dumps(record.response))

        async def delete(call: Call) -> int:
            response_id = call.params["response_id"]
            try:
                await self.load(response_id, call.owner, param="response_id")
            except Refusal as exc:
                return await refuse(call, exc.error)
            await self.store.delete(response_id)
            body = {"id": response_id, "object": "response", "deleted": True}
            return await respond(call, 200, orjson.dumps(body))

        async def list_input_items(call: Call) -> int:
            response_id = call.params["response_id"]
            try:
                page = _page_query(call.query)
                record = await self.load(response_id, call.owner, param="response_id", host=host)
            except Refusal as exc:
                return await refuse(call, exc.error)
            listed = await host.offload(record.size, _page, record.input_items, *page)
            return await respond(call, 200, orjson.dumps(listed))

        one = f"{RESPONSES}/{{response_id}}"
        return [
            Route(RESPONSES, frozenset({"POST"}), create, _ERRORS),
            Route(one, frozenset({"GET"}), retrieve, _ERRORS, label=one),
            Route(one, frozenset({"DELETE"}), delete, _ERRORS, label=one),
            Route(f"{one}/input_items", frozenset({"GET"}), list_input_items, _ERRORS),
        ]


def _page_query(query: bytes) -> tuple[int, str, str | None, str | None]:
    """(limit, order, after, before) of an input_items request.

    Raises:
        Refusal: a limit outside 1..100 or an order other than asc/desc.
    """
    values = parse_qs(query.decode("latin-1"))

    def last(name: str) -> str | None:
        found = values.get(name)
        return found[-1] if found else None

    raw_limit = last("limit")
    try:
        limit = _DEFAULT_PAGE if raw_limit is None else int(raw_limit)
    except ValueError:
        limit = 0
    if not 1 <= limit <= _MAX_PAGE:
        raise Refusal(ApiError("invalid_request", f"limit must be 1 to {_MAX_PAGE}", param="limit"))
    order = last("order") or "desc"
    if order not in ("asc", "desc"):
        raise Refusal(ApiError("invalid_request", "order must be 'asc' or 'desc'", param="order"))
    return limit, order, last("after"), last("before")


def _page(
    items: list[dict[str, Any]], limit: int, order: str, after: str | None, before: str | None
) -> dict[str, Any]:
    """One page of ``items`` (oldest first) in ``order``, after/before the named ids."""
    ordered = items if order == "asc" else items[::-1]
    ids = [item.get("id") for item in ordered]
    start = ids.index(after) + 1 if after in ids else 0
    end = ids.index(before) if before in ids else len(ordered)
    window = ordered[start:end]
    page = window[:limit]
    return {
        "object": "list",
        "data": page,
        "first_id": page[0].get("id") if page else None,
        "last_id": page[-1].get("id") if page else None,
        "has_more": len(window) > limit,
    }
