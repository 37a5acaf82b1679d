"""Chatting with a checkpoint, against transformers (the oracle): chat templates rendered and
tokenized as `apply_chat_template`, greedy answers equal to `generate`, generation_config.json
defaults and EOS ids. Each test builds its checkpoint: random weights saved by transformers, a
byte-level BPE tokenizer trained here with ChatML special tokens, a template."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from omni.compute import SamplingParams, TorchEngine
from omni.compute.chat import ChatTemplate
from omni.compute.generation_config import GenerationDefaults
from omni.compute.tokenizer import load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|im_start|>assistant\n' }}{% endif %}")
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
MESSAGES = [{"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello world, how are you today?"},
            {"role": "assistant", "content": "The quick brown fox."},
            {"role": "user", "content": "And the lazy dog?"}]
HF_MODELS = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
             "qwen3": (Qwen3Config, Qwen3ForCausalLM)}


@lru_cache(maxsize=1)
def trained_tokenizer_json() -> str:
    """A byte-level BPE tokenizer trained on a few sentences, ChatML tokens as special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [m["content"] for m in MESSAGES] + ["system user assistant tools text <b>&</b>"]
    tok.train_from_iterator(corpus * 20, trainer)
    return tok.to_str()


def save_tokenizer(directory: Path, template: Any = CHATML, **special: Any) -> Path:
    """The trained tokenizer saved by transformers' PreTrainedTokenizerFast.save_pretrained."""
    tok = Tokenizer.from_str(trained_tokenizer_json())
    special = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", **special}
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=template, **special)
    hf.save_pretrained(directory)
    return directory


def save_checkpoint(directory: Path, arch: str, generation: dict[str, Any] | None = None,
                    seed: int = 0) -> Path:
    """Random tiny `arch` weights (every parameter perturbed), the tokenizer, and
    generation_config.json (`generation`, or greedy with <|im_end|> as EOS)."""
    config_cls, model_cls = HF_MODELS[arch]
    extra = {"head_dim": 16} if arch == "qwen3" else {}  # not hidden / heads (8)
    config = config_cls(vocab_size=384, hidden_size=32, intermediate_size=64,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, tie_word_embeddings=arch == "qwen2",
                        eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = model_cls(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (0.1 if "norm" in name else 0.15))
    model.save_pretrained(directory)
    save_tokenizer(directory)
    GenerationConfig(**(generation or {"do_sample": False, "eos_token_id": 2})).save_pretrained(
        directory)
    return directory


def hf_chat(directory: Path, messages: list[dict[str, Any]], **generate: Any) -> list[int]:
    """transformers: apply_chat_template(add_generation_prompt=True), then generate: new ids."""
    tokenizer = AutoTokenizer.from_pretrained(directory)
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                                                            dtype=torch.long),
                             **generate)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
async def test_chat_equals_apply_chat_template_and_greedy_generate(tmp_path: Path,
                                                                   arch: str) -> None:
    """engine.chat(messages, greedy) gives transformers' prompt ids and greedy tokens."""
    directory = save_checkpoint(tmp_path, arch)
    engine = TorchEngine.from_pretrained(directory)
    hf_tok = AutoTokenizer.from_pretrained(directory)
    expected_prompt = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                                 return_dict=False)
    assert engine.chat_prompt(MESSAGES) == expected_prompt
    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    result = await engine.chat(MESSAGES, greedy)
    expected = hf_chat(directory, MESSAGES, do_sample=False, max_new_tokens=24, eos_token_id=None)
    assert result.prompt_tokens == len(expected_prompt)
    assert result.token_ids == expected and len(expected) == 24
    assert result.text == hf_tok.decode(expected, skip_special_tokens=True)


async def test_chat_stream_yields_the_tokens_of_chat(tmp_path: Path) -> None:
    """chat_stream's token ids are chat's, and its result is there at the end."""
    engine = TorchEngine.from_pretrained(save_checkpoint(tmp_path, "qwen3"))
    params = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    stream = engine.chat_stream(MESSAGES[:2], params)
    streamed = [token async for token in stream]
    assert streamed == (await engine.chat(MESSAGES[:2], params)).token_ids
    assert stream.result is not None and stream.result.token_ids == streamed


async def test_generation_config_defaults_and_eos_list_are_used(tmp_path: Path) -> None:
    """Without params, chat answers as transformers' generate() without arguments does with the
    checkpoint's generation_config.json (greedy, its max_new_tokens, its list of EOS ids)."""
    directory = save_checkpoint(tmp_path, "llama")
    engine = TorchEngine.from_pretrained(directory)
    free = (await engine.chat(MESSAGES, SamplingParams(temperature=0, max_new_tokens=20,
                                                       ignore_eos=True))).token_ids
    stop_at = next(i for i in range(3, 20) if free[i] not in free[:i])  # first stops there
    generation = {"do_sample": False, "max_new_tokens": 20, "eos_token_id": [2, free[stop_at]]}
    GenerationConfig(**generation).save_pretrained(directory)
    engine = TorchEngine.from_pretrained(directory)
    assert engine.tokenizer.eos_token_ids == (2, free[stop_at])
    assert engine.default_params().temperature == 0 and engine.default_params().max_new_tokens == 20
    result = await engine.chat(MESSAGES)
    assert result.token_ids == free[: stop_at + 1] and result.finish_reason == "stop"
    assert result.token_ids == hf_chat(directory, MESSAGES)


async def test_generation_config_max_length_counts_the_prompt(tmp_path: Path) -> None:
    """max_length in generation_config.json caps prompt + answer, as in transformers."""
    directory = save_checkpoint(tmp_path, "qwen3")
    num_prompt = len(TorchEngine.from_pretrained(directory).chat_prompt(MESSAGES))
    GenerationConfig(do_sample=False, max_length=num_prompt + 6, eos_token_id=2).save_pretrained(
        directory)
    result = await TorchEngine.from_pretrained(directory).chat(MESSAGES)
    assert len(result.token_ids) == 6 and result.finish_reason == "length"
    assert result.token_ids == hf_chat(directory, MESSAGES)


def test_generation_defaults_read_like_sglang_model_defaults() -> None:
    """do_sample: the file's knobs (top_k 0 = off); absent knobs keep SamplingParams' defaults;
    max_length counts the prompt; greedy otherwise; wrong values name the file."""
    sampled = GenerationDefaults.from_dict({"do_sample": True, "temperature": 0.7, "top_p": 0.8,
                                            "top_k": 0, "repetition_penalty": 1.1,
                                            "max_length": 50, "eos_token_id": 7})
    params = sampled.sampling_params(num_prompt_tokens=12)
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty,
            params.max_new_tokens, params.min_p) == (0.7, 0.8, -1, 1.1, 38, 0.0)
    assert sampled.sampling_params(num_prompt_tokens=80).max_new_tokens == 1
    assert sampled.eos_token_ids == (7,)
    greedy = GenerationDefaults.from_dict({"temperature": 0.6, "top_p": 0.9})  # do_sample absent
    assert greedy.sampling_params().is_greedy and greedy.sampling_params().max_new_tokens == 128
    with pytest.raises(ValueError, match=r"generation_config\.json: top_p must be in \(0, 1\]"):
        GenerationDefaults.from_dict({"do_sample": True, "top_p": 1.5}).sampling_params()
    with pytest.raises(ValueError, match=r"generation_config\.json: top_k must be an int"):
        GenerationDefaults.from_dict({"top_k": "50"})


async def test_without_generation_config_the_defaults_are_sglangs(tmp_path: Path) -> None:
    """No generation_config.json: SamplingParams() for requests without params, EOS from
    config.json."""
    directory = save_checkpoint(tmp_path, "qwen2")
    (directory / "generation_config.json").unlink()
    engine = TorchEngine.from_pretrained(directory)
    assert engine.generation_defaults is None and engine.default_params() == SamplingParams()
    assert engine.tokenizer.eos_token_ids == (2,)


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


async def test_engine_without_template_refuses_chat() -> None:
    """TorchEngine.tiny (byte tokenizer) has no template: chat is a ValueError saying so."""
    with pytest.raises(ValueError, match="has no chat template"):
        await TorchEngine.tiny().chat(MESSAGES)


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


def test_special_tokens_ids_and_decoding(tmp_path: Path) -> None:
    """Named special tokens (strings or AddedToken dicts) and their ids; model-specific
    `*_token` entries reach templates; legacy special_tokens_map.json; decode skips special
    tokens as transformers' decode(skip_special_tokens=True) does; a post-processor's BOS is
    added only on request, as tokenizer(text) adds it."""
    directory = save_tokenizer(tmp_path, "{{ bos_token }}|{{ image_token }}|{{ eos_token }}",
                               bos_token="<|endoftext|>", extra_special_tokens={
                                   "image_token": "<|im_start|>"})
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["eos_token"] = {"__type": "AddedToken", "content": "<|im_end|>", "special": True}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id, ours.unk_token_id) == (
        theirs.bos_token_id, theirs.eos_token_id, theirs.pad_token_id, None) == (0, 2, 0, None)
    assert ours.eos_token_ids == (2,)
    assert ours.apply_chat_template(MESSAGES, tokenize=False) == theirs.apply_chat_template(
        MESSAGES, tokenize=False) == "<|endoftext|>|<|im_start|>|<|im_end|>"
    ids = ours.encode("<|im_start|>user\nHello<|im_end|>")
    assert ids == theirs.encode("<|im_start|>user\nHello<|im_end|>", add_special_tokens=False)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
            ids, skip_special_tokens=skip)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])
    backend.save(str(directory / "tokenizer.json"))
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert ours.encode("Hello", add_special_tokens=True) == theirs("Hello").input_ids
    assert ours.encode("Hello")[0] != 0
    config = {k: v for k, v in config.items() if not k.endswith("_token")}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    (directory / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert load_tokenizer(directory).special_tokens == {"eos_token": "<|im_end|>"}


def test_added_tokens_decoder_and_missing_named_tokens_join_the_vocabulary(tmp_path: Path) -> None:
    """As transformers loads them: tokenizer_config.json's added_tokens_decoder marks a plain
    added token special and appends a new one; a named special token missing from
    tokenizer.json (bos "<s>") is appended too. Ids, encoding and decoding then agree."""
    from tokenizers import AddedToken

    tok = Tokenizer.from_str(trained_tokenizer_json())
    tok.add_tokens([AddedToken("<tool>", special=False, normalized=False)])
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>").save_pretrained(tmp_path)
    tool_id = tok.token_to_id("<tool>")
    flags = {"lstrip": False, "rstrip": False, "normalized": False, "single_word": False,
             "special": True}
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"] = {str(tool_id): {"content": "<tool>", **flags},
                                      "9999": {"content": "<new>", **flags}}
    config["bos_token"] = "<s>"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, theirs = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(tmp_path)
    text = "hi<tool>x<new><s>"
    ids = ours.encode(text)
    assert ids == theirs.encode(text, add_special_tokens=False)
    assert ids[-4] == tool_id and ids[-2:] == [tool_id + 1, tool_id + 2]
    assert ours.bos_token_id == theirs.bos_token_id == tool_id + 2
    assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True) == "hix"
