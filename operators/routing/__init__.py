"""Routing: which worker a request goes to, and what it tells the router.

:mod:`.kv_blocks` (a prompt's KV block hashes, the key of KV-aware routing),
:mod:`.kv_policy` (the KV router reading LLM requests: blocks, prompt length, conversation),
:mod:`.encoder_router` (multimodal requests to encode workers first) and
:mod:`.prefill_router` (disaggregated serving: prefill on one worker, decode on another).
The routers themselves are ``pipeline.routers``'; these are the LLM-specific operators on top.
"""

from __future__ import annotations

__all__ = ()
