"""The SGLang adapter: a clear error without the extra; faithful parameter and result mapping."""

import math
import sys

import pytest

from omni.compute.sampling import SamplingParams
from omni.compute.sglang_backend import SGLangEngine, from_sglang_output, to_sglang_params


def test_without_sglang_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as if not installed, even where it is
    with pytest.raises(ImportError, match=r"'sglang' extra: pip install 'omni\[sglang\]'"):
        SGLangEngine("some/model")


def test_sampling_params_map_to_sglangs_names():
    params = SamplingParams(max_new_tokens=7, temperature=0.5, top_p=0.9, top_k=40, min_p=0.1,
                            repetition_penalty=1.1, frequency_penalty=0.2,
                            presence_penalty=-0.3, stop=["\n\n"], stop_token_ids=[5, 2],
                            ignore_eos=True, sampling_seed=11)
    assert to_sglang_params(params) == {
        "max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 40, "min_p": 0.1,
        "repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": -0.3,
        "ignore_eos": True, "stop": ["\n\n"], "stop_token_ids": [2, 5], "sampling_seed": 11,
        "min_new_tokens": 0, "n": 1, "json_schema": None, "regex": None,
        "ebnf": None, "structural_tag": None, "skip_special_tokens": True,
        "spaces_between_special_tokens": True, "no_stop_trim": False, "stream_interval": None,
        "logit_bias": None, "custom_params": None,
    }
    assert "stop" not in to_sglang_params(SamplingParams())


def test_sglang_outputs_become_generate_results():
    result = from_sglang_output({
        "text": "hi", "output_ids": [1, 2],
        "meta_info": {"prompt_tokens": 40, "cached_tokens": 32, "completion_tokens": 2,
                      "finish_reason": {"type": "length", "length": 2}},
    })
    assert (result.token_ids, result.text, result.prompt_tokens, result.cached_tokens,
            result.finish_reason, result.new_tokens) == ([1, 2], "hi", 40, 32, "length", 8)
    assert math.isnan(result.time_to_first_token)
