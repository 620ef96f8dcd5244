"""The test suite. ``tests/`` and each of its folders are packages, so every test module
has a dotted name of its own (``tests.operators.cli.test_cli``) and a helper is imported by
its name (``from tests.helpers.server_process import ServerProcess``): pytest puts the
repository's root on the import path, and no test edits ``sys.path``
(``tests/test_layering.py`` checks). A test folder named like an installed package
(``tests/pipeline/transports/nats/``) is ``tests.pipeline.transports.nats``, so it never
shadows the package."""
