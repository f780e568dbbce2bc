"""Chat templates: a list of chat messages rendered to the prompt text a checkpoint was trained on.

The template is a Jinja2 text in the Hugging Face convention, taken from (first found): the one given explicitly
(``deepinfer serve --chat-template``, a file or the template itself), the checkpoint's ``chat_template.jinja``, or
the ``chat_template`` field of its ``tokenizer_config.json`` (a string, or a list of named templates, of which the
one named ``default``). It is rendered in Jinja2's immutable sandbox with ``trim_blocks`` and ``lstrip_blocks``, the
``loopcontrols`` extension, a ``tojson`` filter that keeps non-ASCII text, and the globals templates use:
``raise_exception(message)`` and ``strftime_now(format)``. The variables are ``messages`` (``role`` and ``content``
strings), ``add_generation_prompt``, ``bos_token`` / ``eos_token`` (from ``tokenizer_config.json``; the model's
own BOS/EOS tokens when it has none) and any extra keyword (``chat_template_kwargs``).

A checkpoint without a template (the embedded model, trained on code rather than dialogue, has none) cannot serve chat
requests unless one is given: as with vLLM, such a request is refused with an error naming ``--chat-template``,
rather than rendered with a template the model never saw.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from .errors import CheckpointError, RequestError


class ChatTemplateError(RequestError):
    """A chat request cannot be rendered: no template, a template that fails (``raise_exception`` included), or
    messages of the wrong shape."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _token_text(value: Any) -> str | None:
    """A special token of ``tokenizer_config.json``: a string, or a dict with its ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class ChatTemplate:
    """A compiled chat template with the special-token strings it is rendered with."""

    def __init__(self, source: str, bos_token: str | None = None, eos_token: str | None = None, origin: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"chat template {origin}: not valid Jinja2: {e}") from e
        self.source, self.origin = source, origin
        self.bos_token, self.eos_token = bos_token or "", eos_token or ""

    @classmethod
    def load(
        cls,
        checkpoint: str | Path,
        override: str | None = None,
        default_bos: str | None = None,
        default_eos: str | None = None,
    ) -> ChatTemplate | None:
        """The template of ``checkpoint`` (see the module docstring), or None when it has none. ``override``: a
        file path or the template text itself. ``default_bos`` / ``default_eos``: the special-token strings when
        ``tokenizer_config.json`` does not name them."""
        path = Path(checkpoint)
        config: dict = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(config_file.read_text())
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{config_file}: not valid JSON: {e}") from e
            if not isinstance(config, dict):
                raise CheckpointError(f"{config_file}: expected a JSON object")
        bos = _token_text(config.get("bos_token")) or default_bos
        eos = _token_text(config.get("eos_token")) or default_eos
        source, origin = None, ""
        if override is not None:
            file = Path(override)
            if "{" not in override and file.is_file():
                source, origin = file.read_text(), str(file)
            elif "{" in override:
                source, origin = override, "given inline"
            else:
                raise CheckpointError(f"chat template {override!r}: no such file (nor a Jinja2 template)")
        elif (path / "chat_template.jinja").is_file():
            source, origin = (path / "chat_template.jinja").read_text(), str(path / "chat_template.jinja")
        else:
            raw = config.get("chat_template")
            if isinstance(raw, list):
                raw = next((t.get("template") for t in raw if isinstance(t, dict) and t.get("name") == "default"), None)
            if isinstance(raw, str):
                source, origin = raw, f"{config_file} (chat_template)"
        if source is None:
            return None
        return cls(source, bos, eos, origin)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, /, **kwargs: Any) -> str:
        """The prompt text of ``messages`` (each a dict with a ``role`` string and a ``content`` string, a list of
        text parts, or None); ``ChatTemplateError`` for messages of another shape or a template that fails on
        them (whatever the exception: a message's extra fields and ``kwargs`` are the client's values).

        ``kwargs`` are more template variables (a request's ``chat_template_kwargs``); as in vLLM and Hugging Face's
        ``apply_chat_template`` they override the defaults, ``add_generation_prompt`` and the ``bos_token`` and
        ``eos_token`` included. Only ``messages`` cannot be given twice: that is a ``ChatTemplateError``."""
        if "messages" in kwargs:
            raise ChatTemplateError("chat_template_kwargs cannot set 'messages': send them as the request's messages")
        msgs = [normalize_message(m, i) for i, m in enumerate(messages)]
        if not msgs:
            raise ChatTemplateError("messages must hold at least one message")
        variables = {
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **kwargs,
        }
        try:
            return self._template.render(messages=msgs, **variables)
        except ChatTemplateError:
            raise
        except Exception as e:  # a TemplateError, or a TypeError etc. on values of the request's own making
            raise ChatTemplateError(
                f"the chat template ({self.origin}) failed on these messages: {type(e).__name__}: {e}"
            ) from e


def normalize_message(message: Any, index: int) -> dict:
    """One OpenAI chat message as templates take it: ``content`` a string (text parts joined by newlines; None is
    the empty string), other fields kept."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"messages[{index}]: expected an object with a string 'role', got {message!r}")
    content = message.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ChatTemplateError(
                    f"messages[{index}].content[{j}]: only text parts ({{'type': 'text', 'text': ...}}) are "
                    f"supported, got {part!r}"
                )
            texts.append(part["text"])
        content = "\n".join(texts)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        raise ChatTemplateError(f"messages[{index}].content: expected a string or a list of text parts")
    return {**message, "content": content}
