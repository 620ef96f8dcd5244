"""Tests for the sans-IO stop jail: split stops never leak, nothing is lost or reordered.

Why this module exists: `operators.text.stop_jail` is where the B1/B3/B12/B13/B16 bug classes
(``docs/bug-classes.md``) are closed, so each is pinned here by a table case, and the
general claims (split invariance, exact withholding) by property tests against the naive
`find_stop` reference. No event loop is involved.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from operators.text.stop_jail import Released, StopJail, StopMatcher, Stopped, find_stop

__all__ = ()

Result = Released | Stopped

# --------------------------------------------------------------------------- helpers


def run(
    stops: Sequence[str], pushes: Sequence[str], *, include: bool = False
) -> tuple[list[Result], str]:
    """Push every chunk (stopping at the first `Stopped`); return the results and flush()."""
    jail = StopJail(stops, include_stop_in_output=include)
    results: list[Result] = []
    for chunk in pushes:
        result = jail.push(chunk)
        results.append(result)
        if isinstance(result, Stopped):
            break
    return results, jail.flush()


def released_text(results: Sequence[Result]) -> str:
    return "".join(r.text for r in results)


def reference_output(text: str, stops: Sequence[str], *, include: bool) -> str:
    """What the client must see in total, computed offline on the whole text."""
    match = find_stop(text, stops)
    if match is None:
        return text
    start, end, _ = match
    return text[:end] if include else text[:start]


def naive_withheld(unreleased: str, stops: Sequence[str]) -> str:
    """Longest suffix of `unreleased` that is a proper prefix of some stop string."""
    for size in range(len(unreleased), 0, -1):
        tail = unreleased[-size:]
        if any(len(s) > size and s.startswith(tail) for s in stops):
            return tail
    return ""


def split(text: str, cuts: Sequence[int]) -> list[str]:
    """Cut `text` at the given positions (any order, duplicates give empty chunks)."""
    points = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    return [text[a:b] for a, b in itertools.pairwise(points)]


# --------------------------------------------------------------------------- table tests

R = Released
S = Stopped

TABLE: list[tuple[str, list[str], list[str], bool, list[Result], str]] = [
    # id, stops, pushes, include_stop_in_output, expected results, expected flush()
    (
        "split-hidden-stop-never-leaks",
        [" zeta eta theta"],
        [" delta", " epsilon", " zeta", " eta", " theta"],
        False,
        [R(" delta"), R(" epsilon"), R(""), R(""), S("", " zeta eta theta")],
        "",
    ),
    (
        "split-hidden-stop-discards-rest-of-push",
        [" zeta eta theta"],
        ["x zeta", " eta", " theta and more"],
        False,
        [R("x"), R(""), S("", " zeta eta theta")],
        "",
    ),
    (
        "abandoned-prefix-released-in-order",
        ["ozzy"],
        ["o", "there"],
        False,
        [R(""), R("othere")],
        "",
    ),
    (
        "abandoned-prefix-keeps-new-viable-tail",
        ["ozzy"],
        ["oz", "o", "zzy!"],
        False,
        [R(""), R("oz"), S("", "ozzy")],
        "",
    ),
    (
        "no-viable-prefix-no-holdback",
        ["</s>"],
        ["Hello", " world"],
        False,
        [R("Hello"), R(" world")],
        "",
    ),
    (
        "visible-stop-split",
        ["</s>"],
        ["Hi", "</", "s>tail"],
        True,
        [R("Hi"), R(""), S("</s>", "</s>")],
        "",
    ),
    (
        "visible-stop-one-push",
        ["END"],
        ["the END of it"],
        True,
        [S("the END", "END")],
        "",
    ),
    ("earliest-end-wins-hidden", ["re", "he"], ["there"], False, [S("t", "he")], ""),
    ("earliest-end-wins-visible", ["re", "he"], ["there"], True, [S("the", "he")], ""),
    (
        "earliest-end-wins-char-by-char",
        ["re", "he"],
        list("there"),
        False,
        [R("t"), R(""), S("", "he")],
        "",
    ),
    ("inner-stop-completes-first", ["abcd", "bc"], ["abcd"], False, [S("a", "bc")], ""),
    ("inner-stop-completes-first-visible", ["abcd", "bc"], ["abcd"], True, [S("abc", "bc")], ""),
    ("same-end-longest-wins", ["bc", "abc"], ["abc"], False, [S("", "abc")], ""),
    ("same-end-longest-wins-order", ["abc", "bc"], ["abc"], False, [S("", "abc")], ""),
    ("same-end-longest-wins-visible", ["bc", "abc"], ["abc"], True, [S("abc", "abc")], ""),
    (
        "same-end-longest-wins-split",
        ["bc", "abc"],
        ["a", "b", "c"],
        False,
        [R(""), R(""), S("", "abc")],
        "",
    ),
    # "abc" fails to "bc" (not a stop), which fails to "c" (a stop): two suffix-link levels.
    ("suffix-chain-two-levels", ["abcx", "bcy", "c"], ["abc"], False, [S("ab", "c")], ""),
    (
        "suffix-chain-two-levels-split",
        ["abcx", "bcy", "c"],
        ["a", "b", "cx"],
        True,
        [R(""), R(""), S("abc", "c")],
        "",
    ),
    ("stop-at-first-char", ["x"], ["xyz"], False, [S("", "x")], ""),
    ("stop-is-whole-first-push", ["Hello"], ["Hello", " world"], False, [S("", "Hello")], ""),
    (
        "stop-spans-four-pushes",
        ["STOP"],
        ["ab S", "T", "O", "P cd"],
        False,
        [R("ab "), R(""), R(""), S("", "STOP")],
        "",
    ),
    (
        "stop-spans-four-pushes-visible",
        ["STOP"],
        ["ab S", "T", "O", "P cd"],
        True,
        [R("ab "), R(""), R(""), S("STOP", "STOP")],
        "",
    ),
    ("cjk-stop-split", ["停止"], ["你好停", "止了"], False, [R("你好"), S("", "停止")], ""),
    ("cjk-stop-visible", ["停止"], ["你好停", "止了"], True, [R("你好"), S("停止", "停止")], ""),
    (
        "emoji-modifier-stop-split",
        ["👋🏽"],
        ["hi 👋", "🏽 there"],
        False,
        [R("hi "), S("", "👋🏽")],
        "",
    ),
    (
        "emoji-prefix-abandoned",
        ["👋🏽"],
        ["👋", "👍"],
        False,
        [R(""), R("👋👍")],
        "",
    ),
    (
        "zwj-sequence-stop",
        ["👩\u200d💻"],
        ["é👩", "\u200d", "💻ß"],
        False,
        [R("é"), R(""), S("", "👩\u200d💻")],
        "",
    ),
    (
        "multibyte-text-ascii-stop",
        ["\n\n"],
        ["naïve ", "日本語\n", "\n"],
        False,
        [R("naïve "), R("日本語"), S("", "\n\n")],
        "",
    ),
    ("overlap-aab-in-aaab", ["aab"], ["aaab"], False, [S("a", "aab")], ""),
    (
        "overlap-aab-in-aaab-char-by-char",
        ["aab"],
        list("aaab"),
        False,
        [R(""), R(""), R("a"), S("", "aab")],
        "",
    ),
    (
        "overlap-aab-in-aaab-visible",
        ["aab"],
        ["aa", "ab"],
        True,
        [R(""), S("aaab", "aab")],
        "",
    ),
    (
        "flush-incomplete-prefix",
        ["ozzy"],
        ["hello o", "zz"],
        False,
        [R("hello "), R("")],
        "ozz",
    ),
    (
        "flush-incomplete-visible-prefix",
        ["</s>"],
        ["x</"],
        True,
        [R("x")],
        "</",
    ),
    ("no-stops-fast-path", [], ["a", "", "b c"], False, [R("a"), R(""), R("b c")], ""),
    ("only-empty-stops", ["", ""], ["abc"], False, [R("abc")], ""),
    ("duplicate-stops", ["ab", "ab", ""], ["xa", "b"], False, [R("x"), S("", "ab")], ""),
    (
        "empty-push-keeps-state",
        ["ab"],
        ["a", "", "b"],
        False,
        [R(""), R(""), S("", "ab")],
        "",
    ),
    ("empty-push-first", ["ab"], ["", "x"], False, [R(""), R("x")], ""),
    (
        "stop-that-is-prefix-of-another",
        ["ab", "abc"],
        ["a", "bc"],
        False,
        [R(""), S("", "ab")],
        "",
    ),
]


@pytest.mark.parametrize(
    ("stops", "pushes", "include", "expected", "flushed"),
    [pytest.param(*case[1:], id=case[0]) for case in TABLE],
)
def test_table(
    stops: list[str],
    pushes: list[str],
    include: bool,
    expected: list[Result],
    flushed: str,
) -> None:
    results, rest = run(stops, pushes, include=include)
    assert results == expected
    assert rest == flushed
    # Every table case also agrees with the offline reference.
    whole = "".join(pushes)
    assert released_text(results) + rest == reference_output(whole, stops, include=include)


def test_withheld_is_visible_between_pushes() -> None:
    jail = StopJail(["ozzy"])
    assert jail.withheld == ""
    assert jail.push("o") == Released("")
    assert jail.withheld == "o"
    assert jail.push("zz") == Released("")
    assert jail.withheld == "ozz"
    assert jail.push("o") == Released("ozz")
    assert jail.withheld == "o"
    assert jail.push("there") == Released("othere")
    assert jail.withheld == ""


def test_push_after_stop_raises() -> None:
    jail = StopJail(["x"])
    assert jail.push("axb") == Stopped("a", "x")
    assert jail.stopped
    with pytest.raises(RuntimeError, match="after a stop"):
        jail.push("more")
    with pytest.raises(RuntimeError):
        jail.push("")


def test_flush_after_stop_returns_empty() -> None:
    jail = StopJail(["stop"], include_stop_in_output=True)
    assert jail.push("a sto") == Released("a ")
    assert jail.push("p and") == Stopped("stop", "stop")
    assert jail.withheld == ""
    assert jail.flush() == ""
    assert jail.flush() == ""


def test_flush_clears_and_matching_restarts() -> None:
    jail = StopJail(["ab"])
    assert not jail.stopped
    assert jail.push("xa") == Released("x")
    assert jail.flush() == "a"
    assert jail.withheld == ""
    assert jail.flush() == ""
    # "a" was released by the flush, so it can no longer be the start of "ab".
    assert jail.push("b") == Released("b")
    assert jail.push("ab") == Stopped("", "ab")


def test_no_stops_returns_the_same_string() -> None:
    jail = StopJail([])
    text = "some text " * 10
    result = jail.push(text)
    assert isinstance(result, Released)
    assert result.text is text
    assert jail.withheld == ""
    assert jail.flush() == ""
    assert not jail.stopped


def test_unrelated_text_is_not_copied() -> None:
    jail = StopJail(["\n\n", "</s>"])
    text = "no stop characters here"
    result = jail.push(text)
    assert isinstance(result, Released)
    assert result.text is text


def test_include_stop_in_output_property() -> None:
    assert StopJail(["a"]).include_stop_in_output is False
    assert StopJail(["a"], include_stop_in_output=True).include_stop_in_output is True


def test_single_string_is_rejected() -> None:
    with pytest.raises(TypeError, match="not a single str"):
        StopJail("stop")


def test_non_string_stop_is_rejected() -> None:
    with pytest.raises(TypeError, match="must be str"):
        StopJail(["ok", 3])  # type: ignore[list-item]


def test_accepts_any_iterable() -> None:
    jail = StopJail(s for s in ("b", "a"))
    assert jail.push("xa") == Stopped("x", "a")


# --------------------------------------------------------------------------- the matcher


def test_compile_is_shared_across_requests() -> None:
    first = StopJail(["b", "a", "a", ""]).matcher
    assert StopJail(("a", "b")).matcher is first
    assert StopMatcher.compile(("b", "", "a")) is first
    assert first.stops == ("a", "b")
    assert StopJail([]).matcher is StopJail(["", ""]).matcher


def test_matcher_is_immutable() -> None:
    matcher = StopMatcher.compile(("abc",))
    with pytest.raises(AttributeError, match="immutable"):
        matcher.stops = ("x",)
    with pytest.raises(AttributeError, match="immutable"):
        del matcher.stops


def test_matcher_shape() -> None:
    matcher = StopMatcher.compile(("abc", "abd", "b"))
    assert matcher.max_len == 3
    assert matcher.state_count == 6  # root, a, ab, abc, abd, b
    assert repr(matcher) == "StopMatcher(stops=('abc', 'abd', 'b'))"
    assert StopMatcher.compile(()).max_len == 0


def test_jails_sharing_a_matcher_are_independent() -> None:
    one, two = StopJail(["ozzy"]), StopJail(["ozzy"])
    assert one.matcher is two.matcher
    assert one.push("oz") == Released("")
    assert two.push("x") == Released("x")
    assert two.withheld == ""
    assert one.push("zy") == Stopped("", "ozzy")
    assert two.push("ozzy") == Stopped("", "ozzy")


# --------------------------------------------------------------------------- find_stop


def brute_force_stop(text: str, stops: Sequence[str]) -> tuple[int, int, str] | None:
    """Independent check of the rule: scan end positions, take the longest stop ending there."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if s and text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return end - len(stop), end, stop
    return None


@pytest.mark.parametrize(
    ("text", "stops", "expected"),
    [
        ("there", ["re", "he"], (1, 3, "he")),
        ("abcd", ["abcd", "bc"], (1, 3, "bc")),
        ("abc", ["bc", "abc"], (0, 3, "abc")),
        ("aaab", ["aab"], (1, 4, "aab")),
        ("nothing", ["x", ""], None),
        ("", ["a"], None),
        ("abc", [], None),
    ],
)
def test_find_stop_examples(
    text: str, stops: list[str], expected: tuple[int, int, str] | None
) -> None:
    assert find_stop(text, stops) == expected
    assert brute_force_stop(text, stops) == expected


# --------------------------------------------------------------------------- properties

SMALL = "abz"
small_texts = st.text(alphabet=SMALL, max_size=40)
small_stop_sets = st.lists(st.text(alphabet=SMALL, min_size=1, max_size=5), min_size=1, max_size=4)
cut_lists = st.lists(st.integers(min_value=0, max_value=40), max_size=12)


@given(text=small_texts, stops=small_stop_sets)
def test_find_stop_matches_brute_force(text: str, stops: list[str]) -> None:
    assert find_stop(text, stops) == brute_force_stop(text, stops)


def check_stream(stops: Sequence[str], chunks: Sequence[str], *, include: bool) -> None:
    """Push `chunks` and assert every invariant against the offline reference."""
    text = "".join(chunks)
    expected = reference_output(text, stops, include=include)
    match = find_stop(text, stops)
    jail = StopJail(stops, include_stop_in_output=include)
    out = ""
    consumed = 0
    for chunk in chunks:
        result = jail.push(chunk)
        consumed += len(chunk)
        out += result.text
        # No leak (B1) and no reordering (B3): released text is always a prefix of the result.
        assert expected.startswith(out)
        if isinstance(result, Stopped):
            assert match is not None
            _, end, stop = match
            # The stop fires in the push that completes it, never earlier or later.
            assert consumed - len(chunk) < end <= consumed
            assert result.stop == stop
            assert jail.stopped
            assert jail.withheld == ""
            assert jail.flush() == ""
            assert out == expected
            return
        # Exact withholding (B16): the longest tail that is a proper prefix of a stop.
        unreleased = text[len(out) : consumed]
        assert jail.withheld == naive_withheld(unreleased, stops)
        assert not jail.stopped
    assert match is None or match[1] > consumed
    out += jail.flush()
    assert out == expected


@settings(max_examples=400)
@given(text=small_texts, stops=small_stop_sets, cuts=cut_lists, include=st.booleans())
def test_split_invariance_small_alphabet(
    text: str, stops: list[str], cuts: list[int], include: bool
) -> None:
    check_stream(stops, split(text, cuts), include=include)


@given(text=small_texts, stops=small_stop_sets, include=st.booleans())
def test_char_by_char_equals_one_push(text: str, stops: list[str], include: bool) -> None:
    check_stream(stops, list(text), include=include)
    check_stream(stops, [text], include=include)


@given(data=st.data(), include=st.booleans())
def test_split_invariance_unicode_stops_cut_from_text(data: st.DataObject, include: bool) -> None:
    text = data.draw(st.text(min_size=1, max_size=30), label="text")
    spans = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)), min_size=1, max_size=3
        ),
        label="spans",
    )
    stops = [text[a : a + n] for a, n in spans]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10), label="cuts")
    check_stream(stops, split(text, cuts), include=include)


@settings(max_examples=300)
@given(data=st.data(), include=st.booleans())
def test_split_invariance_binary_alphabet_overlapping_stops(
    data: st.DataObject, include: bool
) -> None:
    # Stops cut from the text itself over {a, b}: matches and nested overlaps are the norm.
    text = data.draw(st.text(alphabet="ab", min_size=1, max_size=30), label="text")
    spans = data.draw(
        st.lists(
            st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)), min_size=1, max_size=5
        ),
        label="spans",
    )
    stops = [text[a : a + n] for a, n in spans]
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10), label="cuts")
    check_stream(stops, split(text, cuts), include=include)


@given(text=st.text(max_size=40), cuts=cut_lists, stops=st.sampled_from([[], [""], ["", ""]]))
def test_no_stops_releases_every_push_verbatim(
    text: str, cuts: list[int], stops: list[str]
) -> None:
    jail = StopJail(stops)
    for chunk in split(text, cuts):
        assert jail.push(chunk) == Released(chunk)
        assert jail.withheld == ""
    assert jail.flush() == ""


# --------------------------------------------------------------------------- long streams


LONG_STOP = "a" * 200 + "b" + "a" * 200


@pytest.mark.parametrize("include", [False, True])
def test_long_repetitive_stop_on_a_long_stream(include: bool) -> None:
    """Correctness over 200k pushes; the cost side of B12 lives in the benchmark."""
    jail = StopJail([LONG_STOP], include_stop_in_output=include)
    n = 200_000
    for i in range(n):
        result = jail.push("a")
        # Exactly one character out per push once the jail is full: no history effect.
        assert result == Released("" if i < 200 else "a")
    assert jail.withheld == "a" * 200
    # An abandoned near-match releases everything, in order.
    assert jail.push("b" + "a" * 199) == Released("")
    assert jail.withheld == "a" * 200 + "b" + "a" * 199
    assert jail.push("c") == Released("a" * 200 + "b" + "a" * 199 + "c")
    assert jail.withheld == ""
    # Now a real match, split across pushes.
    assert jail.push("a" * 300) == Released("a" * 100)
    assert jail.push("b") == Released("")
    final = jail.push("a" * 200 + "tail")
    assert final == Stopped(LONG_STOP if include else "", LONG_STOP)


def test_long_stream_matches_reference_in_large_chunks() -> None:
    stops = [LONG_STOP, "ab" + "a" * 1000]
    prefix = ("a" * 150 + "b") * 1500  # near-misses all the way, never a match
    text = prefix + LONG_STOP + "after"
    chunks = [text[i : i + 4093] for i in range(0, len(text), 4093)]
    results, rest = run(stops, chunks)
    assert results[-1] == Stopped(results[-1].text, LONG_STOP)
    assert released_text(results) + rest == prefix
    assert reference_output(text, stops, include=False) == prefix
