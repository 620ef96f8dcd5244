"""``serve --models FILE``: several models behind one server, read from a TOML file.

One ``[[model]]`` table per model: its ``name`` (what clients ask for), its ``engine``, and
that engine's options under the names of the command-line flags (without the dashes)::

    [[model]]
    name = "smol"
    engine = "llama"
    model = "SmolLM2-135M-Instruct.Q4_1.gguf"   # relative paths: from the file's folder
    parallel = 2
    n-ctx = 4096
    tool-call-parser = "hermes"

    [[model]]
    name = "echo"
    engine = "echo"
    chat-template = "plain.jinja"

Each table is parsed by ``serve``'s own parser, on top of the command line's options (so
a flag given on the command line applies to every model that does not set it, and every
value is checked as the flag checks it), and becomes one model's
:class:`~operators.cli.config.ServeConfig`. The server's own options (host, port, keys,
NATS, logs...) belong on the command line; in a table they are an error, as are unknown
names, a missing name and a name given twice. Every error is one line naming the file,
the model and the option (exit code 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from .args import check_args
from .tables import read_tables, subparser

__all__ = ("SERVER_OPTIONS", "read_models_file")

#: options of the whole server, never of one model
SERVER_OPTIONS: Final = frozenset(
    {
        "host",
        "port",
        "nats",
        "worker-wait",
        "api-key",
        "api-keys",
        "admin-api-key",
        "allowed-origins",
        "max-header-bytes",
        "max-inflight",
        "max-queued",
        "request-timeout",
        "drain-timeout",
        "responses-store-mb",
        "responses-store-ttl",
        "otlp-traces-endpoint",
        "log-format",
        "log-level",
        "no-ui",
        "models",
        "model-name",
        "lora-dir",
    }
)


def read_models_file(
    path: Path, parser: argparse.ArgumentParser, args: argparse.Namespace
) -> list[argparse.Namespace]:
    """Each ``[[model]]`` of ``path`` as ``serve``'s parsed arguments: ``args`` (the
    command line's) with the table's options over them.

    Raises:
        ValueError: the file cannot be read or parsed, has no ``[[model]]``, or a table is
            wrong (the message names the file, the model and the option).
    """
    return read_tables(
        path,
        subparser(parser, "serve"),
        args,
        whole=SERVER_OPTIONS,
        owner="server",
        name_flag="--model-name",
        check=lambda namespace: check_args(parser, namespace),
        key=lambda namespace: namespace.model_name,
    )
