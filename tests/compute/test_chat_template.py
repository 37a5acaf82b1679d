"""Chat templates rendered as transformers' `apply_chat_template` renders them: text and ids
for ChatML, a Llama-3 style template, a strict one (sandbox, trim/lstrip blocks, globals), a
Qwen3-style reasoning one; named templates; errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers import AutoTokenizer

from omni.compute.chat import ChatTemplate
from omni.compute.tokenizer import load_tokenizer
from tests.compute.checkpoint_builders import CHATML, MESSAGES, save_tokenizer

LLAMA3 = ("{{ bos_token }}{% for message in messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' %}"
          "{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# Block tags on their own indented lines (trim_blocks / lstrip_blocks), raise_exception,
# tojson (no HTML escaping, unicode kept, indent), namespace, loop controls, content parts,
# the {% generation %} tag and the special tokens as variables.
STRICT = """{% set ns = namespace(turns=0) %}
{% if tools %}
    <tools>{{ tools | tojson(indent=2) }}</tools>
{% endif %}
{% for message in messages %}
    {% if message.role not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('Unknown role: ' + message.role) }}
    {% endif %}
    {% if message.role == 'system' and not loop.first %}
        {{ raise_exception('The system message must come first') }}
    {% endif %}
    {% if message.content is string %}
        {% set text = message.content %}
    {% else %}
        {% set text = message.content | selectattr('type', 'equalto', 'text')
                      | map(attribute='text') | join(' ') %}
    {% endif %}
    {% if message.role == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ text }}{% endgeneration %}{{ eos_token }}
    {% else %}
        {% set ns.turns = ns.turns + 1 %}
<|im_start|>{{ message.role }} {{ {'n': ns.turns, 'text': text} | tojson }}<|im_end|>
    {% endif %}
    {% if loop.index > 5 %}{% break %}{% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""
# Qwen3's kind of template: reversed messages, string methods, tool calls, a kwarg switch.
REASONING = """{%- set ns = namespace(last_user=messages|length - 1, found=false) %}
{%- for message in messages[::-1] %}
    {%- if not ns.found and message.role == 'user' and not message.content.startswith('<r>') %}
        {%- set ns.found = true %}
        {%- set ns.last_user = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string
                            else content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
        {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > ns.last_user %}{{- '<think>' + reasoning + '</think>' }}{%- endif %}
        {{- content }}
        {%- for call in message.tool_calls or [] %}
            {{- '\n<tool_call>' + {'name': call.function.name,
                                    'arguments': call.function.arguments} | tojson }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""


@pytest.mark.parametrize("template", [CHATML, LLAMA3, STRICT], ids=["chatml", "llama3", "strict"])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_rendered_text_and_ids_equal_transformers(tmp_path: Path, template: str,
                                                  add_generation_prompt: bool) -> None:
    """The prompt text and ids equal apply_chat_template's for several templates."""
    directory = save_tokenizer(tmp_path, template, bos_token="<|endoftext|>")
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "Über <b>&</b> “quotes”"},
                {"role": "user", "content": [{"type": "text", "text": "parts"},
                                             {"type": "image"}, {"type": "text", "text": "two"}]}]
    if template != STRICT:
        messages = messages[:3]
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt}
    if template == STRICT:
        kwargs["tools"] = [{"type": "function", "function": {"name": "ß", "parameters": {}}}]
    text = ours.apply_chat_template(messages, tokenize=False, **kwargs)
    assert text == theirs.apply_chat_template(messages, tokenize=False, **kwargs)
    assert ours.apply_chat_template(messages, **kwargs) == theirs.apply_chat_template(
        messages, return_dict=False, **kwargs)
    if template == LLAMA3:
        assert text.startswith("<|endoftext|><|start_header_id|>system")


@pytest.mark.parametrize("enable_thinking", [None, False])
def test_reasoning_template_with_tool_calls_equals_transformers(tmp_path: Path,
                                                                enable_thinking: bool | None,
                                                                ) -> None:
    """A Qwen3-style template (string methods, reversed messages, tool calls, reasoning under
    `reasoning` aliased to `reasoning_content`, an `enable_thinking` switch) renders as
    transformers renders it; None-valued keys are dropped before rendering."""
    directory = save_tokenizer(tmp_path, REASONING)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": "é"}}}
    messages = [{"role": "user", "content": "2+2?"},
                {"role": "assistant", "content": "<think>\nadd</think>\n\nLet me add.",
                 "tool_calls": [call]},
                {"role": "tool", "content": "4", "tool_calls": None},
                {"role": "assistant", "content": "Four.", "reasoning": "easy"},
                {"role": "user", "content": "<r>thanks"}]
    kwargs = {} if enable_thinking is None else {"enable_thinking": enable_thinking}
    expected = AutoTokenizer.from_pretrained(directory).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs)
    text = load_tokenizer(directory).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False, **kwargs)
    assert text == expected and "<think>easy</think>Four." in text


def test_template_exceptions_and_bad_messages_are_value_errors(tmp_path: Path) -> None:
    """raise_exception's message comes through; messages that are not a list of dicts with a
    string role, or content of another type, are named."""
    tokenizer = load_tokenizer(save_tokenizer(tmp_path, STRICT))
    with pytest.raises(jinja2.TemplateError, match="Unknown role: tool"):
        AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(
            [{"role": "tool", "content": "x"}], tokenize=False)
    with pytest.raises(ValueError, match="the chat template failed: Unknown role: tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="The system message must come first"):
        tokenizer.apply_chat_template([MESSAGES[1], MESSAGES[0]])
    chatml = load_tokenizer(save_tokenizer(tmp_path / "chatml"))
    with pytest.raises(ValueError, match="the chat template failed: TypeError"):
        chatml.apply_chat_template([{"role": "user", "content": [{"type": "text"}]}])
    bad = [("hello", "messages must be a list of dicts, got str"),
           ([], "messages is empty"),
           (["hi"], r"messages\[0\] must be a dict"),
           ([{"content": "hi"}], r"messages\[0\] needs a string 'role', got None"),
           ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\] must be a string")]
    for messages, message in bad:
        with pytest.raises(ValueError, match=message):
            tokenizer.apply_chat_template(messages)


def test_missing_and_invalid_templates(tmp_path: Path) -> None:
    """A checkpoint without a template cannot chat; a template that is not Jinja fails on load;
    named templates without a default are refused."""
    (tmp_path / "plain").mkdir()
    save_tokenizer(tmp_path / "plain", template=None)
    plain = load_tokenizer(tmp_path / "plain")
    assert plain.chat_template is None
    with pytest.raises(ValueError, match="this tokenizer has no chat template"):
        plain.apply_chat_template(MESSAGES)
    (tmp_path / "plain" / "chat_template.jinja").write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template 'default' is not valid Jinja"):
        load_tokenizer(tmp_path / "plain")
    with pytest.raises(ValueError, match="several chat templates and none named 'default'"):
        ChatTemplate({"a": "x", "b": "y"}).render(MESSAGES)


def test_named_templates_pick_default_or_tool_use(tmp_path: Path) -> None:
    """Several templates (saved as transformers saves them, and as a list in
    tokenizer_config.json): "default", or "tool_use" when tools are given, as transformers."""
    templates = {"default": CHATML, "tool_use": "TOOLS {{ tools | tojson }} " + CHATML}
    directory = save_tokenizer(tmp_path, templates)
    assert (directory / "additional_chat_templates" / "tool_use.jinja").is_file()
    tools = [{"name": "f"}]
    theirs = AutoTokenizer.from_pretrained(directory)
    for kwargs in ({}, {"tools": tools}):
        expected = theirs.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
        assert load_tokenizer(directory).apply_chat_template(MESSAGES, tokenize=False,
                                                             **kwargs) == expected
    (directory / "chat_template.jinja").unlink()
    for file in (directory / "additional_chat_templates").iterdir():
        file.unlink()
    (directory / "additional_chat_templates").rmdir()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": k, "template": v} for k, v in templates.items()]
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    theirs = AutoTokenizer.from_pretrained(directory)
    ours = load_tokenizer(directory)
    assert ours.apply_chat_template(MESSAGES, tools=tools, tokenize=False) == \
        theirs.apply_chat_template(MESSAGES, tools=tools, tokenize=False)


def test_a_processors_chat_template_json_comes_before_the_tokenizers(tmp_path: Path) -> None:
    """A multimodal checkpoint (Qwen3-Omni's) keeps its template, the one that renders image
    and audio parts, in the processor's legacy chat_template.json: it is the one used, over
    tokenizer_config.json's; a chat_template.jinja would come first. A broken one is named."""
    directory = save_tokenizer(tmp_path, "TEXT ONLY " + CHATML)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = "TEXT ONLY " + CHATML
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "chat_template.jinja").unlink(missing_ok=True)
    legacy = json.dumps({"chat_template": "MEDIA " + CHATML})
    (directory / "chat_template.json").write_text(legacy)
    rendered = load_tokenizer(directory).apply_chat_template(MESSAGES, tokenize=False)
    assert rendered.startswith("MEDIA ")
    (directory / "chat_template.jinja").write_text("JINJA " + CHATML)
    assert load_tokenizer(directory).apply_chat_template(MESSAGES, tokenize=False).startswith(
        "JINJA ")
    (directory / "chat_template.jinja").unlink()
    (directory / "chat_template.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"chat_template\.json"):
        load_tokenizer(directory)
