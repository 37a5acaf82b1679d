"""`ModelRunner`: executes the steps the scheduler plans, on the decode batch's KV.

Synchronous and free of trio (the engine runs each step in a worker thread). It owns what the
computation needs: the model, the decode batch's KV rows (`BatchKV`), the sampler, the
encoders that fill a prompt's media positions, and the KV store it reads a cached prefix from
and puts each full page into. A prefill reads the longest cached prefix under a lease and
computes only the tokens after it; decoding puts each page back as it fills, so the next turn
of a conversation finds its whole history cached. Each sampled token is checked against the
request's stop conditions (SGLang's), and a finished request leaves the batch.

Rows: the scheduler gives each request its row; the runner opens the batch's rows in the same
order and moves them as the scheduler does when one leaves (checking that they agree).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from omni.compute._batch import BatchKV
from omni.compute._engine_types import _Request
from omni.compute._item_cache import ItemCache
from omni.compute._prefix import load_prefix, put_pages, store_pages
from omni.compute.encoders import BuiltinEncoders, Encoded, MediaEncoders
from omni.compute.models import DecoderLM, KVList
from omni.compute.prompt import Audio, Image, PromptTokens
from omni.compute.sampling import TokenSampler, TokenSamplingState
from omni.compute.scheduler import Scheduler, StepPlan
from omni.compute.tokenizer import Tokenizer
from omni.kv import KVStore, MediaSpan, block_keys

__all__ = ["ModelRunner"]


ENCODED_KEPT = 16  # media items whose encodings a runner keeps
MEDIA_HIDDEN_KEPT = 64  # media items whose tapped hidden states a runner keeps
ROWS_KEPT = 1024  # pages whose last-layer hidden states (`last_hidden`) a runner keeps
PREFILL_EWMA = 0.2  # weight of the newest prefill in the estimate of a page's recompute cost
STEP_BUDGET = 0.002  # seconds of decoding one worker-thread hop may run when no one waits


class ModelRunner:
    """Prefill and decode steps of one decoder on the scheduler's batch rows.

    Args:
        model, config: the `DecoderLM` and its `DecoderConfig`.
        scheduler: whose plans it executes and whose rows it keeps.
        tokenizer: reads the output's text for stop strings (None: stop ids only).
        store: where cached prefixes come from and full pages go (None: no reuse).
        page_size: tokens per KV page; `model_id` goes into every page key.
        media: the model's media encoders (None: the built-in ones).
        seed: the built-in encoders' weights.
    """

    def __init__(self, model: DecoderLM, config: Any, scheduler: Scheduler[_Request], *,
                 tokenizer: Tokenizer | None, store: KVStore | None, page_size: int,
                 model_id: str, media: MediaEncoders | None = None, seed: int = 0):
        self.model = model.eval()
        self.config = config
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.store = store
        self.page_size = page_size
        self.model_id = model_id
        self.dtype = next(model.parameters()).dtype
        self.device = next(model.parameters()).device
        # the checkpoint's encoders, or the built-in ones (one small projection each, on the
        # CPU in float32); embeddings move to the model's device and dtype (`prompt_inputs`)
        self.media: MediaEncoders = media or BuiltinEncoders(config.hidden_size, seed)
        # the last ENCODED_KEPT items' encodings, by (cache salt, kind, content digest): an
        # item sent again under the same salt is not encoded again, under another it is
        self.encoded: ItemCache[tuple[str, str, bytes], Encoded] = ItemCache(ENCODED_KEPT)
        # a model whose media encoders name a layer (Qwen3-Omni's talker reads the thinker's
        # hidden states there at media positions): those rows are kept from each prefill,
        # the last MEDIA_HIDDEN_KEPT items', keyed by everything before them (`_media_key`)
        self.tap_layer: int | None = getattr(self.media, "tap_layer", None)
        self._media_hidden: ItemCache[bytes, torch.Tensor] = ItemCache(MEDIA_HIDDEN_KEPT)
        # the rows `last_hidden` computed for each full page it put into the store, by the
        # page's key: a cached prefix is read only as far as both its KV and its rows go
        self._rows: ItemCache[bytes, torch.Tensor] = ItemCache(ROWS_KEPT)
        self.batch = BatchKV(config.num_layers, config.num_kv_heads, config.head_dim,
                             scheduler.max_batch, self.dtype, self.device)
        self._sampler = TokenSampler()
        self._batch_sampling: TokenSamplingState | None = None  # rebuilt when rows change
        # Seconds prefill takes per page of prompt (an EWMA; None until a prefill ran): what
        # the store's peer fetch must beat to be worth it.
        self.prefill_page_s: float | None = None
        self.counts = {"prefills": 0, "prefill_tokens": 0, "decode_steps": 0}

    def page_keys(self, token_ids: Any, spans: list[MediaSpan],
                  cache_salt: str = "") -> list[bytes]:
        """The store keys of the full pages of `token_ids` (media digests included); a
        `cache_salt` gives another set of keys: requests of different salts share no page."""
        extra = (self.model_id,) if not cache_salt else (self.model_id, "salt", cache_salt)
        return block_keys(token_ids, self.page_size, extra=extra, media=spans)

    def reusable_keys(self, r: _Request) -> list[bytes]:
        """The keys of the request's pages a prefill may read cached (`_reusable`)."""
        return self._reusable(r.keys, len(r.tokens))

    def eos_ids(self) -> tuple[int, ...]:
        """The ids that end generation: the tokenizer's, else the model config's."""
        eos = () if self.tokenizer is None else self.tokenizer.eos_token_ids
        return tuple(eos or self.config.eos_token_ids)

    # -- a step -----------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, plan: StepPlan[_Request]) -> None:
        """Run a planned step: drop the cancelled, prefill the admitted, then decode on in
        this thread while nothing needs the event loop (no one waits to be admitted, no
        stream wants its token now, nobody finished), for up to STEP_BUDGET: a hop to the
        event loop and back costs as much as a small model's decode step."""
        for r in plan.dropped:
            self.drop(r)
        for r in plan.prefill:
            if r.cancelled:
                continue
            self.scheduler.place(r)
            # a fork cancelled before it got a row needs none (a cancel arriving later is
            # dropped at the next step's start)
            forks = [fork for fork in r.forks if not fork.cancelled]
            for fork in forks:
                self.scheduler.place(fork)
            for sample, token in self.prefill(r, forks):
                if token is None:  # max_new_tokens=0: the prompt is cached only
                    sample.finish_reason = sample.sampling.finish_reason
                    self.drop(sample)
                else:
                    self._accept(sample, token)
        deadline = time.perf_counter() + STEP_BUDGET
        running = self.scheduler.running
        while running:
            size = len(running)
            for r, token in zip(list(running), self.decode(running), strict=True):
                self._accept(r, token)
            if (len(running) != size or self.scheduler.waiting
                    or time.perf_counter() > deadline
                    or any(r.cancelled or (r.streaming and r.stream_due()) for r in running)):
                return

    def _accept(self, r: _Request, token: int) -> None:
        """Append a sampled token; a request it finishes leaves the batch."""
        r.output.append(token)
        text = None
        tail = r.sampling.stop_tail_ids()
        if tail and self.tokenizer is not None:
            # SGLang matches stop strings and regexes in the text of the output's last tokens
            # only (its tail window), decoded with special tokens kept
            text = self.tokenizer.decode(tail, skip_special_tokens=False)
        reason = r.sampling.check_stop(token, text, self.eos_ids())
        if reason is not None:
            r.finish_reason = reason
            self.drop(r)

    def drop(self, r: _Request) -> None:
        """Take a request out of the batch: its scheduler row and its KV row (the last row
        moves into it in both)."""
        if r.row is None:
            return
        moved_in_batch = self.batch.remove(r.row)
        if self.scheduler.remove(r) != moved_in_batch:
            raise AssertionError("the scheduler's rows and the batch's KV rows disagree")

    # -- prefill ----------------------------------------------------------------------------

    def prefill(self, r: _Request, forks: list[_Request]) -> list[tuple[_Request, int | None]]:
        """Compute a prompt after its cached prefix into `r.row`, copy it into each fork's
        row, put its new full pages into the store; returns each sample's first token (None
        for a sample that asked for none)."""
        ids = r.tokens.token_ids
        self._open_row(r, len(ids))
        self._load_cached_prefix(r)
        start = r.cached_tokens
        past = self.batch.row_kv(r.row, 0, start) if start else None
        positions = self._prompt_positions(r, start)
        began = time.perf_counter()
        embeds, deepstack = self.prompt_inputs(r.tokens, start, r.cache_salt)
        if self.tap_layer is not None and r.tokens.media:
            taps: dict[int, torch.Tensor | None] = {self.tap_layer: None}
            hidden, new_kv = self.model.forward(embeds, positions, past, deepstack=deepstack,
                                                taps=taps)
            self._keep_media_hidden(r, start, taps[self.tap_layer])
        else:
            hidden, new_kv = self.model.forward(embeds, positions, past, deepstack=deepstack)
        self._note_prefill(time.perf_counter() - began, len(ids) - start)
        self.counts["prefills"] += 1
        self.counts["prefill_tokens"] += len(ids) - start
        logits = self.model.logits(hidden[:, -1])
        firsts = [(sample, self._first_token(sample, logits)) for sample in (r, *forks)]
        # After the first tokens, which need none of it: the row's KV, the forks' copies of
        # it, the new pages in the store
        self.batch.extend(r.row, new_kv)
        r.length = len(ids)
        r.stored_pages = start // self.page_size
        for fork in forks:
            if self.batch.fork(r.row) != fork.row:
                raise AssertionError(f"batch row of a fork is not the scheduler's {fork.row}")
            fork.length, fork.stored_pages = r.length, r.stored_pages
            fork.position_offset = r.position_offset
            fork.cached_tokens = r.cached_tokens
        self._store_pages(r, ids)
        return firsts

    def _open_row(self, r: _Request, reserve: int) -> None:
        if self.batch.open_row(reserve) != r.row:
            raise AssertionError(f"batch row of a request is not the scheduler's {r.row}")

    def _load_cached_prefix(self, r: _Request) -> None:
        """Copy the longest cached prefix's pages into the request's batch row."""
        r.cached_tokens = load_prefix(self.store, self.batch, int(r.row),  # type: ignore[arg-type]
                                      self.reusable_keys(r), self.page_size)

    def _note_prefill(self, seconds: float, tokens: int) -> None:
        """Fold one prefill's wall time per page into the recompute-cost estimate."""
        if tokens <= 0:
            return
        per_page = seconds / tokens * self.page_size
        last = self.prefill_page_s
        self.prefill_page_s = per_page if last is None else (
            last + PREFILL_EWMA * (per_page - last))

    def _first_token(self, r: _Request, logits: torch.Tensor) -> int | None:
        """The request's first token from its prompt's last logits (None when it asked for
        none); its time to first token ends here."""
        r.first_token_at = time.perf_counter()
        if r.sampling.finish_reason is not None:
            return None
        return int(self._sampler.step(logits, TokenSamplingState([r.sampling]))[0])

    def _prompt_positions(self, r: _Request, start: int) -> torch.Tensor:
        """RoPE positions of the prompt's tokens from `start` on (see `_positions`); the
        request's decode positions run on from the largest (`position_offset`)."""
        positions = self._positions(r.tokens)
        r.position_offset = int(positions.max()) + 1 - len(r.tokens)
        return positions[..., start:]

    def _positions(self, tokens: PromptTokens) -> torch.Tensor:
        """RoPE positions of a prompt: [1, T], or [3, 1, T] for a model with multimodal
        positions and a prompt with media."""
        multimodal = self.media.positions(tokens) if tokens.media else None
        if multimodal is None:
            return torch.arange(len(tokens), device=self.device)[None]
        return multimodal[:, None].to(self.device)

    def _keep_media_hidden(self, r: _Request, start: int, rows: torch.Tensor | None) -> None:
        """Keep the tapped rows [1, T - start, E] of each media item this prefill computed
        whole (an item partly in the cached prefix is not kept)."""
        if rows is None:
            return
        for item in r.tokens.media:
            if item.start < start:
                continue
            key = self._media_key(r.tokens, item.start + item.length, r.cache_salt)
            span = slice(item.start - start, item.start + item.length - start)
            self._media_hidden.put(key, rows[0, span].clone())

    def media_hidden(self, tokens: PromptTokens, cache_salt: str = ""
                     ) -> dict[int, torch.Tensor] | None:
        """The tapped hidden states of each media item of a prompt an earlier prefill
        computed ({item start: rows [length, E]}); None when one is not kept (then
        `hidden_at` computes them)."""
        found = {}
        for item in tokens.media:
            rows = self._media_hidden.get(
                self._media_key(tokens, item.start + item.length, cache_salt))
            if rows is None:
                return None
            found[item.start] = rows
        return found

    def _media_key(self, tokens: PromptTokens, end: int, cache_salt: str) -> bytes:
        """What determines the hidden states of positions before `end`: the model, the salt,
        the ids and the media up to there (one page key of `end` tokens)."""
        spans = [span for span in tokens.spans() if span.start < end]
        extra = (self.model_id, "hidden", cache_salt)
        return block_keys(tokens.token_ids[:end], end, extra=extra, media=spans)[0]

    @torch.inference_mode()
    def hidden_at(self, tokens: PromptTokens, layer: int,
                  cache_salt: str = "") -> torch.Tensor:
        """The prompt's hidden states ``[T, hidden]`` after layer ``layer - 1`` (see
        `DecoderLM.hidden_at`), computed over the whole prompt (no cached KV is read: the
        store keeps KV, not hidden states); `cache_salt` the request's."""
        embeds, deepstack = self.prompt_inputs(tokens, cache_salt=cache_salt)
        return self.model.hidden_at(layer, embeds, self._positions(tokens), deepstack)[0]

    @torch.inference_mode()
    def last_hidden(self, tokens: PromptTokens, cache_salt: str = ""
                    ) -> tuple[torch.Tensor, int]:
        """Every prompt token's hidden state after the model's last layer, before its final
        norm (``[T, hidden]``: a text encoder's output, the model loaded with only the layers
        read), and how many of them came from cache.

        A cached prefix of full pages (under the request's `cache_salt`, at least one token
        left to compute) gives both its KV, from the store, and its rows, kept here by page
        key when they were computed: only the tokens after it run, attending to that KV.
        The new full pages go into the store, their rows beside them."""
        keys = self.page_keys(tokens.token_ids, tokens.spans(), cache_salt)
        cached, rows = self._cached_rows(self._reusable(keys, len(tokens)))
        hidden, _, _, cached = self._prefill_after(tokens, keys, cached, cache_salt)
        rows = torch.cat([*rows[:cached], hidden[0]])
        size = self.page_size
        for i in range(cached, len(keys)):
            self._rows.put(keys[i], rows[i * size:(i + 1) * size].clone())
        return rows, cached * size

    @torch.inference_mode()
    def prompt_kv(self, tokens: PromptTokens, cache_salt: str = "") -> tuple[KVList, int]:
        """Every layer's (k, v) ``[1, Hkv, T, D]`` of the prompt, keys rotated as attention
        reads them, and how many tokens came from cache (what another model reads of a
        prompt as its context: Cosmos3's generation expert).

        The longest cached prefix of full pages (under the request's `cache_salt`, at least
        one token left to compute) is read from the store: only the tokens after it run,
        attending to it. The new full pages go into the store."""
        keys = self.page_keys(tokens.token_ids, tokens.spans(), cache_salt)
        held = self._held(self._reusable(keys, len(tokens)))
        _, past, new_kv, cached = self._prefill_after(tokens, keys, held, cache_salt)
        kv = new_kv if past is None else [
            (torch.cat([pk, k], dim=2), torch.cat([pv, v], dim=2))
            for (pk, pv), (k, v) in zip(past, new_kv, strict=True)]
        return kv, cached * self.page_size

    def _reusable(self, keys: list[bytes], num_tokens: int) -> list[bytes]:
        """The keys of a prompt's pages a prefill may read cached (it computes >= 1 token)."""
        return keys[: (num_tokens - 1) // self.page_size]

    def _held(self, keys: list[bytes]) -> int:
        """How many pages of `keys`' prefix the store holds."""
        return 0 if self.store is None or not keys else self.store.match(keys)

    def _prefill_after(self, tokens: PromptTokens, keys: list[bytes], cached: int,
                       cache_salt: str) -> tuple[torch.Tensor, KVList | None, KVList, int]:
        """The prompt's tokens after its first `cached` pages (named by `keys`, read from the
        store under a lease: fewer when some went since they were matched) through every
        layer. Returns their last layer's output ``[1, T - start, hidden]`` before the final
        norm, the pages' KV read (None for none) and the new tokens' KV, and how many pages
        were read; puts the new full pages into the store (best effort: a full store keeps
        them out, said in the log)."""
        past = None
        if cached:
            with self.store.acquire(keys[:cached]) as lease:  # type: ignore[union-attr]
                cached = len(lease)
                if cached:
                    past = DecoderLM.kv_from_pages(lease.pages())
        start = cached * self.page_size
        embeds, deepstack = self.prompt_inputs(tokens, start, cache_salt)
        hidden, new_kv = self.model._run_layers(
            embeds, self._positions(tokens)[..., start:], past, None, deepstack, None,
            self.config.num_layers)
        self.counts["prefills"] += 1
        self.counts["prefill_tokens"] += len(tokens) - start
        if self.store is not None and len(keys) > cached:  # `start` begins a page
            put_pages(self.store, keys[cached:], DecoderLM.kv_to_pages(new_kv, 0, self.page_size))
        return hidden, past, new_kv, cached

    def _cached_rows(self, keys: list[bytes]) -> tuple[int, list[torch.Tensor]]:
        """How many pages of `keys`' prefix both the store and the kept rows hold, and those
        pages' rows."""
        rows = []
        for key in keys[:self._held(keys)]:
            kept = self._rows.get(key)
            if kept is None:
                break
            rows.append(kept)
        return len(rows), rows

    def embed_prompt(self, tokens: PromptTokens, start: int = 0) -> torch.Tensor:
        """Input embeddings ``[1, T - start, hidden]`` of a prompt's tokens from `start` on,
        with each image's and audio clip's embeddings at its placeholder positions."""
        return self.prompt_inputs(tokens, start)[0]

    def prompt_inputs(self, tokens: PromptTokens, start: int = 0,
                      cache_salt: str = "") -> tuple[torch.Tensor, torch.Tensor | None]:
        """`embed_prompt`, and the deepstack features ``[k, 1, T - start, hidden]`` of its
        images (None when none has any); media encodings are reused only from requests of
        the same `cache_salt` (`encode`)."""
        ids = torch.tensor(tokens.token_ids[start:], device=self.device)[None]
        hidden = self.model.embed(ids)  # [1, T - start, hidden]
        deepstack: torch.Tensor | None = None
        for item in tokens.media:
            lo, hi = max(item.start, start), min(item.start + item.length, len(tokens))
            if lo >= hi:
                continue
            encoded = self.encode(item.segment, cache_salt)
            embeds = encoded.embeds.to(hidden.device, hidden.dtype)  # [n, E]
            hidden[0, lo - start: hi - start] = embeds[lo - item.start: hi - item.start]
            if encoded.deepstack is not None:
                if deepstack is None:
                    deepstack = hidden.new_zeros(len(encoded.deepstack), *hidden.shape)
                deepstack[:, 0, lo - start: hi - start] = encoded.deepstack[
                    :, lo - item.start: hi - item.start].to(hidden.device, hidden.dtype)
        return hidden, deepstack

    def encode(self, segment: Image | Audio, cache_salt: str = "") -> Encoded:
        """A media item's encoding: kept from an earlier request of the same `cache_salt`
        (`encoded`), else from the model's encoders."""
        key = (cache_salt, type(segment).__name__, segment.digest)
        encoded = self.encoded.get(key)
        if encoded is None:
            encoded = self.media.encode(segment)
            self.encoded.put(key, encoded)
        return encoded

    # -- decode -----------------------------------------------------------------------------

    def decode(self, running: list[_Request]) -> list[int]:
        """One token for every running request (by row): their last tokens' KV joins the
        batch, pages that filled go to the store; returns the sampled tokens, by row."""
        tokens = torch.tensor([[r.output[-1]] for r in running], device=self.device)
        positions = torch.tensor([[r.length + r.position_offset] for r in running],
                                 device=self.device)
        hidden, new_kv = self.model.forward(self.model.embed(tokens), positions,
                                            self.batch.past(), self.batch.mask())
        self.counts["decode_steps"] += 1
        self.batch.append(new_kv)
        logits = self.model.logits(hidden[:, -1])
        for r in running:
            r.length += 1
        rows = tuple(r.sampling for r in running)
        if self._batch_sampling is None or self._batch_sampling.requests != rows:
            self._batch_sampling = TokenSamplingState(rows)
        sampled = self._sampler.step(logits, self._batch_sampling).tolist()
        for r in running:
            if r.length // self.page_size > r.stored_pages:
                self._store_pages(r, r.tokens.token_ids + tuple(r.output))
        return sampled

    def _store_pages(self, r: _Request, ids: tuple[int, ...]) -> None:
        """Put the request's newly completed full pages into the store (best effort)."""
        full = r.length // self.page_size
        if self.store is None or full <= r.stored_pages:
            return
        keys = self.page_keys(ids[: full * self.page_size], r.spans, r.cache_salt)
        store_pages(self.store, self.batch, int(r.row), keys,  # type: ignore[arg-type]
                    r.stored_pages, self.page_size)
        r.stored_pages = full
