"""SGLang's tail window for stop strings and regexes: its size, and what one check decodes."""

import re

import pytest

from omni.compute._stop import UNBOUNDED_REGEX_LEN, regex_max_length, stop_window
from omni.compute.sampling import RequestSamplingState, SamplingParams
from tests.compute.sglang_conformance import ABC, RowTokenizer

U = UNBOUNDED_REGEX_LEN


@pytest.mark.parametrize(("pattern", "length"), [
    ("^foo", 3), (r"\Afoo\Z", 3), (r"\bx\B", 1), ("[0-9]{2}", 2), (r"\d\w\s", 3),
    ("a{2,5}", 5), ("(a|bc){3}", 6), ("a|bcd", 3), ("\u00e9\u00e9", 2), ("(?i)abc", 3),
    ("a+", U), ("a*?", U), (".*x", U + 1), ("(?:ab)+", U),
    ("[^a]", U), ("(?<=a)b", U + 1), ("(?!a)b", U + 1), ("(?>ab)", U), ("a*+", U),
    (r"(a)\1", U + 1),
])
def test_regex_max_length_bounds_as_sglang_s_get_max_seq_length(pattern, length):
    """Characters for literals, classes and bounded repeats; 2**30 for an unbounded repeat
    and for each construct SGLang does not bound (NOT_LITERAL, lookarounds, atomic groups,
    possessive repeats, backreferences)."""
    assert regex_max_length(pattern) == length


def test_a_bad_regex_raises_re_error():
    with pytest.raises(re.error):
        regex_max_length("(a")


def test_the_window_is_the_longer_bound_plus_one():
    encode = RowTokenizer().encode
    assert stop_window((), (), encode) == 0
    assert stop_window(("abc",), (), encode) == 2  # one merge
    assert stop_window(("abc",), (), None) == 4  # characters, without a tokenizer
    assert stop_window(("abcd", "x"), ("[0-9]{5}",), encode) == 6
    assert stop_window(("x",), ("a+",), encode) == U + 1


def test_stop_tail_ids_are_the_last_window_of_the_output():
    tokenizer = RowTokenizer()
    request = RequestSamplingState(SamplingParams(stop="abc", stop_regex="q{2}"),
                                   encode=tokenizer.encode)
    assert request.stop_window == 3 and request.stop_tail_ids() == []
    request.output_token_ids.extend([1, 2])
    assert request.stop_tail_ids() == [1, 2]  # shorter than the window: all of it
    request.output_token_ids.extend([3, ABC, 5])
    assert request.stop_tail_ids() == [3, ABC, 5]
    assert RequestSamplingState(SamplingParams()).stop_tail_ids() == []
