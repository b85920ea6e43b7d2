"""Run a long MLX computation (a vision tower) a few layers per engine step.

A tower's forward pass is a loop over its blocks inside the library's code,
so it cannot simply be cut into steps from outside. `Stepwise` runs it in a
helper thread that pauses at block boundaries: the engine thread calls
`step()`, the helper runs blocks (evaluating each) until its time budget is
spent, then hands control back. Exactly one of the two threads runs at any
moment (two semaphores pass a baton), so MLX is never used concurrently;
the engine decodes the other requests between the pauses.

Blocks become pause points with `make_pausable(blocks)`, which swaps each
block's class for a subclass whose `__call__` ends at a checkpoint. The
parameters are untouched, and outside a `Stepwise` run the checkpoint does
nothing.
"""

from __future__ import annotations

import queue
import threading
import time

import mlx.core as mx

_active = threading.local()  # the Stepwise running on this (helper) thread, if any
_subclasses: dict[type, type] = {}
_jobs: queue.Queue = queue.Queue()
_worker: threading.Thread | None = None
_worker_lock = threading.Lock()


def _serve_jobs() -> None:
    # One long-lived helper thread for every run: a new thread per image would
    # pay the backend's per-thread setup each time.
    while True:
        _jobs.get()._run()


def _submit(job: "Stepwise") -> None:
    global _worker
    with _worker_lock:
        if _worker is None:
            _worker = threading.Thread(target=_serve_jobs, name="mlxserve-stepwise", daemon=True)
            _worker.start()
    _jobs.put(job)


class Cancelled(BaseException):
    """Raised inside the helper thread when its Stepwise is closed mid-run."""


def _checkpoint(out):
    stepwise = getattr(_active, "stepwise", None)
    if stepwise is not None:
        mx.eval(out)
        stepwise._maybe_pause()
    return out


def make_pausable(blocks) -> None:
    for block in blocks:
        cls = type(block)
        if cls in _subclasses.values():
            continue
        sub = _subclasses.get(cls)
        if sub is None:
            def __call__(self, *args, _base=cls, **kwargs):
                return _checkpoint(_base.__call__(self, *args, **kwargs))

            sub = type(cls.__name__, (cls,), {"__call__": __call__})
            _subclasses[cls] = sub
        block.__class__ = sub


class Stepwise:
    def __init__(self, fn, budget_s: float):
        self.fn = fn
        self.budget_s = budget_s
        self.done = False
        self.result = None
        self.error: BaseException | None = None
        self.steps = 0
        self._started = False
        self._go = threading.Semaphore(0)
        self._back = threading.Semaphore(0)
        self._cancelled = False
        self._slice_start = 0.0

    def step(self) -> bool:
        """Run until the budget is spent or fn returns; True once it has returned. Re-raises fn's error."""
        if self.done:
            return True
        self.steps += 1
        self._slice_start = time.perf_counter()
        if not self._started:
            self._started = True
            _submit(self)
        else:
            self._go.release()
        self._back.acquire()
        if self.error is not None:
            raise self.error
        return self.done

    def close(self) -> None:
        """Abandon a paused run: the helper unwinds it and is free for the next."""
        if self._started and not self.done:
            self._cancelled = True
            self._go.release()
            self._back.acquire()  # wait until it has unwound

    def _run(self) -> None:
        _active.stepwise = self
        try:
            result = self.fn()
            mx.eval(result)
            self.result = result
        except Cancelled:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the engine thread
            self.error = e
        finally:
            _active.stepwise = None
            self.done = True
            self._back.release()

    def _maybe_pause(self) -> None:
        if time.perf_counter() - self._slice_start < self.budget_s:
            return
        self._back.release()
        self._go.acquire()
        if self._cancelled:
            raise Cancelled
        self._slice_start = time.perf_counter()
