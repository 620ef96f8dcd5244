"""What the router tests over HTTP share: the command line parsed as ``serve`` parses it,
an in-process app of it, and ``/metrics`` read as per-worker samples."""

from __future__ import annotations

import argparse

import httpx
from prometheus_client.parser import text_string_to_metric_families

from operators import cli
from operators.edges.http.metrics import ServerMetrics
from operators.edges.openai.server import OpenAIApp
from operators.text.tokenizer import Tokenizer

__all__ = ("TOKENIZER", "Samples", "app_for", "changed", "parse", "scrape")

TOKENIZER = Tokenizer.default()

Samples = dict[tuple[str, str], float]


def parse(*argv: str) -> argparse.Namespace:
    """``argv`` as the command line parses and checks it."""
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    cli._check_args(parser, args)
    return args


def app_for(*argv: str) -> tuple[OpenAIApp, ServerMetrics]:
    """An OpenAI app of ``serve *argv``'s graph, in process, with its metrics."""
    metrics = ServerMetrics()
    graph = cli.build_graph(parse("serve", *argv), TOKENIZER, metrics)
    return OpenAIApp(graph, model_name="m", metrics=metrics), metrics


async def scrape(app: OpenAIApp) -> Samples:
    """/metrics as {(sample name, worker label or ''): value}."""
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://a") as c:
        text = (await c.get("/metrics")).text
    return {
        (sample.name, sample.labels.get("worker", "")): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def changed(before: Samples, after: Samples, name: str) -> dict[str, float]:
    """{worker: increase} of ``name``'s samples that rose."""
    return {
        worker: value - before.get((sample, worker), 0.0)
        for (sample, worker), value in after.items()
        if sample == name and value > before.get((sample, worker), 0.0)
    }
