"""What another process holds in memory, read from ``/proc`` (Linux), for tests and
benchmarks that bound a server's growth without a dependency (psutil) just for that."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ("rss_kib",)

_FIELD = re.compile(r"^(?P<name>\w+):\s+(?P<value>\d+) kB$", re.MULTILINE)


def rss_kib(pid: int, field: str = "VmRSS") -> int:
    """Process ``pid``'s resident memory in KiB (``field``: ``VmRSS``, or ``VmHWM`` for its
    peak)."""
    status = Path(f"/proc/{pid}/status").read_text()
    for match in _FIELD.finditer(status):
        if match["name"] == field:
            return int(match["value"])
    raise LookupError(f"no {field} in /proc/{pid}/status")
