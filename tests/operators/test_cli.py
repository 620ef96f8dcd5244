"""``llm-pipeline`` options that need no server: the llama engine's batching flags."""

from __future__ import annotations

import argparse

import pytest

from operators import cli
from operators.engines.llama import DEFAULT_PARALLEL, DEFAULT_STEP_TOKENS


def parse(*argv: str) -> argparse.Namespace:
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    cli._check_args(parser, args)
    return args


def test_parallel_and_step_tokens_default_to_the_engine_defaults() -> None:
    args = parse("serve", "--engine", "llama")
    assert args.parallel == DEFAULT_PARALLEL == cli.DEFAULT_LLAMA_PARALLEL
    assert args.step_tokens == DEFAULT_STEP_TOKENS == cli.DEFAULT_LLAMA_STEP_TOKENS
    args = parse("serve", "--engine", "llama", "--parallel", "8", "--step-tokens", "256")
    assert (args.parallel, args.step_tokens) == (8, 256)
    assert (
        parse(
            "worker", "--nats", "nats://127.0.0.1:4222", "--engine", "llama", "--parallel", "2"
        ).parallel
        == 2
    )


@pytest.mark.parametrize(
    "argv",
    [
        ("--parallel", "0"),
        ("--parallel", "-1"),
        ("--step-tokens", "8"),  # under 16
        ("--parallel", "64", "--step-tokens", "32"),  # fewer than one token per sequence
    ],
)
def test_bad_batching_options_are_rejected(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("serve", "--engine", "llama", *argv)
    assert caught.value.code == 2
    assert "--parallel" in capsys.readouterr().err or "--step-tokens" in argv
