"""The keys file (``operators.edges.http.tenants``): every field checked, every mistake one
error naming the line, keys found by their digest, names and keys unique; and the Guard
that holds them, reloaded."""

from __future__ import annotations

import hashlib
import textwrap
from pathlib import Path

import pytest

from operators.edges.http.guard import Guard
from operators.edges.http.limits import Limits
from operators.edges.http.tenants import (
    ANONYMOUS,
    MAX_LIMIT,
    KeysFileError,
    Tenants,
    load_tenants,
    parse_tenants,
)


def keys(text: str) -> Tenants:
    return parse_tenants(textwrap.dedent(text), "keys.toml")


def scope(key: str | None, header: str = "authorization") -> dict[str, object]:
    if key is None:
        return {"headers": []}
    value = f"Bearer {key}" if header == "authorization" else key
    return {"headers": [(header.encode(), value.encode())]}


FULL = """
[[key]]
name = "team-a"
key = "sk-a"
priority = -2
requests_per_minute = 60
tokens_per_minute = 1000
max_inflight = 4
models = ["llama-*", "smollm2"]
share = 2.5

[[key]]
name = "boss"
key_sha256 = "{digest}"
admin = true
""".format(digest=hashlib.sha256(b"sk-boss").hexdigest())


def test_a_full_file_is_read_with_every_field() -> None:
    tenants = keys(FULL)
    assert tenants.names == ("team-a", "boss")
    team = tenants.find(b"sk-a")
    assert team is not None
    assert (team.name, team.priority, team.share, team.admin) == ("team-a", -2, 2.5, False)
    assert team.limits == Limits(60, 1000, 4)
    assert team.may_use("llama-3b")
    assert team.may_use("smollm2")
    assert not team.may_use("smollm2-instruct")
    assert not team.may_use("other")
    boss = tenants.find(b"sk-boss")
    assert boss is not None
    assert boss.admin
    assert boss.may_use("anything")
    assert boss.limits == Limits()
    assert tenants.find(b"sk-c") is None
    assert tenants.named("boss") is boss
    assert tenants.limited


def test_the_key_is_never_kept_or_shown() -> None:
    tenants = keys(FULL)
    assert "sk-a" not in repr(tenants)
    assert all(b"sk-a" not in tenant.digest for tenant in tenants)
    assert "sk-a" not in repr(Guard(tenants=tenants))


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        # not TOML at all: tomllib's own line
        ('[[key]]\nname = "a"\nkey = "sk\n', 3, "not valid TOML"),
        # a misspelled limit must not quietly mean "unlimited"
        ('[[key]]\nname = "a"\nkey = "k"\ntoken_per_minute = 5\n', 4, "unknown field"),
        ('[[key]]\nname = "a"\nkey = "k"\nrequests_per_minute = -1\n', 4, "from 1 to"),
        ('[[key]]\nname = "a"\nkey = "k"\nrequests_per_minute = 0\n', 4, "from 1 to"),
        ('[[key]]\nname = "a"\nkey = "k"\ntokens_per_minute = 1.5\n', 4, "integer"),
        ('[[key]]\nname = "a"\nkey = "k"\nmax_inflight = true\n', 4, "integer"),
        (f'[[key]]\nname = "a"\nkey = "k"\ntokens_per_minute = {MAX_LIMIT + 1}\n', 4, "from 1"),
        ('[[key]]\nname = "a"\nkey = "k"\npriority = 9999999999\n', 4, "priority"),
        ('[[key]]\nname = "a"\nkey = "k"\nshare = 0\n', 4, "share"),
        ('[[key]]\nname = "a"\nkey = "k"\nshare = inf\n', 4, "share"),
        ('[[key]]\nname = "a"\nkey = "k"\nadmin = "yes"\n', 4, "true or false"),
        ('[[key]]\nname = "a"\nkey = "k"\nmodels = []\n', 4, "non-empty list"),
        ('[[key]]\nname = "a"\nkey = "k"\nmodels = ["llama-[ab"]\n', 4, "'['"),
        ('[[key]]\nname = "a"\nkey = "k"\nmodels = [""]\n', 4, "non-empty string"),
        ('[[key]]\nname = "a"\nkey = "k"\nmodels = [3]\n', 4, "non-empty string"),
        ('[[key]]\nname = "a"\nkey = "k"\nmodels = ["a\\u0007b"]\n', 4, "control character"),
        ('[[key]]\nname = "a b"\nkey = "k"\n', 2, "'name'"),
        ('[[key]]\nkey = "k"\n', 1, "'name'"),
        ('[[key]]\nname = "a"\n', 1, "either 'key' or 'key_sha256'"),
        ('[[key]]\nname = "a"\nkey = "k"\nkey_sha256 = "00"\n', 1, "either"),
        ('[[key]]\nname = "a"\nkey_sha256 = "abc"\n', 3, "64 hex digits"),
        ('[[key]]\nname = "a"\nkey = " k"\n', 3, "surrounding spaces"),
        ('[[key]]\nname = "a"\nkey = ""\n', 3, "non-empty"),
        # duplicates: a name, a key, a key given once plain and once as its digest
        ('[[key]]\nname = "a"\nkey = "k"\n\n[[key]]\nname = "a"\nkey = "j"\n', 6, "taken"),
        ('[[key]]\nname = "a"\nkey = "k"\n\n[[key]]\nname = "b"\nkey = "k"\n', 7, "same key"),
        (
            '[[key]]\nname = "a"\nkey = "k"\n\n[[key]]\nname = "b"\nkey_sha256 = "'
            + hashlib.sha256(b"k").hexdigest()
            + '"\n',
            7,
            "same key",
        ),
        ('title = "x"\n[[key]]\nname = "a"\nkey = "k"\n', 1, "unknown setting"),
    ],
)
def test_every_mistake_is_an_error_naming_the_file_and_line(
    text: str, line: int, words: str
) -> None:
    with pytest.raises(KeysFileError) as refused:
        parse_tenants(text, "keys.toml")
    message = str(refused.value)
    assert message.startswith(f"keys.toml line {line}") or f"line {line}" in message
    assert words in message
    assert '"k"' not in message
    assert "'k'" not in message.replace("key 'a'", "")


def test_a_file_without_keys_is_refused() -> None:
    with pytest.raises(KeysFileError, match=r"no \[\[key\]\]"):
        parse_tenants("# nothing\n", "keys.toml")
    with pytest.raises(KeysFileError, match="array of tables"):
        parse_tenants('key = "sk-x"\n', "keys.toml")


def test_an_unreadable_file_is_an_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(KeysFileError, match="cannot read"):
        load_tenants(tmp_path / "missing.toml")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(KeysFileError, match=str(binary)):
        load_tenants(binary)


def test_huge_numbers_and_many_keys_are_read_in_bounds(tmp_path: Path) -> None:
    lines = []
    for number in range(300):
        lines += [
            "[[key]]",
            f'name = "k{number}"',
            f'key = "sk-{number}"',
            f"tokens_per_minute = {MAX_LIMIT}",
        ]
    path = tmp_path / "keys.toml"
    path.write_text("\n".join(lines))
    tenants = load_tenants(path)
    assert len(tenants) == 300
    found = tenants.find(b"sk-299")
    assert found is not None
    assert found.limits.tokens_per_minute == MAX_LIMIT


def test_the_guard_finds_each_request_its_tenant() -> None:
    guard = Guard(tenants=keys(FULL), api_keys={"plain": 3}, admin_keys=["root"])
    team, presented = guard.identify(scope("sk-a"))
    assert team is not None
    assert team.name == "team-a"
    assert presented
    assert guard.identify(scope("sk-a", "x-api-key"))[0] is team  # Anthropic's header
    assert guard.identify(scope("wrong")) == (None, True)
    assert guard.identify(scope(None)) == (None, False)
    plain = guard.identify(scope("plain"))[0]
    assert plain is not None
    assert plain.priority == 3
    assert plain.name.startswith("key-")
    assert "plain" not in plain.name
    assert guard.is_admin(scope("root"))
    assert guard.is_admin(scope("sk-boss"))
    assert not guard.is_admin(scope("sk-a"))
    assert not guard.is_admin(scope("plain"))
    assert guard.priority_for(scope("sk-a")) == -2
    # without keys every request is the one anonymous client
    assert Guard().identify(scope(None)) == (ANONYMOUS, False)


def test_a_reload_replaces_the_files_keys_and_keeps_the_flags() -> None:
    guard = Guard(tenants=keys(FULL), api_keys=["plain"])
    guard.reload(keys('[[key]]\nname = "new"\nkey = "sk-new"\n'))
    assert guard.identify(scope("sk-new"))[0] is not None
    assert guard.identify(scope("sk-a"))[0] is None  # removed: 401 from now on
    assert guard.identify(scope("plain"))[0] is not None
    with pytest.raises(ValueError, match="same key"):
        guard.reload(keys('[[key]]\nname = "dup"\nkey = "plain"\n'))
    assert guard.identify(scope("sk-new"))[0] is not None  # the old set stays


def test_a_key_given_as_a_flag_and_in_the_file_is_refused() -> None:
    with pytest.raises(ValueError, match="same key"):
        Guard(tenants=keys(FULL), api_keys=["sk-a"])


def test_the_readmes_keys_file_is_one_the_server_takes() -> None:
    readme = (Path(__file__).resolve().parents[4] / "README.md").read_text()
    section = readme.split("## Tenants", 1)[1].split("\n## ", 1)[0]
    sample = section.split("```toml\n", 1)[1].split("```", 1)[0]
    tenants = parse_tenants(sample, "README.md")
    assert tenants.names == ("team-a", "ops")
    team = tenants.find(b"test")  # (the sample's key_sha256 is sha256("test"))
    assert team is not None
    assert team.limits == Limits(600, 200000, 16)
    ops = tenants.named("ops")
    assert ops is not None
    assert ops.admin
    assert ops.priority == -1
