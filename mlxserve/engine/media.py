"""Prefill of prompts that hold images, one unit of work per engine step.

A unit is a slice of one image's vision-tower pass (tower blocks until
`vision_step_s` is spent; skipped when the vision cache has the image) or one
prompt chunk through the language model, fed as embeddings. Between units the
runner decodes the other requests, so an image arriving mid-stream stalls
them for one unit, not for the whole encode and prefill.

The prompt is prefilled up to the end of its last image (never its last
token); then the sequence joins the solo path or the batch like any text
request, with its cache and (Qwen-VL) its rope delta set: the text after the
images is prefilled there, and the forward pass of the last prompt chunk gives
the first output token (no extra pass for the last token). When the prefix
cache already holds every image, there is nothing to do here but set the delta.
A prompt attended both ways as a whole (PaliGemma's, models/vlm_prefix.py) is
prefilled here to its end in one pass, its last token's keys then dropped for the
pass that samples to feed it again.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
from mlx_lm.generate import generation_stream
from mlx_lm.models.cache import trim_prompt_cache

from mlxserve.engine.stepwise import Stepwise

# Pixel arrays the request did not build up front (its image was cached when it was
# prepared, and no longer is) are built here, off the engine thread: numpy and PIL
# only, tens of ms for a large image, while the engine keeps decoding.
_pixel_builder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlxserve-pixels")
PIXEL_WAIT_S = 0.005  # how long a step waits for that build before decoding on


class MediaPrefill:
    def __init__(self, vision, seq, chunk_size: int, cache, *, vision_cache=None, prefix_cache=None,
                 vision_step_s: float = 0.02):
        self.vision = vision
        self.vision_step_s = vision_step_s
        self.encoding: tuple[int, Stepwise] | None = None  # an image mid-tower
        self.building = None  # the future of a pixel array being built (of the image being encoded next)
        self.seq = seq
        self.chunk_size = chunk_size
        self.vision_cache = vision_cache
        self.prefix_cache = prefix_cache
        self.prompt = list(seq.request.prompt_token_ids)
        self.cache = cache  # the runner makes it (make_cache: quantized with --kv-bits) or restores it
        self.done = seq.cached_tokens  # prompt tokens in the cache
        self.images_end = max(im.start + im.num_tokens for im in seq.request.images)
        # Text after the last image goes the text path (positions = offset + delta there).
        self.end = max(self.done, min(self.images_end, len(self.prompt) - 1))
        # A prompt attended both ways as a whole (PaliGemma's, models/vlm_prefix.py): all of the rest of it
        # in one pass here, its last token included (see _prefill).
        self.whole_prompt = getattr(vision, "prompt_both_ways", False)
        if self.whole_prompt:
            self.end = len(self.prompt) - 1
        self.features: dict[int, mx.array] = {}  # image index -> its embeddings
        self.positions = None
        self.delta = 0
        self._take_cached()

    @property
    def finished(self) -> bool:
        return self.done >= self.end

    def _needed(self, start: int, end: int) -> list[int]:
        """Images with placeholder tokens in [start, end)."""
        return [
            i for i, im in enumerate(self.seq.request.images)
            if im.start < end and im.start + im.num_tokens > start
        ]

    def _take_cached(self) -> None:
        """Take every needed image the vision cache holds now (no step needed for those)."""
        if self.vision_cache is None:
            return
        for i in self._needed(self.done, self.end):
            key = self.seq.request.images[i].content_hash
            if self.vision_cache.contains(key):  # a miss is counted once, by _encode
                self.features[i] = self.vision_cache.get(key)

    def _encode(self, i: int) -> None:
        """Advance image i: from the vision cache at once, else one slice of the tower."""
        image = self.seq.request.images[i]
        key = image.content_hash
        if self.encoding is None:
            asked = self.vision_cache is not None and self.building is None  # a miss counts once
            feats = self.vision_cache.get(key) if asked else None
            if feats is not None:
                self.features[i] = feats
                return
            if not self._pixels_ready(i):
                return
            budget = self.vision_step_s if self.vision_step_s > 0 else float("inf")
            self.encoding = (i, Stepwise(lambda: self.vision.encode(image.pixels), budget))
        if not self.encoding[1].step():
            return
        feats = self.encoding[1].result
        self.encoding = None
        if feats.shape[0] != image.num_tokens:
            raise ValueError(f"image {i} gave {feats.shape[0]} embeddings for {image.num_tokens} tokens")
        if self.vision_cache is not None:
            self.vision_cache.put(key, feats)
        self.features[i] = feats

    def _pixels_ready(self, i: int) -> bool:
        """Whether image i's pixel array exists; if not, have it built off this thread."""
        inp = self.seq.request.images[i].pixels
        if inp.pixel_values is not None:
            return True
        if self.building is None:
            self.building = _pixel_builder.submit(self.vision.pixels, inp)
        future = self.building
        if not future.done():
            try:
                future.result(timeout=PIXEL_WAIT_S)  # a short wait, not a busy engine loop
            except TimeoutError:
                return False
        self.building = None
        future.result()  # the processor's error, if it failed
        return True

    def pending_images(self) -> set[str]:
        """Content hashes of the images this prompt still needs embeddings of."""
        images = self.seq.request.images
        return {images[i].content_hash for i in self._needed(self.done, self.end) if i not in self.features}

    def close(self) -> None:
        """Stop an image mid-tower (the request left)."""
        if self.encoding is not None:
            self.encoding[1].close()
            self.encoding = None

    def _ensure_positions(self, full: bool = True) -> None:
        """M-RoPE positions of the whole prompt and the delta of the text after the images;
        without `full`, the delta alone when every image token is in the cache already."""
        if self.positions is not None or not self.vision.text_model.mrope:
            return
        images = [im.pixels for im in self.seq.request.images]
        if not full and self.done >= self.images_end:
            self.delta = self.vision.rope_delta(self.prompt, images)
        else:
            self.positions, self.delta = self.vision.positions(self.prompt, images)

    def images_ready(self) -> bool:
        """Every image the rest of the prompt needs has its embeddings (no tower work left), so the
        solo path may prefill the rest. Never for a prompt attended both ways as a whole: the solo
        path prefills in causal chunks, and its prompt is prefilled here, in one pass."""
        if self.whole_prompt:
            return False
        return self.encoding is None and all(i in self.features for i in self._needed(self.done, self.end))

    def step(self) -> None:
        """One unit of work: encode one image or prefill one chunk."""
        with mx.stream(generation_stream):
            self._ensure_positions(full=False)
            start = self.done
            end = start + self.seq.cut(start, min(self.chunk_size, self.end - start))
            end = self.end if self.whole_prompt else end
            missing = [i for i in self._needed(start, end) if i not in self.features]
            if missing:
                self._encode(missing[0])
            else:
                self._prefill(start, end)

    def __call__(self, start: int, end: int) -> dict:
        """Embeddings (and M-RoPE positions) of prompt tokens [start, end): the solo path's
        `prompt_inputs` (needed up to `self.end`, the last image's end)."""
        with mx.stream(generation_stream):
            self._ensure_positions()
            return {**self._inputs(start, end),
                    "positions": None if self.positions is None else self.positions[..., start:end]}

    def handover_cache(self):
        """The cache, with the rope delta set, for the path that takes the sequence over."""
        with mx.stream(generation_stream):
            self._ensure_positions(full=False)
        if self.vision.text_model.mrope:
            self.cache[-1].set(self.delta)
        return self.cache

    def _inputs(self, start: int, end: int) -> dict:
        """The language model's inputs for prompt tokens [start, end): embeddings, and the
        family's per-chunk extras (Qwen3-VL's deepstack rows, Gemma 4's per-layer inputs)."""
        spans = []
        for i in self._needed(start, end):
            im = self.seq.request.images[i]
            lo, hi = max(start, im.start), min(end, im.start + im.num_tokens)
            spans.append((lo - start, self.features[i][lo - im.start : hi - im.start]))
        return self.vision.inputs(self.prompt[start:end], spans)

    def _prefill(self, start: int, end: int) -> None:
        if end > start:
            # A prompt attended both ways as a whole: its last token is in this pass, as every other token's
            # keys depend on it; its own keys are dropped after, and the pass that samples feeds it again,
            # attending to every key as here, so its keys and logits come out as this pass's.
            stop = len(self.prompt) if self.whole_prompt else end
            inputs = self._inputs(start, stop)
            positions = None if self.positions is None else self.positions[..., start:stop]
            tokens = mx.array(self.prompt[start:stop])[None]
            self.vision.text_model(tokens, cache=self.cache, positions=positions, **inputs)
            if stop > end and trim_prompt_cache(self.cache, stop - end) != stop - end:
                raise RuntimeError("a prompt attended both ways needs a cache that drops its last token")
            mx.eval([c.state for c in self.cache])
            self.done = end
            # Images wholly before the cached part are no longer needed.
            later = set(self._needed(end, len(self.prompt)))
            for i in [i for i in self.features if i not in later]:
                del self.features[i]
            if self.prefix_cache is not None:
                self.prefix_cache.store_from_cache(self.cache, self.prompt, self.done,
                                                   self.seq.extra_keys, hashes=self.seq.block_hashes,
                                                   state=self.done in self.seq.checkpoints)
        if self.finished and self.vision.text_model.mrope:
            self.cache[-1].set(self.delta)
