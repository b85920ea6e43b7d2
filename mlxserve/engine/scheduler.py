"""Admission and aborts: which requests run, which wait.

Runs on the MLX thread. Requests wait in arrival order until the runner has a
free slot (`max_num_seqs`) and, with a `KVBudget`, until their KV cache fits beside
the running ones' (engine/guard.py); an aborted request leaves wherever it is at
the next step.
"""

from __future__ import annotations

import time
from collections import deque

from mlxserve.engine.request import Request
from mlxserve.engine.runner import Runner, Sequence, TokenEvent
from mlxserve.engine.sampling import make_processors, make_sampler, make_stop_sequences, stop_token_ids


class Scheduler:
    def __init__(self, runner: Runner, *, eos_token_ids, vocab_size: int, max_num_seqs: int, kv_budget=None,
                 admission_window_s: float = 0.0):
        self.runner = runner
        self.admission_window_s = admission_window_s  # --admission-window-ms
        self.kv_budget = kv_budget
        self.eos_token_ids = set(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        # What the admission window measures time with: a distributed engine's ranks all read
        # rank 0's clock of the step (engine/distributed.py), so they admit at the same step.
        self.clock = time.perf_counter

    def has_work(self) -> bool:
        return bool(self.waiting) or len(self.runner) > 0

    @property
    def num_running(self) -> int:
        return len(self.runner)

    def add(self, request: Request, max_tokens: int) -> None:
        """Queue a request. Raises if its sampling settings can't be built."""
        params = request.params
        stop_ids = stop_token_ids(params, self.eos_token_ids)
        self.waiting.append(
            Sequence(
                request=request,
                max_tokens=max_tokens,
                sampler=make_sampler(params, self.vocab_size),
                processors=make_processors(params, self.vocab_size, self.eos_token_ids),
                stop_ids=stop_ids,
                stop_sequences=make_stop_sequences(stop_ids),
                queued_at=self.clock(),
            )
        )

    def abort(self, request_id: str) -> bool:
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                return True
        for seq in self.runner.sequences:
            if seq.request_id == request_id:
                self.runner.remove(seq)
                return True
        return False

    def _fits(self, seq: Sequence) -> bool:
        if self.kv_budget is None:
            return True
        running = [_length(s) for s in self.runner.sequences]
        return self.kv_budget.admits(running, _length(seq))

    def _admit_now(self) -> bool:
        """Whether the waiting requests join now. While others decode, arrivals are gathered for up
        to the admission window: each admission costs a prefill pass and a merge of the running
        batch's caches, the same for one request as for a prefill batch of them."""
        if not self.admission_window_s or not self.waiting or len(self.runner) == 0:
            return True
        room = self.max_num_seqs - len(self.runner)
        if len(self.waiting) >= min(room, self.runner.prefill_batch_size):
            return True
        return self.clock() - self.waiting[0].queued_at >= self.admission_window_s

    def step(self) -> list[TokenEvent]:
        events = []
        # In arrival order: a long request waiting for memory is not overtaken (and starved).
        if self._admit_now():
            while self.waiting and len(self.runner) < self.max_num_seqs and self._fits(self.waiting[0]):
                seq = self.waiting.popleft()
                seq.admitted_at = time.perf_counter()  # its queueing ends (this host's clock, as arrival's)
                events += self.runner.add(seq)
        return events + self.runner.step()


def _length(seq: Sequence) -> int:
    """The most tokens the sequence's cache will hold."""
    return len(seq.request.prompt_token_ids) + seq.max_tokens
