"""Contracts: the types and agreements that operators, engines and edges share.

:mod:`.llm` (the hot-path request and output types), :mod:`.resumption` (how Migration and
the Backend agree on resuming a request), :mod:`.rewriting` (operators that change the
output text), :mod:`.constraint_guard` (constrained requests an engine cannot honour) and
:mod:`.transport` (the LLM types over the NATS wire), with :mod:`.retry_elsewhere` (the
routing policy whose retries avoid the workers a request tried: NATS workers, upstream
servers). They import nothing of the edges, the engines or the CLI: everything else may
stand on them.
"""

from __future__ import annotations

__all__ = ()
