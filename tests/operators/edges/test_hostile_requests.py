"""The hostile requests of issue 34, each against ``llm-pipeline serve --engine echo``.

Wrong JSON types and deep free-form JSON are 400s naming the field on every edge; a body
that is not ``application/json`` is a 415 (what a web page could make a browser send
without asking); CORS answers only the origins allowed; a Responses conversation too large
for the store is refused before anything is generated; headers over the bound get a 431
and the connection closes; a ``lora_path`` with a NUL byte is a 400; each API key sees
only its own requests in the status view, an admin key all of them. (The stalls are
``test_large_bodies.py``'s; the store's fair shares ``responses/test_responses_store.py``'s.)
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import orjson
import pytest

from tests.helpers.server_process import ServerProcess

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}
USER = [{"role": "user", "content": "hi"}]
ORIGIN = "https://app.example"
#: every POST endpoint, and a body it accepts
ENDPOINTS = {
    "/v1/chat/completions": {"model": "echo", "messages": USER, "max_tokens": 2},
    "/v1/completions": {"model": "echo", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "echo", "input": "hi", "max_output_tokens": 2},
    "/v1/messages": {"model": "echo", "messages": USER, "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "echo", "messages": USER},
    "/v1/embeddings": {"model": "echo", "input": "hi"},
    "/tokenize": {"model": "echo", "prompt": "hi"},
    "/detokenize": {"model": "echo", "tokens": [1, 2]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nowhere"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--engine", "echo", "--responses-store-mb", "1", "--allowed-origins", ORIGIN,
        "--max-header-bytes", "16384",
    )  # fmt: skip
    yield process
    process.stop()


@pytest.fixture(scope="module")
def keyed() -> Iterator[ServerProcess]:
    process = ServerProcess(
        "--engine", "echo", "--api-key", "key-a", "--api-key", "key-b", "--admin-api-key", "boss"
    )  # fmt: skip
    yield process
    process.stop()


def named(response: httpx.Response) -> str:
    """The field a 4xx names: OpenAI's ``param``, or Anthropic's message (which names it)."""
    body = response.json()
    if body.get("type") == "error":
        return str(body["error"]["message"])
    return str(body["error"]["param"])


def dumps(body: Any) -> bytes:
    """``body`` as JSON, with the string "DEEP" anywhere in it an object 300 levels deep
    (deeper than orjson itself writes)."""
    return orjson.dumps(body).replace(b'"DEEP"', b'{"a":' * 300 + b"{}" + b"}" * 300)


async def post(server: ServerProcess, path: str, body: Any, **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        return await http.post(path, content=dumps(body), headers=JSON | headers)


# -- 1. a wrong type is a 400 naming the field, on every edge -------------------------------

WRONG_TYPES = [
    ("/v1/responses", {"model": "echo", "input": "hi", "tools": 5}, "tools"),
    ("/v1/messages", {"model": "echo", "max_tokens": 5, "messages": USER, "tools": True}, "tools"),
    ("/v1/messages/count_tokens", {"model": "echo", "messages": USER, "tools": True}, "tools"),
    ("/v1/chat/completions", {"messages": USER, "tools": 5}, "tools"),
    ("/v1/completions", {"prompt": True}, "prompt"),
    ("/v1/embeddings", {"input": {"a": 1}}, "input"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": "x"}, "tokens"),
    ("/v1/load_lora_adapter", {"lora_name": 5, "lora_path": "/x"}, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": []}, "lora_name"),
    ("/v1/responses", {"model": "echo", "input": "hi", "tool_choice": {"type": 5}}, "tool_choice"),
    ("/v1/messages", {"model": "echo", "max_tokens": 5, "messages": USER, "thinking": 5},
     "thinking"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), WRONG_TYPES)
async def test_a_wrong_type_is_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = await post(server, path, body)
    assert response.status_code == 400, response.text
    assert param in named(response)


# -- 2. deep JSON is a 400 naming the field -------------------------------------------------


def deep(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


DEEP = "DEEP"
CHAT_TOOL = {"type": "function", "function": {"name": "f", "parameters": DEEP}}
USE = {"type": "tool_use", "id": "t", "name": "f", "input": DEEP}
DEEP_BODIES = [
    ("/v1/chat/completions", {"messages": USER, "tools": [CHAT_TOOL]},
     "tools.0.function.parameters"),
    ("/v1/responses",
     {"model": "echo", "input": "hi",
      "tools": [{"type": "function", "name": "f", "parameters": DEEP}]},
     "tools.0.parameters"),
    ("/v1/responses",
     {"model": "echo", "input": [{"type": "reasoning", "summary": [DEEP]}, *USER]},
     "input.0.summary.0"),
    ("/v1/messages",
     {"model": "echo", "max_tokens": 5, "messages": USER,
      "tools": [{"name": "f", "input_schema": DEEP}]},
     "tools.0.input_schema"),
    ("/v1/messages/count_tokens",
     {"model": "echo", "messages": [{"role": "assistant", "content": [USE]}, *USER]},
     "messages.0.content.0.input"),
    ("/tokenize", {"messages": USER, "tools": [CHAT_TOOL]}, "tools.0"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), DEEP_BODIES)
async def test_deep_json_is_a_400_naming_the_field(
    server: ServerProcess, path: str, body: dict[str, Any], param: str
) -> None:
    response = await post(server, path, body)
    assert response.status_code == 400, response.text
    assert param in named(response)
    assert "deeper than 64" in response.text


@pytest.mark.parametrize(("levels", "status"), [(63, 200), (64, 400)])
async def test_free_form_json_may_nest_64_levels(
    server: ServerProcess, levels: int, status: int
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": deep(levels)}}
    body = {"messages": USER, "tools": [tool], "max_tokens": 2}
    response = await post(server, "/v1/chat/completions", body)  # 64 levels: deep(63)
    assert response.status_code == status, response.text


# -- 3. only JSON is acted on; CORS only for the origins allowed ----------------------------

NOT_JSON = [
    {"content-type": "text/plain"},
    {"content-type": "application/x-www-form-urlencoded"},
    {"content-type": "multipart/form-data; boundary=x"},
    {},  # none at all
]


@pytest.mark.parametrize("path", sorted(ENDPOINTS))
@pytest.mark.parametrize("headers", NOT_JSON, ids=["text", "form", "multipart", "none"])
async def test_a_body_that_is_not_json_is_a_415(
    server: ServerProcess, path: str, headers: dict[str, str]
) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        response = await http.post(path, content=orjson.dumps(ENDPOINTS[path]), headers=headers)
    assert response.status_code == 415, response.text
    assert "content-type" in named(response)


async def test_json_with_a_charset_is_json(server: ServerProcess) -> None:
    body = ENDPOINTS["/v1/chat/completions"]
    response = await post(
        server, "/v1/chat/completions", body, **{"content-type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200, response.text


async def test_cors_answers_the_allowed_origin_only(server: ServerProcess) -> None:
    preflight = {
        "origin": ORIGIN,
        "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type",
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
        allowed = await http.options("/v1/chat/completions", headers=preflight)
        assert allowed.status_code == 204
        assert allowed.headers["access-control-allow-origin"] == ORIGIN
        assert "POST" in allowed.headers["access-control-allow-methods"]
        assert allowed.headers["access-control-allow-headers"] == "authorization, content-type"
        other = await http.options(
            "/v1/chat/completions", headers=preflight | {"origin": "https://evil.example"}
        )
        assert other.status_code != 204
        assert "access-control-allow-origin" not in other.headers
        body = orjson.dumps(ENDPOINTS["/v1/chat/completions"])
        served = await http.post(
            "/v1/chat/completions", content=body, headers=JSON | {"origin": ORIGIN}
        )
        assert served.status_code == 200
        assert served.headers["access-control-allow-origin"] == ORIGIN
        refused = await http.post(
            "/v1/chat/completions", content=body, headers=JSON | {"origin": "https://evil.example"}
        )
        assert "access-control-allow-origin" not in refused.headers


async def test_cors_is_off_without_allowed_origins(keyed: ServerProcess) -> None:
    preflight = {"origin": ORIGIN, "access-control-request-method": "POST"}
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        response = await http.options("/v1/chat/completions", headers=preflight)
    assert response.status_code != 204
    assert "access-control-allow-origin" not in response.headers


# -- 4. a conversation too large for the store is refused before generating -----------------


def output_tokens(metrics: str) -> float:
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("llm_pipeline_output_tokens_total")
    )


async def test_a_response_too_large_to_store_is_refused_before_generating(
    server: ServerProcess,
) -> None:
    big = "x" * (1_200_000)
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        before = output_tokens((await http.get("/metrics")).text)
        body = orjson.dumps({"model": "echo", "input": big, "max_output_tokens": 5})
        response = await http.post("/v1/responses", content=body, headers=JSON)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "input"
        assert "'store': false" in response.json()["error"]["message"]
        assert output_tokens((await http.get("/metrics")).text) == before  # nothing generated
        unstored = orjson.dumps(
            {"model": "echo", "input": big, "max_output_tokens": 5, "store": False}
        )
        assert (await http.post("/v1/responses", content=unstored, headers=JSON)).is_success


# -- 6. headers over the bound: 431, and the connection closes ------------------------------


def raw_request(server: ServerProcess, header_bytes: int) -> tuple[bytes, bool]:
    """A GET /health with a header of ``header_bytes``: (what came back, whether the server
    closed the connection)."""
    address = urlsplit(server.url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        request = b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * header_bytes + b"\r\n\r\n"
        try:
            sock.sendall(request)
        except (BrokenPipeError, ConnectionResetError):  # closed while we still sent
            pass
        received = b""
        closed = False
        while True:
            try:
                chunk = sock.recv(65536)
            except ConnectionResetError:
                closed = True
                break
            except TimeoutError:
                break
            if not chunk:
                closed = True
                break
            received += chunk
            if b"\r\n\r\n" in received and b"431" not in received.split(b"\r\n", 1)[0]:
                break  # a whole response to a request that was served: keep-alive
        return received, closed


def test_headers_over_the_bound_get_a_431_and_the_connection_closes(
    server: ServerProcess,
) -> None:
    received, closed = raw_request(server, 64 * 1024 * 1024)
    assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    assert b'"param":"headers"' in received
    assert closed


def test_headers_under_the_bound_are_served(server: ServerProcess) -> None:
    received, _ = raw_request(server, 8 * 1024)
    assert received.startswith(b"HTTP/1.1 200 "), received[:200]


# -- 7. lora_path with a NUL byte -----------------------------------------------------------


async def test_a_lora_path_with_a_nul_byte_is_a_400_naming_it(server: ServerProcess) -> None:
    body = {"lora_name": "a", "lora_path": "/adapters/a\x00.gguf"}
    response = await post(server, "/v1/load_lora_adapter", body)
    assert response.status_code == 400
    assert named(response) == "lora_path"


# -- 8. each key sees only its own requests in the status view ------------------------------


async def test_a_key_sees_its_own_requests_and_an_admin_key_all(keyed: ServerProcess) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=30) as http:
        for key in ("key-a", "key-b"):
            response = await http.post(
                "/v1/chat/completions",
                content=orjson.dumps(ENDPOINTS["/v1/chat/completions"]),
                headers=JSON | {"authorization": f"Bearer {key}", "x-request-id": f"by-{key}"},
            )
            assert response.status_code == 200

        async def recent(key: str) -> set[str]:
            status = await http.get("/status", headers={"authorization": f"Bearer {key}"})
            assert status.status_code == 200
            return {request["request_id"] for request in status.json()["recent"]}

        assert await recent("key-a") == {"by-key-a"}
        assert await recent("key-b") == {"by-key-b"}
        assert await recent("boss") == {"by-key-a", "by-key-b"}
        assert (await http.get("/status")).status_code == 401
