"""What the frontends tell the planner: histogram deltas, their merge and quantiles
(``operators.planner.latency``, ``operators.planner.wire``), and the load averages."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from operators.edges.http.metrics import ServerMetrics
from operators.planner.latency import MIN_SAMPLES, Latencies, LatencyReporter, LatencyWindows, delta
from operators.planner.load_averages import LoadAverages
from operators.planner.wire import decode_summary, encode_summary

BOUNDS = (0.1, 0.2, 0.5, 1.0)


def test_a_delta_names_each_bucket_that_gained_with_its_bounds() -> None:
    assert delta(BOUNDS, (1, 0, 0, 0, 0), (1, 3, 0, 2, 1)) == [
        (0.1, 0.2, 3),
        (0.5, 1.0, 2),
        (1.0, None, 1),
    ]
    assert delta(BOUNDS, (), (2, 0, 0, 0, 0)) == [(0.0, 0.1, 2)]
    assert delta(BOUNDS, (2, 0, 0, 0, 0), (2, 0, 0, 0, 0)) == []


def test_the_quantile_interpolates_within_its_bucket_as_prometheus_does() -> None:
    latencies = Latencies([(0.0, 0.1, 10), (0.1, 0.2, 10)])
    assert latencies.quantile(0.5) == pytest.approx(0.1)
    assert latencies.quantile(0.75) == pytest.approx(0.15)
    assert latencies.quantile(1.0) == pytest.approx(0.2)
    assert Latencies().quantile(0.9) is None


def test_observations_past_the_last_bound_are_that_bound() -> None:
    latencies = Latencies([(0.0, 0.1, 1), (30.0, None, 9)])
    assert latencies.quantile(0.9) == 30.0


def test_deltas_of_several_frontends_add_up() -> None:
    together = Latencies([(0.0, 0.1, 5)])
    together.add([(0.0, 0.1, 5), (0.1, 0.2, 10)])
    assert together.count == 20
    assert together.quantile(0.5) == pytest.approx(0.1)


@given(st.lists(st.floats(0.001, 2.0), min_size=20, max_size=300), st.integers(0, 2**32))
def test_the_p90_of_the_servers_histogram_is_within_its_bucket_of_the_exact_one(
    values: list[float], seed: int
) -> None:
    metrics = ServerMetrics()
    histogram = metrics.time_to_first_token.labels("m")
    for value in values:
        histogram.observe(value)
    # the frontend's deltas, cut at random points, merged as the planner does
    cuts = sorted(random.Random(seed).sample(range(len(values) + 1), 2))
    merged = Latencies()
    before: tuple[int, ...] = ()
    partial = ServerMetrics().time_to_first_token.labels("m")
    for index, value in enumerate(values, 1):
        partial.observe(value)
        if index in cuts or index == len(values):
            merged.add(delta(partial.bounds, before, partial.counts))
            before = partial.counts
    exact = sorted(values)[math.ceil(0.9 * len(values)) - 1]
    estimate = merged.quantile(0.9)
    assert estimate is not None
    bounds = (0.0, *histogram.bounds)
    below = max(b for b in bounds if b < exact) if exact > bounds[1] else 0.0
    above = min(b for b in bounds if b >= exact)
    assert below <= estimate <= above


def test_the_reporter_sends_what_each_model_gained_and_nothing_when_idle() -> None:
    metrics = ServerMetrics()
    reporter = LatencyReporter(None, metrics, namespace="ns", frontend="f")  # type: ignore[arg-type]
    assert reporter.summary() == {}
    metrics.time_to_first_token.labels("a").observe(0.03)
    metrics.inter_token_latency.labels("a").observe(0.012)
    metrics.time_to_first_token.labels("b").observe(2.0)
    metrics.time_to_first_token.labels("").observe(2.0)  # a request of no served model
    first = reporter.summary()
    assert first == {
        "a": {"ttft": [(0.025, 0.05, 1)], "itl": [(0.01, 0.0125, 1)]},
        "b": {"ttft": [(1.5, 2.5, 1)]},
    }
    assert reporter.summary() == {}
    metrics.time_to_first_token.labels("a").observe(0.03)
    assert reporter.summary() == {"a": {"ttft": [(0.025, 0.05, 1)]}}


def test_a_summary_crosses_the_wire_unchanged() -> None:
    summary = {"m": {"ttft": [(0.0, 0.1, 2), (30.0, None, 1)], "itl": [(0.01, 0.02, 7)]}}
    assert decode_summary(encode_summary("f", summary)) == summary


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b'{"frontend": "f"}',
        b'{"models": {"m": {"ttft": [[0, 1]]}}}',
        b'{"models": {"m": {"ttft": [[0, 1, -3]]}}}',
        b'{"models": {"m": {"ttft": [["a", 1, 3]]}}}',
        b'{"models": []}',
    ],
)
def test_a_malformed_summary_is_a_value_error(data: bytes) -> None:
    with pytest.raises(ValueError, match="not a latency summary"):
        decode_summary(data)


def test_each_workers_load_is_averaged_over_time_each_workers_load_over_time() -> None:
    averages = LoadAverages()
    averages.report("w1", {"waiting": 2, "decoding": 0}, now=0.0)
    averages.report("w1", {"waiting": 0, "decoding": 4}, now=1.0)
    averages.report("w2", {"waiting": 1, "decoding": 1, "kv": 0.5, "worker": "x"}, now=2.0)
    assert averages.take(["w1", "w2"], now=4.0) == {
        "waiting": pytest.approx(0.5 + 1.0),  # w1: 2 for 1 s of 4; w2: 1 since it came
        "decoding": pytest.approx(3.0 + 1.0),
        "kv": pytest.approx(0.5),
    }
    # and from there on, the last reports hold
    assert averages.take(["w1"], now=6.0) == {"waiting": 0.0, "decoding": 4.0}


def test_a_worker_that_never_reported_makes_the_load_unknown() -> None:
    averages = LoadAverages()
    averages.report("w1", {"waiting": 1}, now=0.0)
    assert averages.take(["w1", "w2"], now=1.0) is None
    assert not averages.knows("w2")
    averages.forget("w1")
    assert averages.take([], now=2.0) == {}


def test_a_latency_is_judged_once_it_has_enough_observations_and_dropped_when_old() -> None:
    windows = LatencyWindows()
    windows.add("a", "ttft", [(0.0, 0.1, MIN_SAMPLES - 1)])
    windows.add("b", "itl", [(0.0, 0.1, MIN_SAMPLES)])
    assert windows.judge() == {"b": {"itl": pytest.approx(0.1 * 0.9)}}
    windows.add("a", "ttft", [(0.1, 0.2, 1)])  # a quiet model's requests add up
    assert windows.judge() == {"a": {"ttft": pytest.approx(0.1)}}
    windows.add("a", "ttft", [(0.0, 0.1, 1)])
    assert [windows.judge() for _ in range(5)] == [{}] * 5
    windows.add("a", "ttft", [(0.5, 1.0, MIN_SAMPLES - 1)])  # the old one was dropped
    assert windows.judge() == {}
