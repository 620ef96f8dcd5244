"""The mocker's ``decode_ms_per_sequence``: every sequence in the batch lengthens each step,
so a worker's inter-token latency grows with its load (what a planner's ITL target reacts
to), on trio's virtual clock so that the machine's own load does not count."""

from __future__ import annotations

import anyio
import pytest

from operators.engines._step_clock import StepClock
from operators.engines.mocker import MockerEngine
from operators.testing import make_request
from pipeline import open_stream
from pipeline.testing import make_context


def test_a_step_lasts_longer_for_each_sequence_registered() -> None:
    clock = StepClock(decode_s=0.002, prefill_s=0.0, sequence_s=0.001)
    first, _ = clock.join(0.0, 0, steps=3)  # an idle clock: step 1 starts now
    second, _ = clock.join(0.0, 0, steps=3)  # launches step 1, with one sequence registered
    assert (first, second) == (1, 2)
    assert clock.end == pytest.approx(0.003)  # 2 ms + 1 x 1 ms
    clock.advance(0.003)
    assert (clock.step, clock.end) == (2, pytest.approx(0.007))  # 2 ms + 2 x 1 ms
    clock.leave(0.004, first, first + 2, 0)  # cancelled during step 2
    clock.advance(0.007)
    assert (clock.step, clock.end) == (3, pytest.approx(0.010))  # one sequence left: 3 ms


@pytest.mark.parametrize(("sequences", "step_ms"), [(1, 3.0), (4, 6.0)])
def test_the_inter_token_latency_follows_the_batch(sequences: int, step_ms: float) -> None:
    from trio.testing import MockClock

    async def gaps() -> list[float]:
        engine = MockerEngine(
            prefill_ms_per_token=0.0, decode_ms_per_step=2.0, decode_ms_per_sequence=1.0
        )
        seen: list[float] = []

        async def one(index: int) -> None:
            request = make_request([10, 11, 12], max_tokens=6)
            async with open_stream(engine, make_context(request, id=f"r{index}")) as stream:
                last = None
                async for _ in stream:
                    now = anyio.current_time()
                    if last is not None:
                        seen.append(now - last)
                    last = now

        async with anyio.create_task_group() as tg:
            for index in range(sequences):
                tg.start_soon(one, index)
        return seen

    found = anyio.run(
        gaps, backend="trio", backend_options={"clock": MockClock(autojump_threshold=0)}
    )
    assert found == [pytest.approx(step_ms / 1000)] * (5 * sequences)


def test_a_negative_cost_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_ms_per_sequence must be >= 0"):
        MockerEngine(decode_ms_per_sequence=-1.0)
