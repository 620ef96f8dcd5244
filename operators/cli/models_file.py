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
import copy
import io
import tomllib
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any, Final

from .args import check_args

__all__ = ("SERVER_OPTIONS", "read_models_file")

#: options of the whole server, never of one model
SERVER_OPTIONS: Final = frozenset(
    {
        "host",
        "port",
        "nats",
        "worker-wait",
        "api-key",
        "admin-api-key",
        "allowed-origins",
        "max-header-bytes",
        "max-inflight",
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
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"--models {path}: cannot read it: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--models {path}: not valid TOML: {exc}") from exc
    unknown = set(document) - {"model"}
    if unknown:
        raise ValueError(
            f"--models {path}: unknown top-level key(s) {', '.join(sorted(unknown))} "
            "(expected [[model]] tables)"
        )
    tables = document.get("model")
    if not isinstance(tables, list) or not tables or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"--models {path}: expected one [[model]] table per model, found none")
    serve = _serve_parser(parser)
    seen: set[str] = set()
    parsed = []
    for position, table in enumerate(tables, 1):
        name = table.get("name")
        where = (
            f"--models {path}: model {name!r}"
            if name
            else f"--models {path}: [[model]] #{position}"
        )
        if not isinstance(name, str) or not name.strip():
            raise ValueError(f'{where}: needs a name (name = "...")')
        if name in seen:
            raise ValueError(f"{where}: the name is given twice")
        seen.add(name)
        argv = ["--model-name", name, *_argv(table, serve, path.parent, where)]
        namespace = copy.deepcopy(args)
        namespace.models = None
        errors = io.StringIO()
        try:
            with redirect_stderr(errors):
                serve.parse_args(argv, namespace=namespace)
                check_args(parser, namespace)
        except SystemExit:
            message = errors.getvalue().strip().splitlines()
            raise ValueError(f"{where}: {message[-1] if message else 'invalid options'}") from None
        parsed.append(namespace)
    return parsed


def _serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``serve`` subcommand's parser within ``parser``."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and "serve" in choices:
            found: argparse.ArgumentParser = choices["serve"]
            return found
    raise ValueError("the parser has no serve command")


def _argv(
    table: dict[str, Any], serve: argparse.ArgumentParser, folder: Path, where: str
) -> list[str]:
    """The table's options as command-line arguments (relative paths from ``folder``)."""
    argv: list[str] = []
    for key, value in table.items():
        if key == "name":
            continue
        if key in SERVER_OPTIONS:
            raise ValueError(
                f"{where}: {key!r} is an option of the whole server: give it on the command line"
            )
        action = serve._option_string_actions.get(f"--{key}")
        if action is None or key.startswith("-"):
            raise ValueError(f"{where}: unknown option {key!r}")
        values = value if isinstance(value, list) else [value]
        for item in values:
            argv.extend(_one(f"--{key}", item, action, folder, where))
    return argv


def _one(flag: str, value: Any, action: argparse.Action, folder: Path, where: str) -> list[str]:
    if isinstance(value, bool):
        if action.nargs != 0:
            raise ValueError(f"{where}: {flag[2:]} takes a value, not {str(value).lower()}")
        return [flag] if value else []
    if isinstance(value, dict | list):
        raise ValueError(f"{where}: {flag[2:]} must be a string or a number")
    if action.nargs == 0:
        raise ValueError(f"{where}: {flag[2:]} is true or false, not {value!r}")
    text = str(value)
    if action.type is Path and not Path(text).is_absolute():
        text = str(folder / text)
    elif flag == "--lora" and "=" in text:  # NAME=PATH: the path from the file's folder
        name, _, adapter = text.partition("=")
        if not Path(adapter).is_absolute():
            text = f"{name}={folder / adapter}"
    return [flag, text]
