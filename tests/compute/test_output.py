"""A generation's output on SGLang's terms: stop trimming, decode options, n-sample seeds, stream
hand-over (each rule from SGLang 0.5's detokenizer, Req and output streamer)."""

import pytest

from omni.compute._output import output_text, sample_params, stream_due
from omni.compute.sampling import SamplingParams


class Recorder:
    """A tokenizer whose text is the ids joined by '.', recording the decode options."""

    def __init__(self):
        self.options = []

    def decode(self, ids, *, skip_special_tokens=True, spaces_between_special_tokens=True):
        self.options.append((skip_special_tokens, spaces_between_special_tokens))
        return ".".join(map(str, ids))


@pytest.mark.parametrize(("matched", "no_stop_trim", "text"), [
    (None, False, "1.2.3.4"),  # a length finish: nothing trimmed
    (4, False, "1.2.3"),  # a stop token: left out of the text
    (4, True, "1.2.3.4"),
    ("2.3", False, "1."),  # a stop string: the text ends before it
    ("2.3", True, "1.2.3"),  # ... or after it
    (r"2\.3", False, "1.2.3.4"),  # a stop_regex: trimmed only by its literal text
])
def test_output_text_trims_the_matched_stop_as_sglang(matched, no_stop_trim, text):
    params = SamplingParams(no_stop_trim=no_stop_trim)
    assert output_text(Recorder(), [1, 2, 3, 4], params, matched) == text


def test_a_stop_string_matched_in_the_tail_window_cuts_at_its_first_occurrence():
    """The tail window may find a stop string whose earlier occurrence it missed (a stop
    string spanning more tokens than the window, or one across a byte-level character):
    SGLang's detokenizer cuts at the first occurrence in the whole text (`str.find`)."""
    ids = [7, 1, 2, 8, 1, 2, 9]  # "7.1.2.8.1.2.9": the window saw the second "1.2"
    assert output_text(Recorder(), ids, SamplingParams(), "1.2") == "7."
    assert output_text(Recorder(), ids, SamplingParams(no_stop_trim=True), "1.2") == "7.1.2"


def test_output_text_passes_the_decode_options():
    tokenizer = Recorder()
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=False)
    output_text(tokenizer, [1], params, None)
    output_text(tokenizer, [1], SamplingParams(), None)
    assert tokenizer.options == [(False, False), (True, True)]


def test_sample_i_is_seeded_sampling_seed_plus_i():
    params = SamplingParams(n=3, sampling_seed=2**63 - 2, temperature=0.5)
    seeds = [sample_params(params, i).sampling_seed for i in range(3)]
    assert seeds == [2**63 - 2, 2**63 - 1, -(2**63)]  # wrapped into SGLang's range
    assert all(sample_params(params, i).n == 1 for i in range(3))
    assert sample_params(SamplingParams(n=2), 1).sampling_seed is None
    alone = SamplingParams(temperature=0.5)
    assert sample_params(alone, 0) is alone


@pytest.mark.parametrize(("sent", "made", "interval", "finished", "due"), [
    (0, 1, 4, False, True),  # the first token goes at once
    (1, 3, 4, False, False),
    (1, 5, 4, False, True),  # then every 4
    (5, 6, 4, True, True),  # and the rest at the end
    (6, 6, 4, True, False),
    (3, 4, 1, False, True),
])
def test_stream_due_follows_sglang_s_stream_interval(sent, made, interval, finished, due):
    assert stream_due(sent, made, interval, finished) is due
