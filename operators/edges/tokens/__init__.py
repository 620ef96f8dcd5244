"""The tokens-in/tokens-out edge: vLLM's ``POST /inference/v1/generate`` over our graph.

:mod:`.protocol` parses vLLM's request into the graph's token request; :mod:`.reply`
renders the Backend's outputs in vLLM's response shapes; :mod:`.errors` is vLLM's error
body; :mod:`.edge` is the route (:class:`TokensEdge`), which ``build_app`` serves with the
other APIs.
"""

from __future__ import annotations

from .edge import GENERATE as GENERATE
from .edge import TokensEdge as TokensEdge

__all__ = ("GENERATE", "TokensEdge")
