"""A model's chat template: the jinja2 program that turns chat messages into the prompt text the
model was trained on, read from an HF folder and rendered as `transformers` renders it.

The template is the folder's `chat_template.jinja` if it has one, else `tokenizer_config.json`'s
`chat_template` (a string, or a list of `{name, template}` of which "default" is used). It runs
in jinja2's immutable sandbox (a folder's template is code from whoever wrote the folder) with
`trim_blocks` and `lstrip_blocks`, `raise_exception`, a `tojson` that keeps non-ASCII text, and
`messages`, `add_generation_prompt`, `bos_token` and `eos_token` as its variables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

TEMPLATE_FILE = "chat_template.jinja"
CONFIG_FILE = "tokenizer_config.json"


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A chat template and the special tokens it may write."""

    source: str  # the jinja2 program
    bos_token: str | None = None
    eos_token: str | None = None

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
               variables: dict[str, Any] | None = None) -> str:
        """The prompt text of `messages` (each a dict with `role` and `content`), ending where
        the assistant's reply starts (`add_generation_prompt`); `variables` reach the template
        too (a template's own switches; they never replace the four above). ValueError if the
        template refuses them."""
        try:
            return _compiled(self.source).render({
                **(variables or {}), "messages": messages,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": self.bos_token or "", "eos_token": self.eos_token or ""})
        except jinja2.TemplateError as e:
            raise ValueError(f"the chat template refused the messages: {e}") from None


def read_chat_template(folder: Path) -> ChatTemplate | None:
    """The chat template of an HF folder (see the module docstring), None if it has none; reads
    files only. ValueError if `tokenizer_config.json` is not JSON or its template not text."""
    config_file = folder / CONFIG_FILE
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    if not isinstance(config, dict):
        raise ValueError(f"{config_file} is not a JSON object")
    template_file = folder / TEMPLATE_FILE
    source = (template_file.read_text() if template_file.is_file()
              else _default_template(config.get("chat_template"), config_file))
    if source is None:
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")),
                        _token_text(config.get("eos_token")))


def _default_template(value: Any, where: Path) -> str | None:
    """`chat_template` as `tokenizer_config.json` holds it: a string or named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
    raise ValueError(f"{where}: chat_template is neither text nor a list naming a 'default'")


def _token_text(token: Any) -> str | None:
    """A special token as the config writes it: its text, or an added token's `content`."""
    return token.get("content") if isinstance(token, dict) else token


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"the chat template is not valid jinja2: {e}") from None
