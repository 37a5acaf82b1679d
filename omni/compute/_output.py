"""A generation's output on SGLang's terms: the text's stop trimming and decode options, the
seeds of n samples, and when a stream hands its tokens over.

Kept apart from the engine so that each rule is a small pure function tested on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

__all__ = ["output_text", "sample_params", "stream_due"]


def output_text(tokenizer: Any, token_ids: Sequence[int], params: Any,
                matched: int | str | None) -> str:
    """The text of a finished generation, trimmed as SGLang's detokenizer trims it.

    A matched stop token (EOS, a stop_token_ids entry, a completed grammar's last token) is
    left out unless `no_stop_trim`; the ids are then decoded with `skip_special_tokens` and
    `spaces_between_special_tokens`; a matched stop string cuts the text before it (after it
    with `no_stop_trim`). A matched `stop_regex` cuts the same way at the pattern's literal
    text, as SGLang does, so a pattern with metacharacters leaves its match in the text.
    """
    ids = list(token_ids)
    if isinstance(matched, int) and not params.no_stop_trim and ids:
        ids = ids[:-1]
    text = tokenizer.decode(ids, skip_special_tokens=params.skip_special_tokens,
                            spaces_between_special_tokens=params.spaces_between_special_tokens)
    if isinstance(matched, str):
        at = text.find(matched)
        if at >= 0:
            text = text[: at + len(matched)] if params.no_stop_trim else text[:at]
    return text


def sample_params(params: Any, index: int) -> Any:
    """Sample `index`'s own parameters among `params.n`: n = 1, and with a `sampling_seed`
    s, the seed s + index (wrapped into [-2**63, 2**63 - 1]), so sample i of an n-sample
    request draws exactly what a request seeded s + i alone draws."""
    if params.n == 1:
        return params
    seed = params.sampling_seed
    if seed is not None:
        seed = (seed + index + 2**63) % 2**64 - 2**63
    return dataclasses.replace(params, n=1, sampling_seed=seed)


def stream_due(num_sent: int, num_tokens: int, interval: int, finished: bool) -> bool:
    """Whether a stream hands its unsent tokens over now (SGLang's rule): every token at
    interval 1; else the first token at once, then each time `interval` tokens are waiting,
    and whatever is left when the generation finishes."""
    unsent = num_tokens - num_sent
    if finished:
        return unsent > 0
    return unsent > 0 and (interval == 1 or unsent >= interval or num_sent == 0)
