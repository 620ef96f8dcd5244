"""Chat templates: a list of messages -> the prompt text the model was trained on.

Models ship their prompt format as a Jinja template (Hugging Face ``chat_template``, the
GGUF's ``tokenizer.chat_template``). Templates come from model files, which are not trusted
code, so they run in jinja2's ``ImmutableSandboxedEnvironment``, set up the way Hugging Face
``transformers`` sets it up (``trim_blocks``, ``lstrip_blocks``, loop controls, a
``tojson`` that keeps non-ASCII text, ``raise_exception``, ``strftime_now`` and the
``{% generation %}`` block), so templates written for ``apply_chat_template`` render the
same here. Compiled templates are cached by source text.
"""

from __future__ import annotations

import functools
import importlib.resources
import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, NoReturn

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pipeline import InvalidRequest

if TYPE_CHECKING:
    from jinja2.parser import Parser

__all__ = ("ChatTemplate", "last_message_template", "tool_chat_template")

_CACHE_SIZE: Final = 32


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates use
    return datetime.now().strftime(format)  # local time, as transformers does


class _GenerationBlock(Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for training
    masks in transformers; rendering only needs the body."""

    tags = {"generation"}  # noqa: RUF012 - jinja2's API

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_ENV: Final = _environment()


@functools.lru_cache(maxsize=_CACHE_SIZE)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


@functools.cache
def tool_chat_template() -> str:
    """The shipped tool-aware ChatML template (Hermes style: tools listed in the system
    turn, calls as ``<tool_call>{json}</tool_call>``, results in ``<tool_response>``).

    The preprocessor uses it for requests that involve tools when the model's own template
    ignores them (SmolLM2's has no tool section): a model told nothing of its tools cannot
    call them, and one whose earlier calls vanish from the history cannot follow up on
    their results.
    """
    return _TOOL_TEMPLATE.read_text(encoding="utf-8")


@functools.cache
def last_message_template() -> str:
    """The shipped template that renders a conversation as its last message's text alone.

    For the echo engine, which streams its prompt back: rendered with the model's own
    template, the prompt is the whole conversation (system prompt, role names, the tools
    preamble), and an agent loop fed that back never ends. Rendered with this one, echo
    answers with the last message (``serve --echo last-message``;
    ``build_app(EchoEngine..., chat_template=last_message_template())`` from Python).
    """
    return (_TEMPLATES / "last_message.jinja").read_text(encoding="utf-8")


_PROBE_TOOL: Final = "llm_pipeline_probe_tool"
#: found from the package root, not from this file, so the edge may move without losing them
_TEMPLATES: Final = importlib.resources.files("operators") / "data" / "templates"
_TOOL_TEMPLATE: Final = _TEMPLATES / "chatml_tools.jinja"


class ChatTemplate:
    """A compiled chat template and the special-token texts it may refer to.

    Raises:
        ValueError: ``source`` is not a valid Jinja template (at construction, so a broken
            model file fails at startup, not on the first chat request).
    """

    __slots__ = ("__dict__", "_read", "_template", "_variables", "source")

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> None:
        try:
            self._template = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"the chat template does not compile: {exc}") from exc
        #: the template's Jinja source
        self.source = source
        self._variables: dict[str, Any] = {
            "bos_token": bos_token or "",
            "eos_token": eos_token or "",
        }
        self._read: dict[tuple[str, Any, Any], bool] = {}

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **variables: Any,
    ) -> str:
        """The prompt text for ``messages`` (dicts with ``role`` and string ``content``).

        Raises:
            InvalidRequest: the template rejected the conversation (``raise_exception``,
                an undefined value, a type error on unexpected input); ``param`` is
                ``"messages"``.
        """
        try:
            return self._template.render(
                self._variables,
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **variables,
            )
        except (jinja2.TemplateError, TypeError, ValueError, LookupError) as exc:
            raise InvalidRequest(
                f"the model's chat template rejected the messages: {exc}", param="messages"
            ) from exc

    @functools.cached_property
    def handles_tools(self) -> bool:
        """True when the template shows the model its ``tools`` (checked once by rendering
        a probe tool: a template that never mentions it ignores tools)."""
        probe = {"type": "function", "function": {"name": _PROBE_TOOL, "parameters": {}}}
        try:
            text = self.render([{"role": "user", "content": "?"}], tools=[probe])
        except InvalidRequest:
            return False
        return _PROBE_TOOL in text

    def reads(self, name: str, first: Any, second: Any) -> bool:
        """Whether the variable ``name`` changes the prompt: True when a conversation
        rendered with ``name=first`` and with ``name=second`` differ (probed once per
        variable; ``enable_thinking`` with True and False, ``reasoning_effort`` with two
        efforts). A setting passed to a template that does not read it is not honoured."""
        key = (name, first, second)
        found = self._read.get(key)
        if found is None:
            probe = [{"role": "user", "content": "?"}]
            try:
                found = self.render(probe, **{name: first}) != self.render(probe, **{name: second})
            except InvalidRequest:
                found = False
            self._read[key] = found
        return found

    def __repr__(self) -> str:
        return f"ChatTemplate({len(self.source)} chars)"
