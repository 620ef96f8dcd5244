"""The API edges: one package per wire protocol the server speaks, side by side.

An edge parses its API's request into what the graph takes (a ``PreprocessedRequest``, built
by the edge's preprocessor operator) and renders the graph's typed events back into its own
wire format (JSON bodies, server-sent events). Everything between the two ends — migration,
the Backend's stop jail, output parsers, admission, deadlines, metrics — is the graph's and is
written once, so a new edge is only a request module and a rendering module.

:mod:`operators.edges.openai` speaks chat completions, completions, embeddings and
tokenize (and holds what the graph speaks); :mod:`operators.edges.responses` the Responses
API and its store; :mod:`operators.edges.anthropic` Messages. :mod:`operators.edges.http`
is the plumbing they all share (the app, the guard, generations, the SSE writer, errors,
metrics), written once; ``examples/custom_edge.py`` is an edge of a user's own.
"""

from __future__ import annotations

__all__ = ()
