"""The roles a worker can serve, named once for the transport and the command line.

A module of its own so that naming a role needs no transport: ``llm-pipeline --help``
lists them without the ``[nats]`` extra installed.
"""

from __future__ import annotations

from typing import Final, Literal

__all__ = ("ROLES", "Role")

Role = Literal["aggregated", "prefill", "decode", "encode"]
"""What a worker does: everything, prompt prefill only, decode after a prefill, or encode
images."""
#: every role, in the order ``--help`` lists them
ROLES: Final[tuple[Role, ...]] = ("aggregated", "prefill", "decode", "encode")
