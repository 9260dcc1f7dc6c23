"""Chat templates rendered with jinja2 exactly as transformers' `apply_chat_template` renders them.

Same environment (sandboxed, `trim_blocks`, `lstrip_blocks`, loop controls), same globals
(`raise_exception`, `strftime_now`, `namespace` refusing underscore names, `dict`), same `tojson`
(no HTML escaping), same variables (`messages` with None-valued keys dropped, `tools`,
`documents`, `add_generation_prompt`, the special tokens such as `bos_token`, then caller kwargs).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The template failed to compile or render (including `raise_exception` calls in it)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """`dict(...)` for templates without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A jinja namespace that refuses underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attributes: {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template does not compile: {exc}") from None


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    special_tokens: Mapping[str, str] | None = None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The prompt text for `messages` (each a mapping with at least `role`)."""
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"chat messages must be mappings, got {message!r}")
        chat.append({key: value for key, value in message.items() if value is not None})
    variables = {**(special_tokens or {}), **kwargs}
    try:
        return compile_template(template).render(
            messages=chat,
            tools=None if tools is None else list(tools),
            documents=None if documents is None else list(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"chat template failed: {exc}") from None
