"""``llm-pipeline`` options that need no server: the llama engine's flags (the engine's own
``LlamaOptions``), and the typed config the arguments become."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from operators import cli
from operators.cli.defaults import ROLES
from operators.cli.engines import llama_engine_options
from operators.cli.insertions import load_operator
from operators.cli.options import LLAMA_FLAGS
from operators.cli.serve import run_serve
from operators.edges.http.metrics import ServerMetrics
from operators.edges.openai.server import OpenAIApp
from operators.engines.llama import LlamaOptions, NgramSpeculation
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer

TOKENIZER = Tokenizer.default()


def parse(*argv: str) -> argparse.Namespace:
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    cli._check_args(parser, args)
    return args


def test_the_llama_flags_default_to_the_engines_options() -> None:
    args = parse("serve", "--engine", "llama")
    assert cli.EngineConfig.from_args(args).llama == LlamaOptions()
    args = parse("serve", "--engine", "llama", "--parallel", "8", "--step-tokens", "256")
    assert (args.parallel, args.step_tokens) == (8, 256)
    worker = ("worker", "--nats", "nats://127.0.0.1:4222", "--engine", "llama", "--parallel", "2")
    assert cli.WorkerConfig.from_args(parse(*worker)).engine.llama.parallel == 2


def test_every_llama_option_is_a_flag_or_set_when_the_engine_loads() -> None:
    fields = set(LlamaOptions.__dataclass_fields__)
    at_load = {"speculative", "block_size", "role", "worker_id", "transfer_secret", "loras"}
    assert set(LLAMA_FLAGS) == fields - at_load
    for flag in LLAMA_FLAGS.values():
        for command in (("serve",), ("worker", "--nats", "n")):
            assert not cli.build_parser().parse_known_args([*command, flag, "17"])[1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--parallel", "0"), "argument --parallel: must be >= 1, got 0"),
        (("--parallel", "-1"), "argument --parallel: must be >= 1"),
        (("--step-tokens", "8"), "argument --step-tokens: must be >= parallel (4) and >= 16"),
        (("--parallel", "64", "--step-tokens", "32"), "--step-tokens: must be >= parallel (64)"),
        (("--n-ctx", "8"), "argument --n-ctx: must be >= 16, got 8"),
        (("--threads", "0"), "argument --threads: must be >= 1, got 0"),
        (("--step-ms", "nan"), "argument --step-ms: must be >= 0, got nan"),
        (("--kv-disk-cache-mb", "-2"), "argument --kv-disk-cache-mb: must be >= 0"),
        (("--kv-transfer-timeout", "0"), "argument --kv-transfer-timeout: must be a number"),
    ],
)
def test_bad_llama_options_are_usage_errors_naming_the_flag(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("serve", "--engine", "llama", *argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_a_llama_engine_gets_the_shared_options_and_its_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(cli.TRANSFER_SECRET_ENV, raising=False)
    argv = (
        "serve", "--engine", "llama", "--parallel", "2", "--speculative", "ngram",
        "--ngram-size", "2", "--kv-block-size", "32", "--transfer-secret", "s",
        "--lora", "tiny=/a/tiny.gguf", "--kv-disk-cache", "/tmp/kv",
    )  # fmt: skip
    config = cli.ServeConfig.from_args(parse(*argv)).engine
    options = llama_engine_options(config, "prefill", "prefill-0", disk_cache=Path("/tmp/kv/p"))
    assert options == LlamaOptions(
        parallel=2,
        speculative=NgramSpeculation(ngram_size=2),
        block_size=32,
        role="prefill",
        worker_id="prefill-0",
        transfer_secret=b"s",
        kv_disk_cache=Path("/tmp/kv/p"),
        loras={"tiny": "/a/tiny.gguf"},
    )
    assert llama_engine_options(config).kv_disk_cache == Path("/tmp/kv")


# -- the typed config ---------------------------------------------------------------------


def test_the_configs_defaults_are_the_parsers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.delenv(cli.TRANSFER_SECRET_ENV, raising=False)
    assert cli.ServeConfig.from_args(parse("serve")) == cli.ServeConfig()
    worker = cli.WorkerConfig.from_args(parse("worker", "--nats", "nats://h:4222"))
    assert worker.id.startswith("aggregated-")
    assert worker == cli.WorkerConfig(nats="nats://h:4222", worker_id=worker.id)
    assert cli.WorkerConfig(nats="n", role="decode").id.startswith("decode-")


def test_from_args_converts_and_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cli.API_KEY_ENV, " from-env ")
    monkeypatch.setenv(cli.TRANSFER_SECRET_ENV, "shh")
    argv = (
        "serve", "--api-key", "k1", "--allowed-image-hosts", " a.example, ,b.example",
        "--engine", "mocker", "--prefill-workers", "2", "--port", "0",
    )  # fmt: skip
    config = cli.ServeConfig.from_args(parse(*argv))
    assert config.api_keys == ("k1", "from-env")
    assert config.allowed_image_hosts == frozenset({"a.example", "b.example"})
    assert (config.engine.engine, config.prefill_workers, config.port) == ("mocker", 2, 0)
    assert config.engine.transfer_secret == "shh"
    given = cli.ServeConfig.from_args(parse("serve", "--transfer-secret", "mine"))
    assert given.engine.transfer_secret == "mine"


@pytest.mark.parametrize(
    ("argv", "name"),
    [
        (("serve",), cli.DEFAULT_MODEL_NAME),
        (("serve", "--engine", "echo"), "echo"),
        (("serve", "--engine", "mocker"), "mocker"),
        (("serve", "--engine", "mocker", "--model-name", "m"), "m"),
        (("serve", "--engine", "llama"), cli.DEFAULT_LLAMA_MODEL_NAME),
        (("serve", "--engine", "llama", "--model", "/models/tiny-q4.gguf"), "tiny-q4"),
    ],
)
def test_the_served_model_name_defaults_by_engine(argv: tuple[str, ...], name: str) -> None:
    assert cli.ServeConfig.from_args(parse(*argv)).model_name == name


def test_a_llama_engine_uses_its_models_tokenizer_unless_told() -> None:
    model = Path("/models/tiny.gguf")
    assert cli.EngineConfig(engine="llama", model=model).tokenizer_path == model
    assert cli.EngineConfig(engine="llama", model=model, tokenizer=Path("t")).tokenizer_path == (
        Path("t")
    )
    assert cli.EngineConfig(engine="echo", model=model).tokenizer_path is None


@pytest.mark.parametrize("typed", [True, False], ids=["config", "namespace"])
async def test_build_graph_takes_the_config_or_the_parsed_arguments(typed: bool) -> None:
    args = parse("serve", "--model-name", "m", "--fail-after-tokens", "1", "--decode-workers", "2")
    metrics = ServerMetrics()
    graph = cli.build_graph(cli.ServeConfig.from_args(args) if typed else args, TOKENIZER, metrics)
    app = OpenAIApp(graph, model_name="m", metrics=metrics)
    async with openai_client(app) as client:
        reply = await client.completions.create(model="m", prompt="a b c")
    assert (reply.model, reply.choices[0].text) == ("m", "a b c")
    assert 'outcome="retried"} 1.0' in metrics.render().decode()  # counted in its metrics


def test_the_worker_roles_are_the_transports() -> None:
    nats = pytest.importorskip("pipeline.transports.nats", exc_type=ImportError)
    assert nats.ROLES == ROLES


# -- serve --insert-before ------------------------------------------------------------------


async def test_insert_before_splices_operators_into_the_served_graph_in_order() -> None:
    args = parse(
        "serve", "--model-name", "m",
        "--insert-before", "backend=tests.helpers.shout:Exclaim",
        "--insert-before", "backend=tests.helpers.shout:Shout",
    )  # fmt: skip
    config = cli.ServeConfig.from_args(args)
    assert config.insert_before == (
        ("backend", "tests.helpers.shout:Exclaim"),
        ("backend", "tests.helpers.shout:Shout"),
    )
    metrics = ServerMetrics()
    app = OpenAIApp(cli.build_graph(config, TOKENIZER, metrics), model_name="m", metrics=metrics)
    async with openai_client(app) as client:
        reply = await client.completions.create(model="m", prompt="a b")
    # Exclaim is in front of Shout, so it sees Shout's output: "!" after upper-casing
    assert reply.choices[0].text == "A! B!"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("backend", "expected STAGE=MODULE:NAME"),
        ("backend=tests.helpers.shout", "expected STAGE=MODULE:NAME"),
        (
            "detokenizer=tests.helpers.shout:Shout",
            "'preprocessor', 'parser', 'migration', 'backend'",
        ),
    ],
)
def test_a_malformed_insertion_is_a_usage_error(
    value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse("serve", "--insert-before", value)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("no_such_module_here:Shout", "cannot import no_such_module_here:Shout"),
        ("tests.helpers.shout:Missing", "cannot import tests.helpers.shout:Missing"),
        (
            "tests.helpers.shout:broken",
            "tests.helpers.shout:broken() failed: RuntimeError('no configuration')",
        ),
        ("tests.helpers.shout:not_an_operator", "has no generate() method"),
    ],
)
async def test_an_operator_that_cannot_be_loaded_stops_serve_with_code_2(
    spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        load_operator(spec)
    config = cli.ServeConfig(insert_before=(("backend", spec),))
    assert await run_serve(config, TOKENIZER) == 2  # before loading or listening
    assert message in capsys.readouterr().err


async def test_a_misplaced_operator_stops_serve_with_code_2_naming_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    shout = "tests.helpers.shout:Shout"  # a text operator
    config = cli.ServeConfig(insert_before=(("engine", shout),))
    assert await run_serve(config, TOKENIZER) == 2  # before loading or listening
    error = capsys.readouterr().err
    assert "tests.helpers.shout:Shout: Shout cannot go before 'engine'" in error
    assert "yields BackendOutput, not EngineOutput" in error


# -- KV that moves (issue 26) -------------------------------------------------------------------


def test_llama_workers_take_the_disaggregation_roles_and_kv_options() -> None:
    url = ("--nats", "nats://127.0.0.1:4222")
    for role in ("prefill", "decode"):
        args = parse("worker", *url, "--engine", "llama", "--role", role)
        assert cli.WorkerConfig.from_args(args).role == role
    argv = (
        "serve", "--engine", "llama", "--prefill-workers", "1", "--decode-workers", "2",
        "--router", "kv", "--kv-restore-cost", "0.25", "--kv-host-cache-mb", "256",
        "--kv-disk-cache", "/tmp/kv", "--kv-disk-cache-mb", "64", "--step-ms", "50",
        "--kv-transfer-host", "10.0.0.5", "--kv-transfer-timeout", "3",
    )  # fmt: skip
    config = cli.ServeConfig.from_args(parse(*argv))
    assert (config.prefill_workers, config.decode_workers, config.kv_restore_cost) == (1, 2, 0.25)
    llama = config.engine.llama
    assert (llama.kv_host_cache_mb, llama.kv_disk_cache, llama.kv_disk_cache_mb) == (
        256,
        Path("/tmp/kv"),
        64,
    )
    assert (llama.step_ms, llama.transfer_host, llama.transfer_timeout) == (50.0, "10.0.0.5", 3.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("worker", "--nats", "n", "--engine", "llama", "--role", "encode"), "--engine mocker"),
        (("worker", "--nats", "n", "--role", "prefill"), "--engine mocker or llama"),
        (("serve", "--prefill-workers", "1"), "--engine mocker or llama"),
        (("serve", "--engine", "llama", "--encode-workers", "1"), "--engine mocker"),
        (("serve", "--router", "kv", "--kv-restore-cost", "1.5"), "between 0 and 1"),
        (("serve", "--engine", "llama", "--kv-host-cache-mb", "-1"), "must be >= 0"),
        (("serve", "--engine", "mocker", "--echo", "last-message"), "needs --engine echo"),
        (("serve", "--nats", "nats://h:4222", "--echo", "last-message"), "needs --engine echo"),
        (("serve", "--echo", "last-message", "--chat-template", "t.jinja"), "--chat-template"),
        (("worker", "--nats", "n", "--echo", "last-message"), "--echo"),  # (serve's alone)
    ],
)
def test_options_out_of_place_are_usage_errors(
    argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err
