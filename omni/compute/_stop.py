"""Where stop strings and stop regexes are looked for: SGLang 0.5.23's tail window.

SGLang does not search the whole output each step. It decodes the last
``max(stop_str_max_len, stop_regex_max_len) + 1`` output tokens (`Req.tail_str`,
`Req._stop_match_tail_len`) and searches that text only, so a step costs O(window), not
O(output). Two bounds size the window (`SamplingParams.normalize`): a stop string's length in
tokens by the tokenizer's encode, and a regex's longest match in characters by
`get_max_seq_length`, which counts an unbounded repeat (``a+``, ``.*``) or a construct it does
not know (``[^a]``, a lookaround, a backreference) as 2**30: one such regex makes the window
the whole output. Anchors (``^``, ``\\A``, ``\\b``) then see the window's start, not the
output's, and a match that needs text before the window is not found.
"""

from __future__ import annotations

# re._parser is `sre_parse` (which SGLang imports): the public name warns of its deprecation.
import re._constants as sre_constants
import re._parser as sre_parse
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache

__all__ = ["UNBOUNDED_REGEX_LEN", "regex_max_length", "stop_tail_len", "stop_window"]

UNBOUNDED_REGEX_LEN = 2**30  # SGLang's MAX_LEN: the length of a regex with no bound
_ONE_CHARACTER = frozenset({sre_constants.LITERAL, sre_constants.IN, sre_constants.ANY})
_REPEATS = frozenset({sre_constants.MAX_REPEAT, sre_constants.MIN_REPEAT})


@lru_cache(maxsize=1024)  # requests repeat their patterns; each is parsed once
def regex_max_length(pattern: str) -> int:
    """The longest text `pattern` can match, in characters, as SGLang's `get_max_seq_length`
    bounds it: `UNBOUNDED_REGEX_LEN` (or more) for an unbounded repeat or an unknown construct.

    Raises:
        re.error: `pattern` does not parse.
    """
    return _max_length(sre_parse.parse(pattern))


def _max_length(subpattern: Iterable[tuple[object, object]]) -> int:
    """SGLang's `_max_length_from_subpattern`, token for token."""
    total = 0
    for token, value in subpattern:
        if token in _ONE_CHARACTER:
            total += 1
        elif token == sre_constants.SUBPATTERN:
            total += _max_length(value[3])  # type: ignore[index]
        elif token == sre_constants.BRANCH:
            total += max(_max_length(branch) for branch in value[1])  # type: ignore[index]
        elif token in _REPEATS:
            _, most, inner = value  # type: ignore[misc]
            total += (UNBOUNDED_REGEX_LEN if most == sre_constants.MAXREPEAT
                      else most * _max_length(inner))
        elif token != sre_constants.AT:  # zero-width ^ $ \A \Z \b \B add nothing
            total += UNBOUNDED_REGEX_LEN
    return total


def stop_window(stop: Sequence[str], stop_regex: Sequence[str],
                encode: Callable[[str], Sequence[int]] | None) -> int:
    """The most output tokens SGLang decodes to look for `stop` and `stop_regex`:
    ``max(stop_str_max_len, stop_regex_max_len) + 1`` (0: nothing to look for).

    `stop_str_max_len` is the longest stop string in tokens by `encode` (in characters
    without a tokenizer, as SGLang's `normalize(None)`); `stop_regex_max_len` the longest
    `regex_max_length`.
    """
    if not stop and not stop_regex:
        return 0
    str_len = max((len(encode(s)) if encode is not None else len(s) for s in stop), default=0)
    regex_len = max((regex_max_length(p) for p in stop_regex), default=0)
    return max(str_len, regex_len) + 1


def stop_tail_len(window: int, num_output: int) -> int:
    """How many of the last output tokens one check decodes (`Req._stop_match_tail_len` for
    one new token): the window, or the whole output while it is shorter."""
    return min(window, num_output)
