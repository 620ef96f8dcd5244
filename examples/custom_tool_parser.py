"""A tool-call format of your own: registered from Python, served as OpenAI ``tool_calls``.

A model that writes its calls as ``<functioncall>{"name": ..., "arguments": ...}</functioncall>``
needs one :class:`~operators.parsers.MarkerToolFormat`. Registered by name, it is what
``build_app(tool_call_parser=...)`` (or ``serve --tool-call-parser functioncall``) uses: the
markers never reach ``content``, each call becomes a ``tool_calls`` entry, and the finish
reason is ``"tool_calls"``. The echo engine plays the model here: with a template that
renders only the last message, it "says" exactly what the user wrote.

Run it: ``python examples/custom_tool_parser.py``.
"""

from __future__ import annotations

from typing import Any

import anyio

from operators.engines import EchoEngine
from operators.parsers import MarkerToolFormat, register_tool_parser
from operators.serving import build_app
from operators.testing import openai_client
from operators.text.tokenizer import Tokenizer

WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
SAID = f"Let me check. <functioncall>{CALL}</functioncall>"

FUNCTIONCALL = MarkerToolFormat(start="<functioncall>", end="</functioncall>")
register_tool_parser("functioncall", FUNCTIONCALL)


async def main() -> None:
    tokenizer = Tokenizer.default()
    app = build_app(
        EchoEngine.from_tokenizer(tokenizer),
        tokenizer,
        model_name="echo",
        chat_template="{{ messages[-1]['content'] }}",  # the echo repeats the last message
        tool_call_parser="functioncall",
    )
    async with openai_client(app) as client:
        reply = await client.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": SAID}], tools=[WEATHER]
        )
    [choice] = reply.choices
    print(f"content: {choice.message.content!r}")
    for call in choice.message.tool_calls or ():
        if call.type == "function":  # (the SDK's other kind, "custom", has no function)
            print(f"call: {call.function.name}({call.function.arguments})")
    print(f"finish_reason: {choice.finish_reason}")


if __name__ == "__main__":
    anyio.run(main)
