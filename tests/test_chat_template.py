"""Chat templates: read from an HF folder in each form `transformers` reads, rendered as
`transformers.apply_chat_template` renders them, and sandboxed."""

import json
import sys
from pathlib import Path

import pytest

from rekv_jax.model.chat_template import ChatTemplate, read_chat_template
from rekv_jax.model.loader import SHIPPED_MODEL, chat_template_of

CHATS = [
    [{"role": "user", "content": "Where is the tower?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Ünïcode ok?"}],
]


@pytest.mark.parametrize("generation_prompt", [True, False])
@pytest.mark.parametrize("messages", CHATS)
def test_the_shipped_template_renders_as_transformers_renders_it(messages, generation_prompt):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(SHIPPED_MODEL))
    want = hf.apply_chat_template(messages, tokenize=False,
                                  add_generation_prompt=generation_prompt)
    template = chat_template_of(str(SHIPPED_MODEL))
    assert template.render(messages, generation_prompt) == want
    assert template.eos_token == "<|endoftext|>" == hf.eos_token
    assert chat_template_of(f"hf:{SHIPPED_MODEL}") == template


def test_the_shipped_config_is_what_the_training_script_writes():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import train_tiny
    finally:
        sys.path.pop(0)
    shipped = (SHIPPED_MODEL / "tokenizer_config.json").read_text()
    assert shipped == json.dumps(train_tiny.TOKENIZER_CONFIG, indent=2) + "\n"


def _folder(tmp_path, config=None, jinja=None):
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (tmp_path / "chat_template.jinja").write_text(jinja)
    return tmp_path


def test_each_form_of_the_template_is_read(tmp_path):
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    config = {"chat_template": named, "bos_token": {"content": "<s>", "lstrip": False},
              "eos_token": "</s>"}
    assert read_chat_template(_folder(tmp_path, config)) == ChatTemplate("D", "<s>", "</s>")
    # the .jinja file beside the config wins over the config's template
    assert read_chat_template(_folder(tmp_path, jinja="J")).source == "J"


def test_folders_and_specs_without_a_template_have_none(tmp_path):
    assert read_chat_template(tmp_path) is None
    assert read_chat_template(_folder(tmp_path, {"eos_token": "</s>"})) is None
    assert chat_template_of("tiny") is None  # a preset: no folder


def test_a_template_that_is_not_text_is_refused(tmp_path):
    with pytest.raises(ValueError, match="default"):
        read_chat_template(_folder(tmp_path, {"chat_template": [{"name": "x", "template": "T"}]}))


def test_the_variables_reach_the_template():
    t = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m.content | tojson }}{% endfor %}"
                     "{% if add_generation_prompt %}{{ eos_token }}{% endif %}{{ extra }}",
                     "<s>", "</s>")
    assert t.render([{"role": "user", "content": "é\n"}], True, {"extra": "!"}) == '<s>"é\\n"</s>!'
    assert t.render([{"role": "user", "content": "x"}], False) == '<s>"x"'
    # the template's own four variables stay the model's
    assert t.render([], True, {"eos_token": "no", "messages": 1}) == "<s></s>"


@pytest.mark.parametrize("source, words", [
    ("{{ raise_exception('only user turns') }}", "only user turns"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),  # the sandbox: no reach into Python
    ("{% set _ = messages.append(1) %}", "unsafe"),  # immutable: the messages stay as sent
    ("{% for %}", "not valid jinja2"),
])
def test_a_template_that_refuses_or_breaks_is_a_value_error(source, words):
    with pytest.raises(ValueError, match=words):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])
