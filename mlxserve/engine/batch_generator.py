"""mlx-lm's `BatchGenerator`, with a batched request's first token two steps sooner.

mlx-lm keeps a prompt's last token as the row's first decode input. Its `_next`
(one engine step) decodes the running batch, then moves the rows whose prompt
has only that last token left into the running batch (a pass over that token,
which samples the first output token), then prefills the other rows' next chunk.
A row whose last chunk is prefilled in call k waits for call k+1 to be moved,
and its first token comes out of call k+2's decode: two more steps, each also
decoding the whole running batch and prefilling other prompts, before its first
token leaves the engine.

Here a step prefills first, moves the rows that pass just ended (their last-token
pass and merge), and decodes last, running batch and new rows together: a row's
first token comes out of the step that prefilled its prompt's last chunk. On the
device the passes come in the same order as mlx-lm's, step after step (decode,
prefill and merge, decode, ...): a step just ends after a decode instead of after
a prefill, so its tokens are not held back by the prefill pass after it, and the
scheduler admits requests between a decode and a prefill. Each row gets the same
passes in the same order (its prefill chunks, its last token, then decode steps):
the same tokens.

A row that leaves the prompt batch in the step its prefill ends is gone from it
when `next()` returns, so what reads the prompt batch after a prefill pass (the
runner notes which prompts are prefilled, and stores each chunk's completed
blocks in the prefix cache) is called from inside the step, between the prefill
pass and the move: `on_prefill`.
"""

from __future__ import annotations

import importlib
import time
from typing import Callable

import mlx.core as mx

# The module, not the function of the same name that mlx_lm's package exports over it.
_generate = importlib.import_module("mlx_lm.generate")
PromptProcessingBatch = _generate.PromptProcessingBatch

# sha256 of `inspect.getsource(mlx_lm.generate.BatchGenerator._next)` in mlx-lm 0.32.2, the code
# `_next` below copies. tests/test_engine.py fails when it changes: an mlx-lm upgrade
# must be read against this copy before the pin moves.
MLX_LM_NEXT_SHA256 = "eb3a4e361dc2c19eafd28e901155828fd4602d63e26c431ca9ffbf079302c665"


class BatchGenerator(_generate.BatchGenerator):
    """mlx-lm's, whose step prefills, moves the rows that prefill pass ended to decoding, then
    decodes (their first token included).

    on_prefill(prompt_batch, prompt_responses): called in a step with prompt work, after its
    prefill pass and before the rows it ended leave the prompt batch; the responses are those
    `next()` will return so far.
    """

    def __init__(self, model, *, on_prefill: Callable[[PromptProcessingBatch, list], None] | None = None,
                 **kwargs):
        super().__init__(model, **kwargs)
        self.on_prefill = on_prefill

    def _start_generation(self, prompt_responses: list) -> None:
        """mlx-lm's split, unchanged: the rows whose prompt has only its last token left leave the
        prompt batch; a pass over that token samples their first token (asynchronously) and they
        join the generation batch, whose next decode emits it."""
        keep = []
        split = []
        for i, seq in enumerate(self._currently_processing):
            segments = seq[0]
            if len(segments) == 1 and len(segments[0]) == 1:
                split.append(i)
            else:
                keep.append(i)
        if not split:
            return
        last_inputs = [self._currently_processing[i][0][0] for i in split]
        progress = [(self._currently_processing[i][2],) * 2 for i in split]
        self._currently_processing = [self._currently_processing[i] for i in keep]
        gen_batch = self._prompt_batch.split(split).generate(last_inputs)
        for i, p in enumerate(progress):
            prompt_responses.append(PromptProcessingBatch.Response(gen_batch.uids[i], p, True, True))
        self._generation_batch.extend(gen_batch)

    def _next(self):
        # mlx-lm 0.32.2's `BatchGenerator._next` (pinned by MLX_LM_NEXT_SHA256), but for:
        # - the decode of the running batch comes last, not first (the order of the passes on the
        #   device is the same, step after step: decode, prefill, decode...; a step just ends after
        #   a decode), so it also decodes the rows the prefill pass just ended;
        # - mlx-lm's early exit with a full running batch skips the prefill work, not the decode;
        # - the split into generation is a method (`_start_generation`, its code unchanged), called
        #   where mlx-lm calls it (now only for rows admitted with a one-token prompt, such as a
        #   solo sequence handed over at a token boundary: they have nothing to prefill) and
        #   again after the prefill pass, for the rows whose prefill that pass ended;
        # - `on_prefill` runs between the prefill pass and that second split.
        generation_responses = []
        prompt_responses = []

        # Prefill only while the running batch has room (mlx-lm: "Exit early because we already
        # have our hands full with decoding")
        if len(self._generation_batch) < self.completion_batch_size:
            # Check if we have sequences and add them to the prompt batch
            n = min(
                self.prefill_batch_size - len(self._prompt_batch),
                self.completion_batch_size - len(self._generation_batch),
                len(self._unprocessed_sequences),
            )
            if n > 0:
                self._prompt_batch.extend(self._make_batch(n))

            self._start_generation(prompt_responses)

            # Extract the next prompts input
            prompts = []
            for i, seq in enumerate(self._currently_processing):
                response = PromptProcessingBatch.Response(self._prompt_batch.uids[i], 0, False, False)
                segments = seq[0]
                n = min(len(segments[0]), self.prefill_step_size)
                prompts.append(segments[0][:n])
                segments[0] = segments[0][n:]
                if len(segments[0]) == 0:
                    segments.pop(0)
                    response.end_of_segment = True
                seq[1] += len(prompts[-1])
                response.progress = (seq[1], seq[2])
                prompt_responses.append(response)

            # Process the prompts
            self._counters.prompt_tokens += sum(len(p) for p in prompts)
            tic = time.perf_counter()
            self._prompt_batch.prompt(prompts)
            self._counters.prompt_time += time.perf_counter() - tic

            if prompt_responses and self.on_prefill is not None:
                self.on_prefill(self._prompt_batch, prompt_responses)
            if prompts:
                self._start_generation(prompt_responses)

        # Generate tokens (mlx-lm: first)
        if len(self._generation_batch) > 0:
            tic = time.perf_counter()
            generation_responses = self._generation_batch.next()
            self._counters.decode_time += time.perf_counter() - tic
            self._counters.generation_tokens += len(generation_responses)
            self._counters.generation_steps += 1
            if self._counters.generation_steps % 512 == 0:
                mx.clear_cache()

        return prompt_responses, generation_responses
