"""HFTokenizer against transformers' tokenizer: special tokens and their ids, added tokens,
encoding with and without the post-processor's tokens, decoding with skip_special_tokens."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, processors
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from omni.compute.tokenizer import load_tokenizer
from tests.compute.checkpoint_builders import MESSAGES, save_tokenizer, trained_tokenizer_json


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


def test_add_bos_token_in_the_config_does_not_override_tokenizer_json(tmp_path: Path) -> None:
    """transformers 5 drops tokenizer_config.json's add_bos_token when tokenizer.json exists:
    the post-processor alone decides, with or without it, and chat prompts never get a BOS."""
    directory = save_tokenizer(tmp_path, bos_token="<|endoftext|>")
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "add_bos_token": True}))
    for post_processor in (None, processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)])):
        backend = Tokenizer.from_str(trained_tokenizer_json())
        backend.post_processor = post_processor
        backend.save(str(directory / "tokenizer.json"))
        ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
        assert ours.encode("Hello", add_special_tokens=True) == theirs("Hello").input_ids
        assert (ours.encode("Hello", add_special_tokens=True)[0] == 0) == (
            post_processor is not None)
        assert ours.apply_chat_template(MESSAGES) == theirs.apply_chat_template(
            MESSAGES, return_dict=False)
