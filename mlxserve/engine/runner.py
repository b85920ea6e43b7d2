"""The only place that calls the model.

Batched work goes through mlx-lm's `BatchGenerator` (continuous batching,
chunked prefill between decode steps). A request that runs alone takes a lean
path instead, `SoloDecoder`, which does what mlx-lm's `generate_step` does:
the batch machinery (padding masks, per-row bookkeeping, splitting logprobs)
makes a lone sequence decode 1.5-1.7x slower on a GPU. When a second request
arrives, the solo sequence moves into the batch with its KV cache, at a token
boundary, and carries on there. With speculative decoding on, the solo path
verifies proposed tokens several at a time (engine/speculative.py).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from mlxserve.cache import chunked, paged, paged_batch
from mlxserve.cache.quantized import make_cache, set_dequantize
from mlxserve.engine import grammar as constrained
from mlxserve.engine.batch_generator import BatchGenerator
from mlxserve.engine.compiled import CompiledDecode, compilable
from mlxserve.engine.grammar import grammar_of
from mlxserve.engine.media import MediaPrefill
from mlxserve.engine.request import Request
from mlxserve.engine.sampling import top_logprobs
from mlxserve.engine.scoring import PromptScorer
from mlxserve.engine.speculative import verify
from mlxserve.models import llama4_batch, mlx_lm_fixes
from mlxserve.models.last_logits import head_owner, last_logits

log = logging.getLogger("mlxserve.engine")
constrained.install()  # batches mask their constrained rows together (engine/grammar.py)
chunked.install()  # Llama 4's chunked-attention caches merge into a batch (cache/chunked.py)
llama4_batch.install()  # and its forward pass takes them (models/llama4_batch.py)
mlx_lm_fixes.install()  # other model types' code, where a batch or a cache hit changed tokens


@dataclass
class Sequence:
    """A request while it runs: everything the runner needs per sequence."""

    request: Request
    max_tokens: int
    sampler: Any
    processors: list
    stop_ids: set[int]
    stop_sequences: Any
    num_generated: int = 0
    uid: int | None = None  # id inside the BatchGenerator
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache
    block_hashes: list = field(default_factory=list)  # of the prompt's full blocks
    extra_keys: list | None = None  # per block: the images in it (see Request.block_extra_keys)
    # Token counts where prefill passes stop and keep recurrent states (PrefixCache.checkpoints).
    checkpoints: list[int] = field(default_factory=list)
    # Token ranges a prefill pass holds whole or not at all: the images of a model whose image
    # tokens attend to each other both ways (VisionAdapter.whole_images).
    whole: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: list | None = None  # computed by a PromptScorer; its first event carries them
    queued_at: float = 0.0  # time.perf_counter() when the scheduler queued it
    # Where its first token's time went (perf_counter): admitted (handed to the runner: the end
    # of queueing) and prefill done (the pass holding its prompt's last chunk ended).
    admitted_at: float | None = None
    prefill_done_at: float | None = None

    def cut(self, done: int, n: int) -> int:
        """The next prefill pass's length from `done` tokens: at most n, ending at a checkpoint,
        and never inside a `whole` range: before it, or (the pass starting there) after all of it."""
        stop = next((p for p in self.checkpoints if p > done), None)
        end = done + (n if stop is None else min(n, stop - done))
        for lo, hi in self.whole:
            if lo < end < hi:
                return (lo if lo > done else hi) - done
        return end - done

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def finish_reason(self, token: int) -> str | None:
        if token in self.stop_ids:
            return "stop"
        if self.num_generated >= self.max_tokens:
            return "length"
        return None


@dataclass
class TokenEvent:
    seq: Sequence
    token: int
    finish_reason: str | None
    logprob: float | None = None
    top: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # on the sequence's first event, when it asked for them
    # On the sequence's first token: (admitted_at, prefill_done_at), its phases' ends before it.
    phases: tuple[float | None, float | None] | None = None


def _event(seq: Sequence, token: int | None, finish: str | None, row: mx.array | None) -> TokenEvent:
    # token None: a prompt-only request (max_tokens 0) that ends without generating.
    event = TokenEvent(seq, token, finish, prompt_logprobs=seq.prompt_logprobs)
    seq.prompt_logprobs = None
    if token is not None and seq.num_generated == 1:  # every path counts a token before its event
        event.phases = (seq.admitted_at, seq.prefill_done_at)
    if seq.request.params.logprobs and row is not None:
        event.logprob, event.top = top_logprobs(row, token, seq.request.params.top_logprobs)
    return event


class SoloDecoder:
    """One sequence, prefilled in chunks and decoded like `generate_step`."""

    def __init__(self, model, seq: Sequence, chunk_size: int, cache, prefix_cache=None, prefilled=None,
                 prompt_inputs=None, spec=None, compiled: CompiledDecode | None = None):
        self.model = model
        self.head_owner = head_owner(model)  # the last prefill pass projects its last position alone
        # One-token decode passes go through the compiled step where the model and cache allow it.
        use = compiled is not None and prompt_inputs is None and compilable(model, cache)
        self.compiled = compiled if use else None
        # For prompts with images: prompt_inputs(start, end) gives the model's extra inputs
        # (embeddings, positions) for prompt tokens [start, end); prompt_inputs.end is where they stop.
        self.prompt_inputs = prompt_inputs
        self.seq = seq
        self.chunk_size = chunk_size
        self.prefix_cache = prefix_cache
        prompt = list(seq.request.prompt_token_ids)
        self.cache = cache  # the runner makes it (make_cache: quantized with --kv-bits) or restores it
        n = seq.cached_tokens if prefilled is None else prefilled  # prompt tokens already in `cache`
        self.in_cache: list[int] = prompt[:n]
        self.todo = prompt[n:]  # not yet in the cache
        # The grammar (last, if any) reads only the fed token; the others (penalties, biases)
        # read the tokens in the cache, kept as an array for them alone.
        self.grammar = grammar_of(seq.processors)
        self.penalties = seq.processors[:-1] if self.grammar else seq.processors
        self.context = mx.array(self.in_cache) if self.penalties and self.in_cache else None
        self.pending = None  # (token, logprobs) sampled but not yet emitted
        self.unfed: int | None = None  # the last token emitted, not yet in the cache nor queued
        # Speculation (a SequenceSpeculation), or None. A verify pass needs the last token on
        # the host before it is built, so while the proposer expects to hit, no one-token pass
        # is queued ahead (`speculating`); history is every token known: prompt and output.
        self.spec = spec
        self.speculating = False
        self.history = list(prompt) if spec is not None else None

    def _extend_context(self, tokens: mx.array) -> None:
        if self.penalties:
            self.context = tokens if self.context is None else mx.concat([self.context, tokens])

    def _inputs(self, n: int) -> dict:
        """Extra model inputs for the next n prompt tokens (none for text)."""
        start = len(self.in_cache)
        if self.prompt_inputs is None or start >= self.prompt_inputs.end:
            return {}
        return self.prompt_inputs(start, start + n)

    def _forward(self, tokens: mx.array, inputs: dict | None = None):
        if self.compiled is not None and tokens.size == 1 and not inputs and self.cache[0].keys is not None:
            limit = len(self.seq.request.prompt_token_ids) + self.seq.max_tokens
            logits = self.compiled(tokens, self.cache, limit)
        else:
            logits = last_logits(self.model, tokens[None], self.cache, self.head_owner, **(inputs or {}))
        if self.penalties:
            self._extend_context(tokens)
            for processor in self.penalties:
                logits = processor(self.context, logits)
        if self.grammar is not None:
            logits = self.grammar(tokens, logits)  # the fed token itself: reading it queues no kernel
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        sampler = self.seq.sampler
        token = sampler(logprobs) if sampler else mx.argmax(logprobs, axis=-1)
        mx.async_eval(token, logprobs)
        return token, logprobs[0]

    def _prefill_chunk(self, n: int) -> None:
        chunk = self.todo[:n]
        chunk_arr = mx.array(chunk)
        self.model(chunk_arr[None], cache=self.cache, **self._inputs(n))
        self._extend_context(chunk_arr)
        mx.eval([c.state for c in self.cache])
        self.in_cache += chunk
        self.todo = self.todo[n:]
        self.store_blocks()

    def step(self) -> list[TokenEvent]:
        with mx.stream(generation_stream):
            if self.unfed is not None:  # a token emitted, not fed: verify drafts after it, or feed it and pipeline
                if self.spec is not None:
                    events = self._speculate()
                    if events:
                        return events
                self.pending = self._forward(mx.array([self.unfed]))
                self.in_cache.append(self.unfed)
                self.unfed = None
                return [self._emit(pipeline=True)]
            if self.pending is not None:  # decoding
                return [self._emit(pipeline=True)]
            n = self.seq.cut(len(self.in_cache), self.chunk_size)
            if len(self.todo) > n:  # prefill one chunk
                self._prefill_chunk(n)
                return []
            # The rest of the prompt fits one chunk: its forward pass ends with the
            # logits of the last prompt token, the first output token. (generate_step
            # runs the last token as a pass of its own: one more step of latency.)
            self.pending = self._forward(mx.array(self.todo), self._inputs(len(self.todo)))
            self.in_cache += self.todo
            self.todo = []
            self.prompt_inputs = None  # its embeddings are no longer needed
            self.store_blocks()
            # The first token goes out as soon as it is ready: queuing the next step
            # first (as generate_step does) would hold it back by a whole step's graph
            # building, 5-15 ms of host work per step on a GPU.
            event = self._emit(pipeline=False)
            if not event.finish_reason:
                self.unfed = event.token
            return [event]

    def _emit(self, pipeline: bool) -> TokenEvent:
        """Emit the pending token. pipeline: go on decoding (the next pass is queued before the
        token is read, as generate_step does, unless a verify pass comes next); else stop there."""
        token_arr, row = self.pending
        seq = self.seq
        last = seq.num_generated + 1 >= seq.max_tokens
        if pipeline and not last and not self.speculating:
            self.pending = self._forward(token_arr)
        else:
            self.pending = None
        token = token_arr.item()
        if seq.prefill_done_at is None:
            # The pass of the prompt's last chunk also gave this first token: it ended when the
            # token was read. (The solo path has no step between prefill and first token.)
            seq.prefill_done_at = time.perf_counter()
        seq.num_generated += 1
        event = _event(seq, token, seq.finish_reason(token), row)
        if self.pending is not None:
            self.in_cache.append(token)
        elif pipeline and not event.finish_reason:
            self.unfed = token  # the next step feeds it, with drafts after it
        if self.spec is not None:
            self.history.append(token)
            self.speculating = self.spec.expects(self.history)
        return event

    def _speculate(self) -> list[TokenEvent]:
        """One verify pass over the unfed token and the proposer's drafts: emits the drafts
        that equal the model's own tokens and the token after them (none when nothing is
        proposed), and trims the cache back to the tokens before the last one emitted."""
        seq = self.seq
        drafts = self.spec.drafts(self.history, seq.max_tokens - seq.num_generated - 1, self.cache)
        self.speculating = bool(drafts)
        if not drafts:
            return []
        fed = [self.unfed] + drafts
        tokens, logprobs, keys, context = verify(self.model, self.cache, fed, seq, self.penalties, self.context)
        events = []
        for i, token in enumerate(tokens):
            seq.num_generated += 1
            events.append(_event(seq, token, seq.finish_reason(token), logprobs[i]))
            if events[-1].finish_reason or i == len(drafts) or token != drafts[i]:
                break
        m = len(events)
        # The cache keeps what was fed before the last emitted token: the unfed one and m - 1 drafts.
        if trim_prompt_cache(self.cache, len(fed) - m) != len(fed) - m:  # drafts() keeps within what trims
            raise RuntimeError("speculative decoding: the cache could not drop the rejected tokens")
        self.in_cache += fed[:m]
        self.history += tokens[:m]
        if self.penalties:
            self.context = context[:context.size - len(fed) + m]
        if keys is not None:
            seq.sampler.key = keys[m - 1]  # the draws of the tokens emitted, as if made one per step
        self.unfed = None if events[-1].finish_reason else tokens[m - 1]
        self.spec.count(len(drafts), sum(t == d for t, d in zip(tokens[:m], drafts)), m)
        return events

    def store_blocks(self, finished: bool = False) -> None:
        """Hand every full block now in the cache to the prefix cache (and the partial block
        after them when the sequence is done, or at the prompt's tail end)."""
        pc = self.prefix_cache
        if pc is not None:
            n = len(self.in_cache)
            tail = finished or n == pc.prompt_tail_end(len(self.seq.request.prompt_token_ids))
            pc.store_from_cache(self.cache, self.in_cache, n, self.seq.extra_keys, hashes=self.seq.block_hashes,
                                finished=tail, state=finished or n in self.seq.checkpoints)

    def handover(self) -> tuple[TokenEvent | None, list[int], list[int]]:
        """Stop solo decoding at a token boundary.

        Returns (the token already sampled, if any, as an event), the prompt
        the batch must still process, and the tokens already in the cache.
        """
        if self.unfed is not None:
            token, self.unfed = self.unfed, None
            return None, [token], self.in_cache
        if self.pending is None:
            # The batch takes token ids only: prefill what needs embeddings (images) here first.
            with mx.stream(generation_stream):
                while self.prompt_inputs is not None and len(self.in_cache) < self.prompt_inputs.end:
                    done = len(self.in_cache)
                    self._prefill_chunk(self.seq.cut(done, min(self.chunk_size, self.prompt_inputs.end - done)))
            return None, self.todo, self.in_cache
        with mx.stream(generation_stream):
            event = self._emit(pipeline=False)
        return event, [event.token], self.in_cache


class Runner:
    def __init__(self, model, *, max_num_seqs: int, prefill_chunk_size: int,
                 prefill_batch_size: int, solo_fast_path: bool = True, prefix_cache=None,
                 vision=None, vision_cache=None, vision_step_s: float = 0.02, kv_bits: int | None = None,
                 dequantize_kv: bool = False, keep_image_embeddings: bool = False, speculation=None,
                 compile_decode: bool = False, kv_layout: str = "contiguous", block_size: int | None = None):
        self.model = model
        # Paged KV (cache/paged.py): the batch's full-attention KV in a block pool, blocks of the
        # prefix cache's size; requests still prefill and decode alone in mlx-lm's KVCache.
        self.kv_blocks = None
        if kv_layout == "paged":
            paged_batch.install()
            size = prefix_cache.block_size if prefix_cache is not None else block_size
            self.kv_blocks = paged.KVBlocks(size, paged.paged_layers(make_cache(model, None)))
            # Where only paged attention reads the KV update_and_fetch returns, it returns stand-ins.
            self.kv_blocks.fetch_read = paged_batch.fetch_is_read(model, size)
            if prefix_cache is not None:  # the blocks it stores from the solo path go into the pool too
                prefix_cache.kv_pool = self.kv_blocks
        elif kv_layout != "contiguous":
            raise ValueError(f"kv_layout must be one of {paged_batch.KV_LAYOUTS}, not {kv_layout!r}")
        self.compiled = CompiledDecode(model) if compile_decode else None  # the solo path's one-token step
        self.speculation = speculation  # engine/speculative.py's Speculation, for the solo path, or None
        self.kv_bits = kv_bits  # quantized KV (full-attention layers), or None
        self.dequantize_kv = dequantize_kv  # attention reads that KV dequantized (cache/quantized.py)
        self.prefix_cache = prefix_cache  # a PrefixCache, or None when caching is off
        self.vision = vision  # the model's VisionAdapter, for prompts with images
        self.vision_cache = vision_cache
        self.keep_image_embeddings = keep_image_embeddings
        self.vision_step_s = vision_step_s
        self.media: list[MediaPrefill] = []  # prompts with images, being prefilled (in order)
        self.scoring: list[PromptScorer] = []  # prompts whose logprobs are asked for, being scored (in order)
        self.failed: list[tuple[Sequence, str]] = []  # sequences that failed alone; the engine drains it
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk_size = prefill_chunk_size
        self.prefill_batch_size = prefill_batch_size
        self.solo_fast_path = solo_fast_path
        self.solo: SoloDecoder | None = None
        self.batch: dict[int, Sequence] = {}
        self.generator = self._new_generator()

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self.model,
            completion_batch_size=self.max_num_seqs,
            prefill_batch_size=self.prefill_batch_size,
            prefill_step_size=self.prefill_chunk_size,
            # Inside the step: a row whose prefill ends leaves the prompt batch in that same step.
            on_prefill=self._prefilled,
        )

    @property
    def sequences(self) -> list[Sequence]:
        seqs = list(self.batch.values()) + [m.seq for m in self.media] + [s.seq for s in self.scoring]
        if self.solo is not None:
            seqs.append(self.solo.seq)
        return seqs

    def __len__(self) -> int:
        return len(self.batch) + len(self.media) + len(self.scoring) + (self.solo is not None)

    def _restore_prefix(self, seq: Sequence, batch_bound: bool = False):
        """The longest cached prefix of the prompt as a ready cache, or None. `batch_bound`: the
        sequence goes into the batch; a paged batch takes the hit's blocks in its pool by
        reference instead of copies (the rest of the hit is restored as a copy)."""
        pc = self.prefix_cache
        if pc is None:
            return None
        seq.extra_keys = seq.request.block_extra_keys(pc.block_size)
        match = pc.match(seq.request.prompt_token_ids, seq.extra_keys, whole=seq.whole)
        seq.block_hashes = match.hashes
        pooled = self.kv_blocks.attachable(match.blocks, match.num_tokens) if self.kv_blocks is not None else []
        cache = pc.restore(self.model, match, full_from=len(pooled) * pc.block_size if batch_bound else 0)
        pc.release(match)  # the restored cache is a copy; the pooled blocks' references are their own
        if cache is not None and pooled:
            if batch_bound:
                cache = paged_batch.adopt(self.kv_blocks, cache, pooled)
            else:  # restored from those blocks: if it joins the batch later, it takes them
                self.kv_blocks.note(cache, dict(enumerate(pooled)))
        if cache is not None:
            seq.cached_tokens = match.num_tokens
            set_dequantize(cache, self.dequantize_kv)
        seq.checkpoints = pc.checkpoints(seq.cached_tokens, len(seq.request.prompt_token_ids))
        return cache

    def add(self, seq: Sequence) -> list[TokenEvent]:
        """Start a sequence. May return an event of a solo sequence moved into the batch."""
        if seq.request.images and self.vision is None:
            raise ValueError("this model takes no images")
        if seq.request.images and self.vision.whole_images:
            seq.whole = [(im.start, im.start + im.num_tokens) for im in seq.request.images]
        if seq.request.params.prompt_logprobs is not None:  # a fresh cache: see engine/scoring.py
            self.scoring.append(PromptScorer(self.model, seq, self.prefill_chunk_size,
                                             make_cache(self.model, self.kv_bits, dequantize=self.dequantize_kv),
                                             self.prefix_cache))
            return []
        cache = self._restore_prefix(seq, batch_bound=not seq.request.images and not self._solo_free())
        if cache is None:
            cache = make_cache(self.model, self.kv_bits, dequantize=self.dequantize_kv)
        if seq.request.images:
            self.media.append(MediaPrefill(self.vision, seq, self.prefill_chunk_size, cache,
                                           vision_cache=self.vision_cache, prefix_cache=self.prefix_cache,
                                           vision_step_s=self.vision_step_s))
            return []
        return self._start(seq, cache, seq.cached_tokens)

    def _solo_free(self) -> bool:
        return self.solo_fast_path and self.solo is None and not self.batch

    def _start(self, seq: Sequence, cache, prefilled: int, prompt_inputs=None) -> list[TokenEvent]:
        """Run a sequence whose first `prefilled` prompt tokens are in `cache`."""
        if self._solo_free():
            if any(isinstance(c, paged_batch.PagedKVCache) for c in cache):  # part of its KV is in blocks
                raise RuntimeError("a cache made for the paged batch cannot decode alone")
            spec = self.speculation.for_sequence(seq) if self.speculation is not None else None
            self.solo = SoloDecoder(self.model, seq, self.prefill_chunk_size, cache, self.prefix_cache, prefilled,
                                    prompt_inputs, spec, self.compiled)
            return []
        events = []
        if self.solo is not None:
            events = self._solo_to_batch()
        prompt = seq.request.prompt_token_ids
        self._insert(seq, prompt[prefilled:], cache, prompt[:prefilled])
        return events

    def _solo_to_batch(self) -> list[TokenEvent]:
        solo, self.solo = self.solo, None
        event, prompt, in_cache = solo.handover()
        if event is not None and event.finish_reason:
            # Its last token came at the handover: store its blocks as step() does for a finished
            # solo sequence (its prompt's tail was lost: a repeat hit a block end, not len - 1).
            solo.store_blocks(finished=True)
            self._release_embeddings(solo.seq)
            return [event]
        self._insert(solo.seq, prompt, solo.cache, in_cache)
        return [event] if event else []

    def _insert(self, seq: Sequence, prompt: list[int], cache, in_cache: list[int]):
        # Segments end at the checkpoints, where BatchGenerator's prefill stops for this row.
        start = len(in_cache)
        bounds = [0] + [p - start for p in seq.checkpoints if start < p < start + len(prompt)]
        segments = [list(prompt[a:b]) for a, b in zip(bounds, bounds[1:] + [len(prompt)])]
        if self.kv_blocks is not None:  # its full-attention KV goes into blocks as the batch merges it
            cache = paged_batch.adopt(self.kv_blocks, cache)
        (uid,) = self.generator.insert_segments(
            [segments],
            max_tokens=[seq.max_tokens - seq.num_generated],
            caches=[cache],
            all_tokens=[list(in_cache)],
            samplers=[seq.sampler],
            logits_processors=[seq.processors],
            stop_sequences=[seq.stop_sequences],
        )
        seq.uid = uid
        self.batch[uid] = seq

    def remove(self, seq: Sequence) -> None:
        if self.solo is not None and self.solo.seq is seq:
            self.solo = None
        elif any(s.seq is seq for s in self.scoring):
            self.scoring = [s for s in self.scoring if s.seq is not seq]
        elif any(m.seq is seq for m in self.media):
            for m in self.media:
                if m.seq is seq:
                    m.close()
            self.media = [m for m in self.media if m.seq is not seq]
        elif seq.uid in self.batch:
            del self.batch[seq.uid]
            self.generator.remove([seq.uid])

    def step(self) -> list[TokenEvent]:
        """One engine step: a decode step for all, plus one prefill chunk (and one unit of image work)."""
        events = self._media_step() if self.media else []
        if self.scoring:
            events += self._scoring_step()
        if self.solo is not None:
            solo_events = self.solo.step()
            if solo_events and solo_events[-1].finish_reason:
                self.solo.store_blocks(finished=True)  # generated tokens too
                self._release_embeddings(self.solo.seq)
                self.solo = None
            return events + solo_events
        if not self.batch:
            return events
        return events + self._batch_step()

    def _media_step(self) -> list[TokenEvent]:
        m = self.media[0]
        try:
            if m.images_ready() and self._solo_free():
                # Alone: the solo path prefills the rest, image rows included, so the
                # last chunk's pass also gives the first token.
                self.media.pop(0)
                return self._start(m.seq, m.handover_cache(), m.done, m)
            m.step()
        except Exception as e:  # noqa: BLE001 - fail this request, keep the others running
            log.exception("image prefill failed")
            self.media.pop(0).close()
            self.failed.append((m.seq, f"image processing failed: {e}"))
            return []
        if not m.finished:
            return []
        self.media.pop(0)
        return self._start(m.seq, m.cache, m.end)

    def _scoring_step(self) -> list[TokenEvent]:
        """One chunk of the first prompt being scored; once scored, it starts (or ends: max_tokens 0)."""
        scorer = self.scoring[0]
        if not scorer.finished:
            try:
                scorer.step()
            except Exception as e:  # noqa: BLE001 - fail this request, keep the others running
                log.exception("prompt scoring failed")
                self.scoring.pop(0)
                self.failed.append((scorer.seq, f"prompt scoring failed: {e}"))
                return []
            if not scorer.finished:
                return []
        self.scoring.pop(0)
        scorer.finish()
        seq = scorer.seq
        if seq.max_tokens == 0:
            scorer.store_blocks(finished=True)
            return [_event(seq, None, "length", None)]
        return self._start(seq, scorer.cache, scorer.done)

    def _batch_step(self) -> list[TokenEvent]:
        # Per-row logprobs only while a request of the batch asks for them (engine/grammar.py);
        # the flag is read by the step that samples the tokens they belong to, so a request
        # is in `batch` before its first step.
        self.generator._generation_batch.row_logprobs = any(
            s.request.params.logprobs for s in self.batch.values())
        _, responses = self.generator.next()  # the prompts' progress went to _prefilled
        events = []
        for r in responses:
            seq = self.batch.get(r.uid)
            if seq is None:
                continue
            seq.num_generated += 1
            finish = r.finish_reason or seq.finish_reason(r.token)
            if finish:
                del self.batch[r.uid]
                if not r.finish_reason:
                    self.generator.remove([r.uid])
                elif self.prefix_cache is not None and r.prompt_cache is not None:
                    # The finished row's cache holds prompt + output: keep its blocks, the last partial one too.
                    self.prefix_cache.store_from_cache(r.prompt_cache, r.all_tokens, len(r.all_tokens),
                                                       seq.extra_keys, hashes=seq.block_hashes, finished=True)
                    self._release_embeddings(seq)
            events.append(_event(seq, r.token, finish, r.logprobs))
        return events

    def _release_embeddings(self, seq: Sequence) -> None:
        """Drop the vision-cache embeddings of the request's images whose KV the prefix
        cache now holds in full: later turns restore that KV instead of reading them."""
        images = seq.request.images
        if not images or self.keep_image_embeddings or self.prefix_cache is None or self.vision_cache is None:
            return
        covered = self.prefix_cache.covered_tokens(seq.request.prompt_token_ids, seq.extra_keys)
        # Prompts still being prefilled were matched when admitted, maybe before this KV
        # was cached: their images stay until they have read them.
        pending = set().union(*(m.pending_images() for m in self.media))
        for im in images:
            if im.start + im.num_tokens <= covered and im.content_hash not in pending:
                self.vision_cache.release(im.content_hash)

    def _prefilled(self, batch, prompt_progress) -> None:
        """The BatchGenerator's step ran its prefill pass (engine/batch_generator.py): `batch`
        is its prompt batch before the rows whose prefill ended leave it."""
        _note_prefill_done(prompt_progress, self.batch)
        if self.prefix_cache is not None:
            self._store_prompt_blocks(batch)

    def _store_prompt_blocks(self, batch) -> None:
        """Store the blocks each prompt completed in this step's prefill chunk.

        Reads the prompt batch's rows, their batched caches and the tokens each
        row's cache holds.
        """
        for row, uid in enumerate(batch.uids):
            seq = self.batch.get(uid)
            if seq is not None:
                tokens = batch.tokens[row]
                # A row's prefill ends a token short of its prompt: the last token is decode's.
                prompt_len = len(seq.request.prompt_token_ids)
                tail = self.prefix_cache.prompt_tail_end(prompt_len) is not None and len(tokens) >= prompt_len - 1
                self.prefix_cache.store_from_batch(batch.prompt_cache, row, tokens, len(tokens),
                                                   seq.extra_keys, hashes=seq.block_hashes, finished=tail,
                                                   state=len(tokens) in seq.checkpoints)

    def reset(self) -> list[Sequence]:
        """Drop every sequence (after a failed step); returns those dropped."""
        dropped = self.sequences
        self.solo = None
        for m in self.media:
            m.close()
        self.media.clear()
        self.scoring.clear()
        self.batch.clear()
        self.generator.close()
        self.generator = self._new_generator()
        if self.kv_blocks is not None:
            self.kv_blocks.merges.clear()  # a merge the failed step left halfway holds blocks
        return dropped


def _note_prefill_done(prompt_progress, batch: dict[int, Sequence]) -> None:
    """Mark the rows whose prompt's last chunk ran in this step's prefill pass (called as it ends:
    BatchGenerator evaluates it). mlx-lm keeps a prompt's last token for the row's first decode
    input: a row is prefilled once all but that token are in, or when it leaves prefill
    (end_of_prompt: a prompt of one token left). The rest of the step feeds that last token,
    merges the row into the running batch and decodes it (engine/batch_generator.py): its first
    token comes out of the same step."""
    now = time.perf_counter()
    for r in prompt_progress:
        seq = batch.get(r.uid)
        if seq is not None and seq.prefill_done_at is None and (r.end_of_prompt or r.progress[0] >= r.progress[1] - 1):
            seq.prefill_done_at = now
