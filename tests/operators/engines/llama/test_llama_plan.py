"""The llama engine's step plan (``_plan``), without a model: what one step feeds, decided
over plain data. Properties over any slot table (hypothesis), then the policy's cases."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from operators.engines.llama._plan import Occupant, Plan, next_group, plan_step
from operators.engines.llama._runtime import Feed

GROUPS = (None, "tiny", "other")


@dataclass(frozen=True)
class Table:
    """A slot table and the settings one plan is made with."""

    slots: list[Occupant[str | None] | None]
    prefilling: list[int]
    last_ran: dict[str | None, int]
    step_tokens: int
    idle_tokens: int
    cap: int  # the most prompt tokens the pacer allows while sequences decode

    def prefill_budget(self, decoding: int, most: int) -> int:
        return min(most, self.cap) if decoding else most

    def plan(self) -> Plan[str | None] | None:
        return plan_step(
            self.slots,
            self.prefilling,
            last_ran=self.last_ran,
            step_tokens=self.step_tokens,
            idle_tokens=self.idle_tokens,
            prefill_budget=self.prefill_budget,
        )

    def eligible(self) -> list[int]:
        """Slots whose sequence decodes and whose consumer keeps up."""
        return [
            slot
            for slot, seq in enumerate(self.slots)
            if seq is not None and seq.pending is not None and seq.behind <= 1
        ]

    def budget(self) -> int:
        waiting = any(seq is not None and seq.pending is not None for seq in self.slots)
        return self.step_tokens if waiting else self.idle_tokens

    def at(self, slot: int) -> Occupant[str | None]:
        seq = self.slots[slot]
        assert seq is not None
        return seq


@st.composite
def occupants(draw: st.DrawFn, kind: str) -> Occupant[str | None]:
    group = draw(st.sampled_from(GROUPS))
    prompt = draw(st.lists(st.integers(0, 50), min_size=1, max_size=300))
    resumed = draw(st.booleans()) and len(prompt) > 1
    prompt_end = len(prompt) - resumed
    if kind == "prefilling":
        cached = draw(st.integers(0, len(prompt) - 1))
        return Occupant(group, None, 0, cached, prompt, prompt_end)
    if kind == "idle":  # a sibling waiting to copy a prompt, or a transfer awaited
        return Occupant(group, None, 0, draw(st.integers(0, len(prompt))), prompt, prompt_end)
    pending, behind = draw(st.integers(0, 50)), draw(st.integers(0, 3))
    cached = len(prompt) + draw(st.integers(0, 100))
    drafts = draw(st.lists(st.integers(0, 50), max_size=8))
    return Occupant(group, pending, behind, cached, prompt, prompt_end, drafts)


@st.composite
def tables(draw: st.DrawFn) -> Table:
    kinds = draw(
        st.lists(
            st.sampled_from(["free", "decoding", "prefilling", "idle"]), min_size=1, max_size=8
        )
    )
    slots = [None if kind == "free" else draw(occupants(kind)) for kind in kinds]
    prefilling = draw(st.permutations([s for s, kind in enumerate(kinds) if kind == "prefilling"]))
    last_ran = draw(st.dictionaries(st.sampled_from(GROUPS), st.integers(0, 5)))
    step_tokens = draw(st.integers(max(len(slots), 1), 256))
    idle_tokens = draw(st.integers(step_tokens, 600))
    return Table(slots, prefilling, last_ran, step_tokens, idle_tokens, draw(st.integers(0, 300)))


def feeds_by_slot(plan: Plan[str | None]) -> dict[int, Feed]:
    return {feed.seq: feed for feed in plan.feeds}


@given(tables())
def test_a_step_never_holds_more_tokens_than_its_budget(table: Table) -> None:
    plan = table.plan()
    if plan is not None:
        assert sum(len(feed.tokens) for feed in plan.feeds) <= table.budget()
        prompt = sum(size for _, size in plan.chunks)
        decoding = len(plan.record.decoded)
        assert prompt <= table.prefill_budget(decoding, table.budget() - decoding)


@given(tables())
def test_a_step_runs_one_group_the_one_that_waited_longest(table: Table) -> None:
    plan = table.plan()
    with_work = dict.fromkeys(table.at(slot).group for slot in table.eligible() + table.prefilling)
    if plan is None:
        assert not table.eligible()  # decoding sequences always advance
        return
    assert plan.group in with_work
    assert all(table.at(feed.seq).group == plan.group for feed in plan.feeds)
    assert plan.group == next_group(with_work, table.last_ran)
    waited = table.last_ran.get(plan.group, -1)
    assert all(waited <= table.last_ran.get(group, -1) for group in with_work)


@given(tables())
def test_every_decoding_sequence_of_the_group_gets_its_pending_token(table: Table) -> None:
    plan = table.plan()
    if plan is None:
        return
    feeds = feeds_by_slot(plan)
    for slot, seq in enumerate(table.slots):
        if seq is None or seq.group != plan.group:
            continue
        if slot in table.eligible():
            feed = feeds[slot]
            assert feed.tokens[0] == seq.pending
            assert list(feed.tokens[1:]) == list(seq.drafts[: len(feed.tokens) - 1])
            assert feed.logits == len(feed.tokens)  # every token's row is sampled
        elif slot not in table.prefilling:  # a consumer two outputs behind, or idle
            assert slot not in feeds


@given(tables())
def test_prompts_advance_oldest_first_from_their_cells_on(table: Table) -> None:
    plan = table.plan()
    if plan is None:
        assert not table.prefilling or table.cap == 0 or table.eligible()
        return
    mine = [slot for slot in table.prefilling if table.at(slot).group == plan.group]
    chunked = [slot for slot, _ in plan.chunks]
    assert chunked == mine[: len(chunked)]  # nobody overtakes an older prompt
    feeds = feeds_by_slot(plan)
    for i, (slot, size) in enumerate(plan.chunks):
        seq = table.at(slot)
        rest = len(seq.prompt) - seq.cached
        assert 1 <= size <= rest
        assert i == len(plan.chunks) - 1 or size == rest  # only the last one is cut
        assert list(feeds[slot].tokens) == list(seq.prompt[seq.cached : seq.cached + size])
        assert feeds[slot].logits == (size == rest)  # the prompt's last token is sampled


@given(tables())
def test_drafts_take_what_is_left_in_slot_order(table: Table) -> None:
    plan = table.plan()
    if plan is None:
        return
    feeds = feeds_by_slot(plan)
    cut = False
    for slot in plan.record.decoded:
        offered = table.at(slot).drafts
        taken = len(feeds[slot].tokens) - 1
        assert not cut or taken == 0  # once one is cut, the budget is spent
        if taken < len(offered):
            cut = True
            assert sum(len(feed.tokens) for feed in plan.feeds) == table.budget()


@given(tables())
def test_the_feeds_and_the_record_agree(table: Table) -> None:
    plan = table.plan()
    if plan is None:
        return
    slots = [feed.seq for feed in plan.feeds]
    assert slots == sorted(set(slots))  # slot order, one feed per sequence
    record = plan.record
    assert set(record.decoded) | set(record.prefilled) == set(slots)
    assert record.decoded == tuple(s for s in slots if table.at(s).pending is not None)
    assert record.prefilled == tuple(slot for slot, _ in plan.chunks)
    assert record.drafted == tuple(
        s for s in record.decoded if len(feeds_by_slot(plan)[s].tokens) > 1
    )
    assert record.decode_tokens + record.prefill_tokens == sum(len(f.tokens) for f in plan.feeds)
    # a continuation's tokens past the prompt's end count as decoded
    prompt = sum(
        max(0, min(size, table.at(slot).prompt_end - table.at(slot).cached))
        for slot, size in plan.chunks
    )
    assert record.prefill_tokens == prompt
    assert record.batch_size == len(plan.feeds)
    assert (record.seconds, record.adapter) == (0.0, None)  # the runner's to fill in


@given(tables(), st.integers(1, 300))
def test_groups_with_work_take_turns_and_every_prompt_advances(table: Table, cap: int) -> None:
    """Steps run as the scheduler runs them (chunks fill their cells, a finished prompt
    starts decoding, consumers keep up, a step notes its group's turn): the groups with
    work each run once in any run of as many steps, and every step of a group with
    prompts advances its oldest one."""
    slots = list(table.slots)
    prefilling = list(table.prefilling)
    last_ran = dict(table.last_ran)
    groups = {table.at(slot).group for slot in table.eligible() + table.prefilling}
    first = max(last_ran.values(), default=0) + 1
    ran: list[str | None] = []
    for step in range(3 * len(GROUPS)):
        plan = plan_step(
            slots,
            prefilling,
            last_ran=last_ran,
            step_tokens=table.step_tokens,
            idle_tokens=table.idle_tokens,
            prefill_budget=lambda decoding, most: min(most, cap),
        )
        if plan is None:
            assert not groups
            return
        ran.append(plan.group)
        last_ran[plan.group] = first + step
        mine = [slot for slot in prefilling if table.at(slot).group == plan.group]
        assert not mine or plan.chunks[0][0] == mine[0]
        for feed in plan.feeds:
            seq = slots[feed.seq]
            assert seq is not None
            cached = seq.cached + len(feed.tokens)
            if seq.pending is None and cached == len(seq.prompt):
                prefilling.remove(feed.seq)
                seq = seq._replace(pending=0)
            slots[feed.seq] = seq._replace(cached=cached, behind=0)
    for start in range(len(ran) - len(groups) + 1):
        assert set(ran[start : start + len(groups)]) == groups


# -- the policy's cases ---------------------------------------------------------------------


def decoding(
    group: str | None = None, *, behind: int = 0, drafts: tuple[int, ...] = ()
) -> Occupant[str | None]:
    return Occupant(group, 7, behind, 10, [1] * 10, 10, drafts)


def prompt(length: int, cached: int = 0, group: str | None = None) -> Occupant[str | None]:
    return Occupant(group, None, 0, cached, list(range(length)), length)


def plan(
    slots: Sequence[Occupant[str | None] | None],
    prefilling: Sequence[int],
    *,
    step_tokens: int = 32,
    budget: Callable[[int, int], int] = lambda decoding, most: most,
    last_ran: dict[str | None, int] | None = None,
) -> Plan[str | None] | None:
    return plan_step(
        slots,
        prefilling,
        last_ran=last_ran or {},
        step_tokens=step_tokens,
        idle_tokens=512,
        prefill_budget=budget,
    )


def test_a_long_prompt_goes_in_chunks_beside_the_running_sequences() -> None:
    step = plan([decoding(), prompt(100), decoding()], [1])
    assert step is not None
    assert step.chunks == [(1, 30)]  # 32 tokens: one per running sequence, 30 of prompt
    assert [feed.seq for feed in step.feeds] == [0, 1, 2]
    assert step.feeds[1] == Feed(1, list(range(30)), 0)  # inside the prompt: no logits


def test_while_nobody_decodes_a_step_takes_a_whole_batch_of_prompt() -> None:
    step = plan([prompt(300), prompt(300, cached=100)], [1, 0])
    assert step is not None
    assert step.chunks == [(1, 200), (0, 300)]  # the older first, to its end
    assert step.feeds == [Feed(0, list(range(300)), 1), Feed(1, list(range(100, 300)), 1)]


def test_the_pacer_limits_the_prompt_tokens_while_sequences_decode() -> None:
    step = plan([decoding(), prompt(100)], [1], budget=lambda decoding, most: min(most, 16))
    assert step is not None
    assert step.chunks == [(1, 16)]


def test_a_consumer_two_outputs_behind_makes_its_sequence_wait() -> None:
    step = plan([decoding(behind=2), decoding(behind=1)], [])
    assert step is not None
    assert step.record.decoded == (1,)
    assert plan([decoding(behind=2)], []) is None


def test_drafts_come_last_in_slot_order() -> None:
    step = plan([decoding(drafts=(1, 2, 3, 4)), decoding(drafts=(5, 6))], [], step_tokens=16)
    assert step is not None
    assert [list(feed.tokens) for feed in step.feeds] == [[7, 1, 2, 3, 4], [7, 5, 6]]
    slots = [decoding(drafts=(1, 2, 3, 4)), prompt(12), decoding(drafts=(5, 6))]
    step = plan(slots, [1], step_tokens=16)
    assert step is not None  # 2 pending tokens and 12 of prompt: 2 drafts fit
    assert [list(feed.tokens) for feed in step.feeds] == [[7, 1, 2], list(range(12)), [7]]
    assert step.record.drafted == (0,)


def test_adapters_take_turns_and_a_step_runs_one() -> None:
    slots = [decoding(None), decoding("tiny"), prompt(20, group="tiny")]
    first = plan(slots, [2])
    assert first is not None
    assert first.group is None  # met first, neither ran yet
    second = plan(slots, [2], last_ran={None: 0})
    assert second is not None
    assert second.group == "tiny"
    assert [feed.seq for feed in second.feeds] == [1, 2]


def test_a_continuations_last_prompt_token_is_counted_as_decoded() -> None:
    # a continuation: its prompt ends a token early, its cells were pulled up to 8
    resumed: Occupant[str | None] = Occupant(None, None, 0, 8, list(range(10)), 9)
    step = plan([resumed], [0])
    assert step is not None
    assert (step.record.prefill_tokens, step.record.decode_tokens) == (1, 1)


def test_the_group_that_waited_longest_goes_next() -> None:
    assert next_group(["a", "b", "c"], {"a": 3, "b": 1}) == "c"  # never ran
    assert next_group(["a", "b"], {"a": 3, "b": 1}) == "b"
    assert next_group(["a", "b"], {}) == "a"  # a tie: the first met
