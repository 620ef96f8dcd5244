"""``[[model]]`` tables of a TOML file, each parsed by a command's own parser.

``serve --models`` (:mod:`.models_file`) and ``planner --models`` (:mod:`.planner_args`)
read their files the same way: each table over the command line's options, its ``name``
as one flag and every other key as the flag of that name, checked as the flag checks it;
the command's own options (``whole``) are refused in a table. Every error is one line
naming the file, the model and the option.
"""

from __future__ import annotations

import argparse
import copy
import io
import tomllib
from collections.abc import Callable, Hashable
from contextlib import redirect_stderr
from pathlib import Path
from typing import Any

__all__ = ("read_tables", "subparser")


def read_tables(
    path: Path,
    command: argparse.ArgumentParser,
    args: argparse.Namespace,
    *,
    whole: frozenset[str],
    owner: str,
    name_flag: str,
    check: Callable[[argparse.Namespace], None],
    key: Callable[[argparse.Namespace], Hashable],
) -> list[argparse.Namespace]:
    """Each ``[[model]]`` of ``path`` parsed by ``command`` (a subcommand's parser) over
    ``args``: its ``name`` as ``name_flag``, its other keys as their flags (``whole``: the
    options of the whole ``owner``, refused in a table), each result ``check`` ed; two
    tables with the same ``key`` are an error.

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
    seen: set[Hashable] = set()
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
        argv = [name_flag, name, *_argv(table, command, path.parent, where, whole, owner)]
        namespace = copy.deepcopy(args)
        namespace.models = None
        errors = io.StringIO()
        try:
            with redirect_stderr(errors):
                command.parse_args(argv, namespace=namespace)
                check(namespace)
        except SystemExit:
            message = errors.getvalue().strip().splitlines()
            raise ValueError(f"{where}: {message[-1] if message else 'invalid options'}") from None
        if key(namespace) in seen:
            raise ValueError(f"{where}: the name is given twice")
        seen.add(key(namespace))
        parsed.append(namespace)
    return parsed


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """The parser of subcommand ``name`` within ``parser``."""
    for action in parser._subparsers._group_actions if parser._subparsers else ():
        choices = getattr(action, "choices", None)
        if isinstance(choices, dict) and name in choices:
            found: argparse.ArgumentParser = choices[name]
            return found
    raise ValueError(f"the parser has no {name} command")


def _argv(
    table: dict[str, Any],
    command: argparse.ArgumentParser,
    folder: Path,
    where: str,
    whole: frozenset[str],
    owner: str,
) -> list[str]:
    """The table's options as command-line arguments (relative paths from ``folder``)."""
    argv: list[str] = []
    for key, value in table.items():
        if key == "name":
            continue
        if key in whole:
            raise ValueError(
                f"{where}: {key!r} is an option of the whole {owner}: give it on the command line"
            )
        action = command._option_string_actions.get(f"--{key}")
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
