"""Adding an operator to the default graph, and serving the result.

The default graph is six named stages (preprocessor, parser, migration, backend,
encoder_router, prefill_router) in front of an engine. ``build_app(..., before={stage:
[operators]})`` inserts operators just before a stage (or ``"engine"``) and serves the
result exactly like the default graph: metrics, migration and all. Here ``Shout`` sits
between Migration and the Backend, so it sees detokenized text, and the echo engine loses
its worker after two tokens: Migration retries, ``Shout`` runs again on the retry, the
client never notices. ``rewritten`` (``operators.contracts.rewriting``) gives the output its new
text and hides the original tokens' logprobs, which would otherwise still spell the
lower-case text.

Run it: ``python examples/extend_default_graph.py``.
"""

from __future__ import annotations

import anyio

from operators.contracts.llm import BackendOutput, PreprocessedRequest
from operators.contracts.rewriting import rewritten
from operators.engines import EchoEngine
from operators.graph import default_stages
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer
from pipeline import Context, Engine, Stream


class Shout:
    """Upper-cases the text on its way back to the client."""

    async def generate(
        self,
        ctx: Context[PreprocessedRequest],
        downstream: Engine[PreprocessedRequest, BackendOutput],
    ) -> Stream[BackendOutput]:
        async for output in downstream.generate(ctx):
            yield rewritten(output, output.text.upper())  # (its logprobs would show "hello")


tokenizer = Tokenizer.default()
engine = EchoEngine.from_tokenizer(tokenizer, fail_after_tokens=2)  # a worker dies
app = build_app(engine, tokenizer, model_name="echo", before={"backend": [Shout()]})


async def main() -> None:
    async with openai_client(app) as client:
        reply = await client.completions.create(model="echo", prompt="hello from the graph")
    print(reply.choices[0].text)

    # The same graph as a value: splice it, look at it, link it to an engine yourself.
    stages = default_stages(tokenizer, model_name="echo").insert_before("backend", Shout())
    print(" -> ".join(type(operator).__name__ for operator in stages), "-> engine")


if __name__ == "__main__":
    anyio.run(main)
