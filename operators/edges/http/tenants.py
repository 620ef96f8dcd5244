"""Who may call the server, and on what terms: a :class:`Tenant` per API key, read from
``--api-keys FILE`` (TOML) or made of ``--api-key`` flags.

::

    [[key]]
    name = "team-a"                 # what metrics, logs and /v1/usage call it (never the key)
    key_sha256 = "9f86d08..."       # sha256 of the key (or key = "sk-...": the key itself)
    priority = 0                    # its requests' default priority (lower runs earlier)
    requests_per_minute = 600
    tokens_per_minute = 200000      # prompt + output
    max_inflight = 16               # its requests running at once
    models = ["llama-*", "smollm2"] # what it may use (globs; left out: every model)
    share = 2                       # its weight when requests wait for a slot (default 1)
    admin = false                   # may read every key's usage and requests

Every field is checked, and a mistake is one error naming the file and the line: a limit
misspelled must not quietly mean "unlimited". Names are unique, and so are keys (a key
given twice would belong to whichever table came first).

A presented key is found by its SHA-256 digest in a dict: with a hundred keys, one
lookup instead of a hundred constant-time comparisons. What the lookup's timing could
tell is how far the digest of a key the caller chose matches a configured digest, which
says nothing of a configured key (finding a key from its digest is SHA-256's preimage
problem); the key itself is never compared, logged or kept (a ``key`` field is hashed as
it is read).
"""

from __future__ import annotations

import hashlib
import math
import re
import tomllib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any, Final, final

from .limits import Limits

__all__ = (
    "ANONYMOUS",
    "MAX_LIMIT",
    "KeysFileError",
    "Tenant",
    "Tenants",
    "key_digest",
    "load_tenants",
    "parse_tenants",
)

#: the largest limit a key may have (what a float counts exactly)
MAX_LIMIT: Final = 2**53
#: the most a priority may be either way (as the edge bounds a request's ``priority``)
_MAX_PRIORITY: Final = 2**31 - 1
#: the largest share (a weight: only ratios matter)
_MAX_SHARE: Final = 1e6
_NAME: Final = re.compile(r"[A-Za-z0-9._@:+-]{1,64}")
_HEX64: Final = re.compile(r"[0-9a-fA-F]{64}")
_TABLE: Final = re.compile(r"^\s*\[\[\s*key\s*\]\]\s*(#.*)?$")
_FIELDS: Final = frozenset(
    {
        "name",
        "key",
        "key_sha256",
        "priority",
        "requests_per_minute",
        "tokens_per_minute",
        "max_inflight",
        "models",
        "admin",
        "share",
    }
)


_UNLIMITED: Final = Limits()


def key_digest(key: str | bytes) -> bytes:
    """The SHA-256 digest of an API key (what ``key_sha256`` holds, as hex)."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).digest()


@final
@dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    """One API key's terms."""

    #: what metrics, logs and ``/v1/usage`` call it ("": the server has no keys)
    name: str
    #: the key's SHA-256 digest (b"": no key)
    digest: bytes = b""
    #: its requests' default priority
    priority: int = 0
    limits: Limits = _UNLIMITED
    #: the models it may use, as globs (empty: every model)
    models: tuple[str, ...] = ()
    #: its weight when requests wait for a slot
    share: float = 1.0
    #: may read every key's usage and requests
    admin: bool = False
    #: the models already matched against ``models`` (name -> allowed)
    _seen: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)

    def may_use(self, model: str) -> bool:
        """Whether this key may use the served model ``model``."""
        if not self.models:
            return True
        allowed = self._seen.get(model)
        if allowed is None:
            if len(self._seen) > 4096:  # (names come from the server, but stay bounded)
                self._seen.clear()
            allowed = self._seen[model] = any(fnmatchcase(model, p) for p in self.models)
        return allowed


#: the one client of a server without keys: no limits, every model, sees everything
ANONYMOUS: Final = Tenant(name="", admin=True)


@final
class Tenants:
    """The keys a server accepts, each with its :class:`Tenant`.

    Raises:
        ValueError: two tenants of one name, or of one key.
    """

    __slots__ = ("_by_digest", "_by_name")

    def __init__(self, tenants: Iterable[Tenant] = ()) -> None:
        self._by_digest: dict[bytes, Tenant] = {}
        self._by_name: dict[str, Tenant] = {}
        for tenant in tenants:
            if tenant.name in self._by_name:
                raise ValueError(f"two keys are named {tenant.name!r}")
            if tenant.digest in self._by_digest:
                other = self._by_digest[tenant.digest].name
                raise ValueError(f"the keys named {other!r} and {tenant.name!r} are the same key")
            self._by_digest[tenant.digest] = tenant
            self._by_name[tenant.name] = tenant

    @classmethod
    def of_keys(
        cls, api_keys: Iterable[str] | Mapping[str, int] = (), admin_keys: Iterable[str] = ()
    ) -> Tenants:
        """The tenants of plain keys (``--api-key KEY[:PRIORITY]``, ``--admin-api-key``):
        no limits, every model; each named ``key-`` and 8 hex digits of a salted digest of
        it (stable across restarts and frontends, and no key).

        Raises:
            ValueError: an empty key.
        """
        priorities = dict(api_keys) if isinstance(api_keys, Mapping) else dict.fromkeys(api_keys, 0)
        admins = set(admin_keys)
        for key in admins:
            priorities.setdefault(key, 0)
        tenants = []
        for key, priority in priorities.items():
            if not key.strip():
                raise ValueError("an API key must not be empty")
            digest = key_digest(key)
            name = "key-" + hashlib.sha256(b"llm-pipeline key name:" + digest).hexdigest()[:8]
            tenants.append(Tenant(name=name, digest=digest, priority=priority, admin=key in admins))
        return cls(tenants)

    def __add__(self, other: Tenants) -> Tenants:
        """Both sets (raises ValueError as the constructor does)."""
        return Tenants([*self, *other])

    def find(self, presented: bytes) -> Tenant | None:
        """The tenant of the key ``presented`` (None: no such key)."""
        return self._by_digest.get(hashlib.sha256(presented).digest())

    def named(self, name: str) -> Tenant | None:
        """The tenant called ``name``, or None."""
        return self._by_name.get(name)

    @property
    def names(self) -> tuple[str, ...]:
        """Every tenant's name."""
        return tuple(self._by_name)

    @property
    def limited(self) -> bool:
        """Whether any tenant has a limit."""
        return any(t.limits.any for t in self._by_name.values())

    def __iter__(self) -> Iterator[Tenant]:
        return iter(tuple(self._by_name.values()))

    def __len__(self) -> int:
        return len(self._by_name)

    def __bool__(self) -> bool:
        return bool(self._by_name)

    def __repr__(self) -> str:  # names, never keys
        return f"Tenants({list(self._by_name)})"


class KeysFileError(ValueError):
    """The keys file cannot be used: the message names the file and the line."""


def load_tenants(path: Path) -> Tenants:
    """The tenants of the keys file at ``path``.

    Raises:
        KeysFileError: it cannot be read, is not TOML, or a table is wrong (naming the line).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise KeysFileError(f"{path}: cannot read the keys file: {exc}") from None
    return parse_tenants(text, str(path))


def parse_tenants(text: str, where: str = "the keys file") -> Tenants:
    """The tenants of a keys file's ``text`` (``where`` names it in errors).

    Raises:
        KeysFileError: not TOML, or a table is wrong (naming the line).
    """
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KeysFileError(f"{where}: not valid TOML: {exc}") from None
    lines = text.splitlines()
    starts = [number for number, line in enumerate(lines, 1) if _TABLE.match(line)]
    extra = sorted(set(document) - {"key"})
    if extra:
        raise KeysFileError(
            f"{where}{_at(_line_of(lines, extra[0], 0, len(lines)))}: unknown setting "
            f"{extra[0]!r}: a keys file holds [[key]] tables only"
        )
    tables = document.get("key", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise KeysFileError(f"{where}: 'key' must be an array of tables ([[key]])")
    if not tables:
        raise KeysFileError(f"{where}: no [[key]] table: the server would accept no key")
    tenants: list[Tenant] = []
    seen_names: dict[str, int | None] = {}
    seen_digests: dict[bytes, str] = {}
    for index, table in enumerate(tables):
        first = starts[index] if len(starts) == len(tables) else None
        end = starts[index + 1] if first is not None and index + 1 < len(starts) else len(lines)
        reader = _Table(table, where, index, lines, first, end)
        tenant = reader.tenant()
        if tenant.name in seen_names:
            reader.fail(
                "name",
                f"the name {tenant.name!r} is taken already{_at(seen_names[tenant.name], 'on')}",
            )
        if tenant.digest in seen_digests:
            reader.fail(
                "key_sha256" if "key_sha256" in table else "key",
                f"the same key as {seen_digests[tenant.digest]!r}'s",
            )
        seen_names[tenant.name] = first
        seen_digests[tenant.digest] = tenant.name
        tenants.append(tenant)
    return Tenants(tenants)


def _at(line: int | None, word: str = "line") -> str:
    if line is None:
        return ""
    return f" line {line}" if word == "line" else f" (on line {line})"


def _line_of(lines: list[str], name: str, start: int, end: int) -> int | None:
    """The line (1-based) in ``lines[start:end]`` that sets ``name``, or None."""
    pattern = re.compile(rf"^\s*[\"']?{re.escape(name)}[\"']?\s*=")
    for number in range(start, end):
        if pattern.match(lines[number]):
            return number + 1
    return None


@dataclass(slots=True)
class _Table:
    """One ``[[key]]`` table being read."""

    table: dict[str, Any]
    where: str
    index: int
    lines: list[str]
    #: the line of its ``[[key]]`` header (None: not found, an inline table)
    first: int | None
    end: int

    def fail(self, name: str | None, message: str) -> None:
        line = self.first
        if name is not None and self.first is not None:
            line = _line_of(self.lines, name, self.first, self.end) or self.first
        label = self.table.get("name")
        which = f"key {label!r}" if isinstance(label, str) else f"key table #{self.index + 1}"
        place = f" line {line}" if line is not None else ""
        raise KeysFileError(f"{self.where}{place}: {which}: {message}")

    def tenant(self) -> Tenant:
        table = self.table
        unknown = sorted(set(table) - _FIELDS)
        if unknown:
            self.fail(
                unknown[0],
                f"unknown field {unknown[0]!r} (the fields are {', '.join(sorted(_FIELDS))})",
            )
        name = table.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            self.fail(
                "name" if "name" in table else None,
                "'name' must be 1 to 64 characters of A-Z a-z 0-9 . _ @ : + -",
            )
        assert isinstance(name, str)
        return Tenant(
            name=name,
            digest=self._digest(),
            priority=self._integer("priority", -_MAX_PRIORITY, _MAX_PRIORITY) or 0,
            limits=Limits(
                self._integer("requests_per_minute", 1, MAX_LIMIT),
                self._integer("tokens_per_minute", 1, MAX_LIMIT),
                self._integer("max_inflight", 1, MAX_LIMIT),
            ),
            models=self._models(),
            share=self._share(),
            admin=self._flag("admin"),
        )

    def _digest(self) -> bytes:
        table = self.table
        if ("key" in table) == ("key_sha256" in table):
            self.fail(None, "give either 'key' or 'key_sha256' (the key's SHA-256, in hex)")
        if "key" in table:
            key = table["key"]
            if not isinstance(key, str) or not key or key != key.strip():
                self.fail("key", "'key' must be a non-empty string without surrounding spaces")
            return key_digest(key)
        digest = table["key_sha256"]
        if not isinstance(digest, str) or not _HEX64.fullmatch(digest):
            self.fail("key_sha256", "'key_sha256' must be 64 hex digits (sha256sum of the key)")
        return bytes.fromhex(digest)

    def _integer(self, name: str, low: int, high: int) -> int | None:
        value = self.table.get(name)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            self.fail(name, f"{name!r} must be an integer from {low} to {high}, not {value!r}")
        assert isinstance(value, int)
        return value

    def _share(self) -> float:
        value = self.table.get("share", 1)
        valid = isinstance(value, int | float) and not isinstance(value, bool)
        if not valid or not math.isfinite(value) or not 0 < value <= _MAX_SHARE:
            self.fail("share", f"'share' must be a number above 0, at most {_MAX_SHARE:g}")
        return float(value)

    def _flag(self, name: str) -> bool:
        value = self.table.get(name, False)
        if not isinstance(value, bool):
            self.fail(name, f"{name!r} must be true or false")
        return bool(value)

    def _models(self) -> tuple[str, ...]:
        value = self.table.get("models")
        if value is None:
            return ()
        if not isinstance(value, list) or not value:
            self.fail(
                "models",
                "'models' must be a non-empty list of model names or globs (leave it out "
                "for every model)",
            )
        for pattern in value:
            problem = _glob_problem(pattern)
            if problem is not None:
                self.fail("models", problem)
        return tuple(value)


def _glob_problem(pattern: object) -> str | None:
    """What is wrong with a ``models`` entry (None: nothing)."""
    if not isinstance(pattern, str) or not pattern.strip():
        return f"a 'models' entry must be a non-empty string, not {pattern!r}"
    if any(ord(char) < 32 or ord(char) == 127 for char in pattern):
        return f"the 'models' entry {pattern!r} holds a control character"
    depth = 0
    for char in pattern:  # fnmatch takes an unclosed '[' literally: surely a mistake here
        if char == "[":
            depth += 1
        elif char == "]" and depth:
            depth -= 1
    if depth:
        return f"the 'models' entry {pattern!r} opens a '[' it does not close"
    return None
