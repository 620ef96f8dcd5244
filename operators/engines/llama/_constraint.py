"""Constrained decoding: a :class:`~operators.contracts.llm.Constraint` becomes a token mask per
choice.

The mask comes from llguidance (a Rust library with an abi3 wheel and no dependencies):
measured on SmolLM2's 49,152-token vocabulary, a full mask costs ~10-60 µs, against ~10 ms
for llama.cpp's own grammar sampler and seconds of compilation for outlines-core on
``{"type": "object"}`` (docs/llama.md, "Structured output", has the numbers;
``benchmarks/bench_constrained.py`` measures them again).

- **Compiled once per request, in a worker thread**, before the request waits for a slot: a
  schema that cannot be compiled is an ``InvalidRequest`` naming the request field that
  asked, and the event loop never runs the compiler. Each choice gets its own copy of the
  compiled matcher; compiled grammars are cached, since clients send the same
  ``response_format`` or tools request after request.
- **Advanced only on commit.** A matcher consumes exactly the tokens a choice emits (and,
  on a migration retry, the replayed output first), so a rejected speculative draft never
  touched it and nothing is ever rolled back.
- **The output's shape is** ``prefix JSON suffix`` (``repeat``: one or more joined by
  ``separator``), as a Lark grammar around llguidance's ``%json``
  (:func:`operators.engines._grammar.lark_grammar`, shared with the vLLM engine).
- **A mask every step, the way llguidance is meant to be driven** (compute the mask, then
  consume a token from it). Computing a mask is not a pure query: where the grammar forces
  text (``{"name": "get_weather"`` of a named call) llguidance lets through only the
  tokenizer's own spelling of it, so the model is not pushed to spell it oddly, and a
  state reached by a token outside the last mask can be refused later (seen: ``]`` then
  ``}`` refused, only EOS left, when masks were skipped). The mask costs ~10-60 µs for
  SmolLM2's vocabulary; what stays lazy is applying it to the logits (:mod:`._sampling`).
  A replayed output is consumed the same way, mask by mask, so a retry reaches exactly
  the state the first attempt had.
"""

from __future__ import annotations

import ctypes
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final, cast, final

from operators.contracts.llm import Constraint, PreprocessedRequest
from operators.engines._grammar import lark_grammar
from pipeline import InvalidRequest

try:
    import llama_cpp
    import llguidance
    import numpy as np
except ImportError as exc:  # LlamaEngine() says what to install
    IMPORT_ERROR: ImportError | None = exc
else:
    IMPORT_ERROR = None

if TYPE_CHECKING:
    from numpy.typing import NDArray

    from ._runtime import Runtime

__all__ = ("IMPORT_ERROR", "Grammars", "Matcher", "lark_grammar")

#: compiled grammars kept per engine (a grammar is a few kB to a few MB of automata)
_CACHED: Final = 64


@final
class Matcher:
    """One choice's position in its constraint's grammar: which tokens may come next.

    Used by one thread at a time: the compiling worker thread while it replays a retry's
    output, then the scheduler's thread once the request is admitted.
    """

    __slots__ = ("_bits", "_n_vocab", "inner")

    def __init__(self, inner: llguidance.LLMatcher, n_vocab: int) -> None:
        #: llguidance's matcher
        self.inner = inner
        self._n_vocab = n_vocab
        self._bits = np.zeros((n_vocab + 31) // 32, dtype=np.int32)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens``, in order, the grammar could take next (no mask: a quick
        filter for drafts; the mask of each position still decides what is emitted)."""
        return self.inner.validate_tokens(list(tokens)) if tokens else 0

    def allowed(self) -> NDArray[np.bool_]:
        """The tokens that may come next, one flag per id (the mask: ~10-60 µs). Call it
        once before each :meth:`accept`."""
        bits = self._bits
        self.inner.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        flags = np.unpackbits(bits.view(np.uint8), bitorder="little")[: self._n_vocab]
        return flags.view(np.bool_)

    def accept(self, token: int) -> None:
        """Advance past ``token``, which the last mask must allow."""
        if not self.inner.consume_token(token):
            raise RuntimeError(f"the grammar rejected token {token}: {self.inner.get_error()}")

    def replay(self, token: int) -> bool:
        """Advance past ``token`` as emitting it would (its mask first); False when the
        grammar refuses it (the matcher is then unusable)."""
        return bool(self.allowed()[token]) and self.inner.consume_token(token)

    @property
    def ended(self) -> bool:
        """No token but end-of-generation may follow: the output is complete."""
        return self.inner.is_stopped()


@final
class Grammars:
    """One engine's constraint compiler: a Constraint into a :class:`Matcher` per choice.

    llguidance sees the model's vocabulary through ``runtime``: every token's bytes, and
    llama.cpp's own tokenizer, which it calls without the GIL where the grammar forces text
    (~40 µs; through a Python callback it waited for the GIL, 100-350 µs, in the scheduler
    thread). Building that view takes ~0.4 s, so it happens on the first constrained
    request, not when the engine loads. Every method blocks: call them in a worker thread.
    """

    def __init__(self, runtime: Runtime) -> None:
        self._runtime = runtime
        self._eos = sorted(runtime.eog)
        self._n_vocab = runtime.n_vocab
        self._lock = threading.Lock()
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def matchers(self, request: PreprocessedRequest, request_id: str) -> list[Matcher]:
        """One matcher per choice of ``request``, past its replayed output.

        Raises:
            InvalidRequest: the constraint cannot be compiled (a bad or unsupported
                schema), or the replayed output does not satisfy it.
            LlamaFailure: the engine was closed.
        """
        constraint = request.constraint
        assert constraint is not None
        # The vocabulary must outlive the masks computed here (the replay's).
        with self._runtime.reading():
            template = self._compile(constraint, request_id)
            replayed = request.replayed_tokens
            if replayed:
                matcher = Matcher(template.deep_copy(), self._n_vocab)
                tail = request.token_ids[len(request.token_ids) - replayed :]
                if not all(matcher.replay(token) for token in tail):
                    raise InvalidRequest(
                        f"the output replayed after a migration does not satisfy "
                        f"{constraint.param!r}",
                        param=constraint.param,
                        request_id=request_id,
                    )
                template = matcher.inner
        return [Matcher(template.deep_copy(), self._n_vocab) for _ in range(max(request.n, 1))]

    def _compile(self, constraint: Constraint, request_id: str) -> llguidance.LLMatcher:
        grammar = lark_grammar(constraint)
        with self._lock:
            compiled = self._compiled.get(grammar)
            if compiled is not None:
                self._compiled.move_to_end(grammar)
                return compiled
            tokenizer = self._tokenizer
            if tokenizer is None:
                tokenizer = self._tokenizer = self._build_tokenizer()
        matcher = llguidance.LLMatcher(
            tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0
        )
        if matcher.is_error():
            raise InvalidRequest(
                f"{constraint.param!r} cannot be used for constrained decoding: "
                f"{_reason(matcher.get_error())}",
                param=constraint.param,
                request_id=request_id,
            )
        with self._lock:
            self._compiled[grammar] = matcher
            while len(self._compiled) > _CACHED:
                self._compiled.popitem(last=False)
        return matcher

    def _build_tokenizer(self) -> llguidance.LLTokenizer:
        runtime = self._runtime
        with runtime.reading() as vocab:
            # llguidance takes llama.cpp's tokenizer as a C function; its stub omits this.
            from_llamacpp: Any = getattr(llguidance.LLTokenizer, "from_llamacpp")  # noqa: B009
            return cast(
                "llguidance.LLTokenizer",
                from_llamacpp(
                    tokens=runtime.pieces(),
                    vocab_ptr=vocab,
                    tokenize_fptr=ctypes.cast(
                        llama_cpp.llama_cpp._lib.llama_tokenize, ctypes.c_void_p
                    ).value,
                    eos_token=self._eos,
                    slices=None,
                ),
            )


def _reason(error: str) -> str:
    """llguidance's error without the grammar listing it appends (our Lark, not the
    client's schema) and without its location in that grammar."""
    reason = error.split("\n   1 |", 1)[0].strip()
    _, sep, rest = reason.partition(": failed to compile JSON schema: ")
    return rest if sep else reason
