"""Bodies made from each edge's own schema, then broken, against all ten POST endpoints.

Hypothesis writes a body from the JSON schema of the endpoint's pydantic model (the
schema the server validates with), then mutates it: a value of the wrong JSON type at any
path, an extreme number, an object nested 300 deep, a huge array, invalid UTF-8, a key
given twice. Each goes to ``llm-pipeline serve --engine echo``. Whatever comes back is
never a 5xx; a 4xx is in the API's own shape (OpenAI's ``{"error": {...}}``, Anthropic's
``{"type": "error", ...}``) and, for a body that is a JSON object, names a field (one the
body has, or a required one it lacks: OpenAI's ``param``; Anthropic names it in its
message). The examples are derandomized
and few, so CI runs the same ones in seconds.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from operators.edges.anthropic.protocol import CountTokensRequest, MessagesRequest
from operators.edges.openai.embeddings import EmbeddingRequest
from operators.edges.openai.lora import LoadLoraRequest, UnloadLoraRequest
from operators.edges.openai.protocol import ChatCompletionRequest, CompletionRequest
from operators.edges.openai.tokenize import DetokenizeRequest, TokenizeRequest
from operators.edges.responses.protocol import ResponsesRequest
from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

#: every POST endpoint, and the model its bodies are validated with
ENDPOINTS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/load_lora_adapter": LoadLoraRequest,
    "/v1/unload_lora_adapter": UnloadLoraRequest,
}
ANTHROPIC = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
#: headers a 4xx may name instead of a field
HEADERS = frozenset({"content-type", "x-request-id", "anthropic-version"})

EXTREMES = [0, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**53 + 1, 2**63, 2**64, -(2**64), 10**30,
            1e308, -1e308, 5e-324, 0.5]  # fmt: skip
#: a value of every JSON type, for "the wrong type" (the right one is skipped by the test)
ANY_TYPE = [None, True, 7, 2.5, "x", [], {}, [[[]]], {"a": {"b": []}}]


# ------------------------------------------------------------------ schema -> strategy


def from_schema(schema: dict[str, Any], defs: dict[str, Any], depth: int = 0) -> Any:
    """A strategy for the JSON values ``schema`` describes (the subset pydantic writes)."""
    if "$ref" in schema:
        return from_schema(defs[schema["$ref"].rsplit("/", 1)[1]], defs, depth)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([from_schema(option, defs, depth) for option in schema[key]])
    kind = schema.get("type")
    if kind == "object":
        return _object(schema, defs, depth)
    if kind == "array":
        items = schema.get("items", {})
        least = schema.get("minItems", 0)
        inner = from_schema(items, defs, depth + 1) if items else _free(depth)
        return st.lists(inner, min_size=least, max_size=max(least, 3 if depth < 3 else 1))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0), max_size=8)
    if kind == "integer":
        low, high = schema.get("minimum", -10), schema.get("maximum", 100)
        low = schema.get("exclusiveMinimum", low - 1) + 1 if "exclusiveMinimum" in schema else low
        return st.integers(min_value=low, max_value=min(high, low + 100))
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum", -5)),
            max_value=schema.get("maximum", 5),
            allow_nan=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return _free(depth)


def _object(schema: dict[str, Any], defs: dict[str, Any], depth: int) -> Any:
    properties = schema.get("properties")
    if properties is None:  # free form (a schema, a tool call's input)
        return st.dictionaries(st.text(max_size=4), _free(depth + 1), max_size=3)
    required = set(schema.get("required", ()))
    fields = {
        name: from_schema(sub, defs, depth + 1)
        for name, sub in properties.items()
        if depth < 4 or name in required
    }
    return st.fixed_dictionaries(
        {name: fields[name] for name in fields if name in required},
        optional={name: fields[name] for name in fields if name not in required},
    )


def _free(depth: int) -> Any:
    leaves = st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4)
    if depth > 3:
        return leaves
    return st.recursive(
        leaves,
        lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner),
        max_leaves=4,
    )


def strategy_for(model: type[BaseModel]) -> Any:
    schema = model.model_json_schema(by_alias=True)
    return from_schema(schema, schema.get("$defs", {}))


STRATEGIES = {path: strategy_for(model) for path, model in ENDPOINTS.items()}


# ----------------------------------------------------------------------------- mutations


def paths(value: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """Every path into ``value`` (keys and indexes), the value's own first."""
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from paths(item, (*prefix, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from paths(item, (*prefix, index))


def replaced(value: Any, path: tuple[Any, ...], new: Any) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {**value, head: replaced(value[head], rest, new)}
    copy = list(value)
    copy[head] = replaced(value[head], rest, new)
    return copy


def dumps(value: Any) -> bytes:
    """JSON, integers of any size included (orjson stops at 64 bits)."""
    return json.dumps(value, ensure_ascii=False).encode()


DEEP_MARK = "\x01deep\x01"
DEEP_TEXT = b'{"a":' * 300 + b"{}" + b"}" * 300


@st.composite
def bodies(draw: st.DrawFn, path: str) -> tuple[bytes, dict[str, Any] | None]:
    """(the body's bytes, the object it is, when it is one)."""
    body: dict[str, Any] = draw(STRATEGIES[path])
    if "model" in body or path in ANTHROPIC:
        body["model"] = draw(st.sampled_from(["echo", "echo", "echo", "nope"]))
    how = draw(
        st.sampled_from(["none", "type", "type", "extreme", "deep", "huge", "utf8", "duplicate"])
    )
    where = draw(st.sampled_from([p for p in paths(body) if p]) if len(body) else st.just(()))
    if how == "type" and where:
        body = replaced(body, where, draw(st.sampled_from(ANY_TYPE)))
    elif how == "extreme" and where:
        body = replaced(body, where, draw(st.sampled_from(EXTREMES)))
    elif how == "deep" and where:
        body = replaced(body, where, DEEP_MARK)
    elif how == "huge" and where:
        body = replaced(body, where, [0] * 20_000)
    raw = dumps(body).replace(dumps(DEEP_MARK), DEEP_TEXT)
    if how == "utf8":
        return raw.replace(b"{", b'{"\xff\xfe":1,', 1), None
    if how == "duplicate" and body:
        key = next(iter(body))
        return raw.replace(b"{", b"{" + dumps(key) + b":[[1]],", 1), body
    return raw, body


# --------------------------------------------------------------------------------- test


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess("--engine", "echo")
    yield process
    process.stop()


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def check(path: str, response: httpx.Response, body: dict[str, Any] | None) -> None:
    status = response.status_code
    fields = {*(body or ()), *ENDPOINTS[path].model_fields, *HEADERS}  # (a missing one too)
    assert status < 500, (status, response.text[:500])
    if status < 400:
        return
    answer = response.json()
    if path in ANTHROPIC:
        assert answer["type"] == "error", answer
        assert set(answer["error"]) == {"type", "message"}
        named = answer["error"]["message"]
        if body is not None and status == 400:
            assert any(str(key) in named for key in fields), named
        return
    error = answer["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error"
    if body is not None and status == 400:
        param = error["param"]
        assert param is not None, error
        assert param.split(".")[0] in fields, error


@pytest.mark.time_limit(240)
@pytest.mark.parametrize("path", sorted(ENDPOINTS))
def test_a_body_from_the_schema_broken_anywhere_is_never_a_5xx(
    http: httpx.Client, path: str
) -> None:
    @settings(
        max_examples=25,
        derandomize=True,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(bodies(path))
    def run(made: tuple[bytes, dict[str, Any] | None]) -> None:
        raw, body = made
        response = http.post(path, content=raw, headers={"content-type": "application/json"})
        check(path, response, body)

    run()
