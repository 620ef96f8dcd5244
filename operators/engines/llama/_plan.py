"""The plan of one step: which sequences decode, which prompts advance and by how much, and
which drafts are verified, decided over plain data.

Apart from the scheduler because it is the engine's whole step policy and has no side
effects: it reads what each slot holds (:class:`Occupant`) and returns the feeds of one
``llama_decode`` and the step's record (:class:`Plan`), so its rules are tested on their
own; the scheduler executes plans (``_stepper``). The rules, in order:

1. one group per step: llama.cpp applies adapters (LoRA) per context, so a step runs the
   sequences of one adapter (or of the base model), and the groups with work take turns
   (:func:`next_group`);
2. the pending token of every decoding sequence of that group whose consumer keeps up
   (its task is at most one output behind: a slow client does not make the engine
   generate its answer into a buffer);
3. prompt chunks, oldest prompt first, within the step's budget (``step_tokens`` while any
   sequence waits for a token, ``idle_tokens`` while none does, less the pending tokens)
   and within what the pacer allows (``prefill_budget``);
4. drafts, in slot order, with what is left.

Why chunked prefill: a step costs about its token count on a CPU, so a long prompt fed in
one step would freeze every running sequence for its whole prefill. With a budget per step,
running sequences get a token every step and the prompt advances by what is left.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

from ._runtime import Feed
from ._steps import LlamaStep

__all__ = ("Occupant", "Plan", "next_group", "plan_step")

#: a group of sequences that may share a step (the llama engine's: an adapter, None for
#: the base model)
G = TypeVar("G", bound=Hashable | None)


class Occupant(NamedTuple, Generic[G]):
    """The sequence in a slot, as a plan sees it."""

    #: the adapter it runs with (steps run one group at a time)
    group: G
    #: its last emitted token, not in the KV cache yet; None while its prompt is prefilled
    #: (or before it may start: a sibling copying a prompt, a transfer awaited)
    pending: int | None
    #: outputs produced that its consumer has not taken yet
    behind: int
    #: the tokens its slot's KV cells hold
    cached: int
    #: its prompt's tokens
    prompt: Sequence[int]
    #: where its prompt ends: tokens from here on are output continued after a prefill
    #: worker's first token, fed like decode tokens
    prompt_end: int
    #: the drafts it would have verified after its pending token, as many as its room
    #: allows (a prefix of them is taken, in slot order, with what the step has left)
    drafts: Sequence[int] = ()


class Plan(NamedTuple, Generic[G]):
    """One step: what to feed and what it will have done."""

    #: the group the step runs
    group: G
    #: one feed per sequence in the step, in slot order (llama.cpp batches consecutive
    #: sequence ids together)
    feeds: list[Feed]
    #: the prompt chunks: (slot, tokens), oldest prompt first
    chunks: list[tuple[int, int]]
    #: the step's record; whoever runs it fills in ``seconds`` and ``adapter``
    record: LlamaStep


def next_group(groups: Iterable[G], last_ran: Mapping[G, int]) -> G:
    """The group to step next among ``groups`` (in the order met; at least one): the one
    whose last step (``last_ran``) is the oldest, never first, the first met on a tie; so
    groups with work alternate step by step."""
    return min(groups, key=lambda group: last_ran.get(group, -1))


def plan_step(
    slots: Sequence[Occupant[G] | None],
    prefilling: Sequence[int],
    *,
    last_ran: Mapping[G, int],
    step_tokens: int,
    idle_tokens: int,
    prefill_budget: Callable[[int, int], int],
) -> Plan[G] | None:
    """The next step, or None when no sequence can advance.

    ``slots[s]`` is slot ``s``'s sequence (None: free); ``prefilling`` the slots whose
    prompt is being prefilled (pending None, fewer cells than prompt), oldest first;
    ``last_ran`` the step each group last ran. A step holds at most ``step_tokens`` tokens
    while a sequence waits for its next token, else ``idle_tokens``; ``step_tokens`` must
    cover one token per slot. ``prefill_budget(decoding, most)`` says how many prompt
    tokens a step with ``decoding`` sequences may take, at most ``most`` (the pacer's).
    """

    def occupant(slot: int) -> Occupant[G]:
        seq = slots[slot]
        assert seq is not None
        return seq

    decoding = [
        slot
        for slot, seq in enumerate(slots)
        if seq is not None and seq.pending is not None and seq.behind <= 1
    ]
    groups = dict.fromkeys(occupant(slot).group for slot in (*decoding, *prefilling))
    if not groups:
        return None
    group = next_group(groups, last_ran)
    if len(groups) > 1:
        decoding = [slot for slot in decoding if occupant(slot).group == group]
        prefilling = [slot for slot in prefilling if occupant(slot).group == group]
    # While nobody waits for a token, a step takes as much prompt as the batch holds.
    waiting = any(seq is not None and seq.pending is not None for seq in slots)
    budget = (step_tokens if waiting else idle_tokens) - len(decoding)
    prompt_budget = prefill_budget(len(decoding), budget)
    chunks: list[tuple[int, int]] = []
    for slot in prefilling:
        if prompt_budget <= 0:
            break
        seq = occupant(slot)
        size = min(len(seq.prompt) - seq.cached, prompt_budget)
        chunks.append((slot, size))
        budget -= size
        prompt_budget -= size
    if not decoding and not chunks:
        return None
    feeds: list[Feed] = []
    drafted: list[int] = []
    for slot in decoding:
        seq = occupant(slot)
        assert seq.pending is not None
        drafts = list(seq.drafts[: max(budget, 0)])
        budget -= len(drafts)
        if drafts:
            drafted.append(slot)
        feeds.append(Feed(slot, [seq.pending, *drafts], 1 + len(drafts)))
    decode_tokens = sum(len(feed.tokens) for feed in feeds)
    prompt_tokens = 0
    for slot, size in chunks:
        seq = occupant(slot)
        start, end = seq.cached, seq.cached + size
        feeds.append(Feed(slot, seq.prompt[start:end], int(end == len(seq.prompt))))
        # A continuation's last "prompt" token is the prefill worker's output: decoded here.
        prefill = max(0, min(size, seq.prompt_end - start))
        prompt_tokens += prefill
        decode_tokens += size - prefill
    feeds.sort(key=lambda feed: feed.seq)
    record = LlamaStep(
        decoded=tuple(decoding),
        drafted=tuple(drafted),
        decode_tokens=decode_tokens,
        prefilled=tuple(slot for slot, _ in chunks),
        prefill_tokens=prompt_tokens,
        seconds=0.0,
    )
    return Plan(group, feeds, chunks, record)
