"""The web UI's pages and ``/status``, in process (``build_app(ui=True)``, no browser)."""

from __future__ import annotations

import itertools
from typing import Any

import httpx
import pytest

from operators.edges.http.guard import Guard
from operators.engines import EchoEngine
from operators.engines.mocker import MockerEngine
from operators.serving import build_app
from operators.telemetry.engine_metrics import watch_prefill
from operators.text.tokenizer import Tokenizer
from operators.ui import UI_FILES
from pipeline import LeastLoaded, Router, WorkerSet

TOKENIZER = Tokenizer.default()


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://app")


def echo_app(**options: Any) -> Any:
    return build_app(EchoEngine.from_tokenizer(TOKENIZER), TOKENIZER, model_name="echo", **options)


async def chat(http: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        headers=headers,
    )


async def test_the_page_and_its_assets_are_served_with_a_strict_policy() -> None:
    async with client(echo_app(ui=True)) as http:
        for path, (_, content_type) in UI_FILES.items():
            response = await http.get(path)
            assert response.status_code == 200, path
            assert response.headers["content-type"] == content_type
            policy = response.headers["content-security-policy"]
            assert "default-src 'none'" in policy
            assert "script-src 'self'" in policy
            assert response.headers["x-content-type-options"] == "nosniff"
        page = (await http.get("/")).text
        assert '<script src="/ui/app.js"' in page
        assert "http://" not in page.replace("http://app", "")  # nothing from elsewhere
        head = await http.head("/")
        assert head.status_code == 200
        assert head.content == b""
        assert int(head.headers["content-length"]) > 0
        assert (await http.get("/ui/missing.js")).status_code == 404
        assert (await http.post("/")).status_code == 404


async def test_status_describes_the_server_and_the_last_requests() -> None:
    app = echo_app(ui=True)
    async with client(app) as http:
        assert (await chat(http, **{"x-request-id": "first"})).status_code == 200
        status = (await http.get("/status")).json()
    assert status["model"] == "echo"
    assert status["in_flight"] == 0
    assert status["waiting"] == 0
    assert status["requests_total"] == 1
    assert status["output_tokens_total"] == 3
    assert status["workers"] == [
        {"id": "EchoEngine", "role": "aggregated", "in_flight": 0, "where": "in-process"}
    ]
    assert status["tracing"] == {"recording": True, "exporting": None}
    (recent,) = status["recent"]
    assert recent["request_id"] == "first"
    assert recent["status"] == 200
    assert recent["completion_tokens"] == 3
    assert recent["ttft_ms"] > 0
    names = [span["name"] for span in recent["spans"]]
    assert names[0] == "POST /v1/chat/completions"
    assert {"preprocessor", "migration", "attempt", "backend", "engine"} <= set(names)
    depths = [span["depth"] for span in recent["spans"]]
    assert depths[0] == 0
    assert all(b <= a + 1 for a, b in itertools.pairwise(depths))
    for span in recent["spans"]:
        assert 0 <= span["start_ms"] <= recent["duration_ms"]


async def test_status_lists_worker_sets_by_role_and_the_kv_hit_rate() -> None:
    workers = WorkerSet(
        "decode",
        {
            f"m{i}": MockerEngine.from_tokenizer(
                TOKENIZER, worker_id=f"m{i}", decode_ms_per_step=0.1, cache_blocks=64
            )
            for i in range(2)
        },
    )
    app = build_app(Router(workers, LeastLoaded()), TOKENIZER, model_name="echo", ui=True)

    def prefill_counts() -> dict[str, tuple[int, int]]:  # as `serve` registers them
        counts = {}
        for worker in workers.members:
            stats = worker.engine.statistics()  # type: ignore[attr-defined]
            counts[worker.id] = (stats.prefill_tokens, stats.cached_prompt_tokens)
        return counts

    watch_prefill(app.metrics.registry, prefill_counts)
    async with client(app) as http:
        for _ in range(2):
            assert (await chat(http)).status_code == 200
        status = (await http.get("/status")).json()
    assert [(w["id"], w["role"]) for w in status["workers"]] == [
        ("m0", "aggregated"),
        ("m1", "aggregated"),
    ]
    assert status["kv"]["source"] == "engine"
    assert 0 < status["kv"]["hit_rate"] <= 1  # the second prompt's prefix was cached
    assert len(status["recent"]) == 2
    engines = [s for s in status["recent"][0]["spans"] if s["name"] == "engine"]
    assert engines[0]["worker"] in {"m0", "m1"}


async def test_with_api_keys_the_page_is_open_and_status_needs_a_key() -> None:
    app = echo_app(ui=True, guard=Guard(api_keys=("sesame",)))
    async with client(app) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert "echo" not in page.text  # the page says nothing about the server
        refused = await http.get("/status")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert (
            await http.get("/status", headers={"authorization": "Bearer nope"})
        ).status_code == 401
        allowed = await http.get("/status", headers={"authorization": "Bearer sesame"})
        assert allowed.status_code == 200
        assert allowed.json()["model"] == "echo"


@pytest.mark.parametrize("ui", [False, True])
async def test_without_the_ui_nothing_is_served_or_recorded(ui: bool) -> None:
    app = echo_app(ui=ui)
    async with client(app) as http:
        assert (await chat(http)).status_code == 200
        expected = 200 if ui else 404
        assert (await http.get("/")).status_code == expected
        assert (await http.get("/status")).status_code == expected
    assert (app.tracer is not None) is ui
