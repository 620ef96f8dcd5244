"""Helpers shared by the tests of several folders: subprocesses (``server_process``,
``nats_server``), test operators and tokenizers (``shout``, ``byte_tokenizer``), client-side
views and scripted outputs (``client_view``, ``output_scripts``), and ``vllm_support``.

A helper used by one folder's tests sits beside them instead (``parsers/parser_cases``,
``telemetry/otlp_receiver``, ``engines/remote/fake_upstream``, the NATS worker scripts).
Test doubles for users are not here: they ship in ``pipeline.testing`` and
``operators.testing``."""
