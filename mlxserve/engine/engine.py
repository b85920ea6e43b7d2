"""AsyncEngine: the bridge between asyncio callers and the one MLX thread.

Callers `submit()` a tokenized request and iterate its outputs. The MLX thread
owns the model, the scheduler and the runner; it receives commands through a
thread-safe queue and hands each step's tokens back to the callers' event
loops in one `call_soon_threadsafe` per step. Detokenizing and stop strings
run on the caller's side, off the MLX thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import gc
import logging
import queue
import sys
import threading
import time
import traceback
from typing import AsyncIterator

from mlxserve.config import EngineConfig, with_backend_defaults
from mlxserve.engine.counters import engine_counters
from mlxserve.engine.detokenize import IncrementalDetokenizer, StopStringMatcher, fast_decode
from mlxserve.engine.guard import Watchdog, kv_budget_for
from mlxserve.engine.pins import PrefixPins
from mlxserve.engine.request import (
    EngineError,
    EngineStalledError,
    FirstTokenPhases,
    PromptTooLongError,
    Request,
    RequestOutput,
    TokenLogprob,
)
from mlxserve.engine.stream import ABORTED, RequestStream, StreamFailure, StreamToken

log = logging.getLogger("mlxserve.engine")


class QueueFullError(RuntimeError):
    """Too many requests are waiting; try again later."""


class EngineDeadError(RuntimeError):
    """The engine loop is not running."""


class AsyncEngine:
    def __init__(self, loaded, config: EngineConfig | None = None):
        self.loaded = loaded
        self.config = with_backend_defaults(config or EngineConfig())
        self.tokenizer = loaded.tokenizer
        self._decode = fast_decode(loaded.tokenizer)  # the streams' detokenizers share it
        self.max_model_len = self.config.max_model_len or loaded.context_length
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self.fatal_error: str | None = None
        self._stopping = False  # the MLX thread is shutting down: take no new work
        self._release_model = False  # set by stop(release_model=True)
        self.prefix_cache = None  # a PrefixCache, made on the MLX thread when enabled
        self.vision_cache = None  # a VisionCache, for vision-language models
        self.speculation = None  # a Speculation (engine/speculative.py) when it is on
        self.num_running = 0
        self.num_waiting = 0
        self.steps = 0  # engine steps that had work
        self.kv_budget = None  # a KVBudget, made on the MLX thread (engine/guard.py)
        self.kv_blocks = None  # the runner's paged KV pool (cache/paged.py) with --kv-layout paged
        self.watchdog = Watchdog(self.config.step_timeout, self._on_stall)
        self.pins = PrefixPins(self)  # pinned prefixes (engine/pins.py)
        self.warmup = None  # a Warmup (engine/warmup.py) while its phases run, made on the MLX thread
        self.warmed = threading.Event()  # set once the warm-up is over (or off)
        self.warmup_status = {"state": "off"}  # its outcome, for /health (Warmup.status())
        self.serving = None  # how the model is served (engine/capabilities.py), known once started

    # ---- lifetime ----
    def start(self, wait_warmup: bool = False) -> "AsyncEngine":
        """Start the MLX thread; `wait_warmup`: return once the warm-up is over too (benchmarks:
        no warm-up phase then runs between their timed requests)."""
        if self._thread is None:
            # The engine thread holds the GIL while it builds the next step's graph
            # (milliseconds of Python); at Python's default 5 ms switch interval the event
            # loop waits that long to send a token that is already out. (Process-wide,
            # and left so: the server runs its engines for its lifetime.)
            sys.setswitchinterval(self.config.switch_interval_ms / 1e3)
            self._thread = threading.Thread(target=self._run, name="mlx-engine", daemon=True)
            self._thread.start()
            self._ready.wait()
            if self.fatal_error:
                raise EngineDeadError(self.fatal_error)
            self.watchdog.start()
        if wait_warmup:
            self.warmed.wait()
        return self

    def stop(self, timeout: float = 10.0, release_model: bool = False) -> None:
        """Stop the MLX thread. `release_model` (unloading one model of several): the thread
        also drops the engine's reference to the model, so that, once its owner has dropped
        its own, the weights are freed on the thread that used them (see `_run`)."""
        if self._thread is not None and self._thread.is_alive():
            self._release_model = release_model
            self._commands.put(("stop", None))
            self._thread.join(timeout)

    @property
    def capacity(self) -> int:
        """Requests in flight at most: running plus queued (more are refused, 429)."""
        return self.config.max_num_seqs + self.config.max_queue

    @property
    def alive(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self.fatal_error
                and not self._stopping)

    def health(self) -> dict:
        """ok, stalled (a step has run past --step-timeout) or dead (the loop is not running)."""
        if not self.alive:
            reason = (self.fatal_error or "the engine is not running").strip().splitlines()
            return {"status": "dead", "reason": reason[0] if reason else "unknown error"}
        wd = self.watchdog
        out = {"status": "stalled" if wd.stalled else "ok", "running": self.num_running,
               "waiting": self.num_waiting, "steps": self.steps, "last_step_s": wd.last_step_s,
               "step_running_s": wd.running_s(), "step_timeout_s": wd.timeout_s or None, "stalls": wd.stalls}
        if self.kv_budget is not None:
            out["kv_budget_bytes"] = self.kv_budget.budget
        warmup = self.warmup  # read once: the MLX thread drops it when done
        out["warmup"] = warmup.status() if warmup is not None else self.warmup_status
        return out

    def _stalled_error(self) -> EngineStalledError:
        return EngineStalledError(f"an engine step has run {self.watchdog.running_s() or 0:.1f} s, past the "
                                  f"{self.watchdog.timeout_s:g} s limit (--step-timeout)")

    def _on_stall(self, running_s: float) -> None:
        """The watchdog's thread: fail every request in flight, whose clients would otherwise wait
        for a step that may never end (the MLX thread drops them when it returns)."""
        error = self._stalled_error()
        log.error("engine stalled: %s; failing the %d requests in flight", error, len(self._streams))
        self._fail_all(str(error), EngineStalledError)

    # ---- caller side (event loop thread) ----
    def check_length(self, num_prompt_tokens: int, max_tokens: int | None) -> int:
        """The request's output budget; raises if it cannot fit the context."""
        room = self.max_model_len - num_prompt_tokens
        if room < (0 if max_tokens == 0 else 1):  # max_tokens 0: a prompt scored, nothing generated
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens, "
                f"and the prompt has {num_prompt_tokens} tokens: no room for output."
            )
        if max_tokens is None:
            return min(self.config.default_max_tokens, room)
        if max_tokens > room:
            if not self.config.strict_max_tokens:  # capped: the answer ends with "length" there
                return room
            raise PromptTooLongError(
                f"This model's maximum context length is {self.max_model_len} tokens. "
                f"However, you requested {num_prompt_tokens + max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {max_tokens} for the output). "
                "Please reduce the prompt or max_tokens."
            )
        return max_tokens

    def submit(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the async stream of its outputs.

        Raises at once (before any compute) for an empty or too long prompt,
        a full queue or a dead engine.
        """
        if not self.alive:
            raise EngineDeadError(self.fatal_error or "engine is not running")
        if not request.prompt_token_ids:
            raise ValueError("prompt: must contain at least one token")
        vocab = self.loaded.vocab_size
        if vocab and any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt: token ids must be in [0, {vocab})")
        # A logit_bias id past the vocabulary writes past the logits (MLX does not check indices:
        # on the CPU the process died); a stop id there never matches. Refused here, for every API
        # and the Python one.
        params = request.params
        for field, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if vocab and any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"{field}: token ids must be in [0, {vocab})")
        needs_image = getattr(self.loaded.vision, "needs_image", None)  # PaliGemma's (models/vlm_prefix.py)
        if needs_image and not request.images:
            raise ValueError(f"prompt: {needs_image}")
        if request.images and request.params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs: not supported for prompts with images")
        max_tokens = self.check_length(len(request.prompt_token_ids), request.params.max_tokens)
        if self.kv_budget is not None:
            # A max_tokens the context capped is no promise either: it gets what fits, as none.
            explicit = request.params.max_tokens is not None and max_tokens == request.params.max_tokens
            max_tokens = self.kv_budget.check(len(request.prompt_token_ids), max_tokens, explicit=explicit)
        if self.watchdog.stalled:
            raise self._stalled_error()
        if len(self._streams) >= self.capacity:
            raise QueueFullError(
                f"{len(self._streams)} requests are in flight and the queue is full; retry later"
            )
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(asyncio.get_running_loop(), request)
        self._streams[request.request_id] = stream
        self._commands.put(("add", (request, max_tokens)))
        return self._outputs(stream)

    def call(self, fn) -> concurrent.futures.Future:
        """Run fn() on the MLX thread between two steps (the cache is not thread-safe)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineDeadError(self.fatal_error or "engine is not running"))
        elif self.watchdog.stalled:  # it would wait for the stalled step
            future.set_exception(self._stalled_error())
        else:
            self._commands.put(("call", (fn, future)))
        return future

    async def on_mlx_thread(self, method: str, *args):
        """Run the engine's `method` (a dotted name: "pins._try") on the MLX thread between two
        steps and return what it returns; by name, so that an engine in another process
        (engine/process.py) can run it there."""
        fn = self.method(method)
        return await asyncio.wrap_future(self.call(lambda: fn(*args)))

    def method(self, name: str):
        """The engine's method of a dotted name ("pins._try"); AttributeError if there is none."""
        return functools.reduce(getattr, name.split("."), self)

    def _cache_stats(self) -> dict:
        from mlxserve.cache.sizes import mlx_memory

        pc, vc = self.prefix_cache, self.vision_cache
        stats = {"prefix_cache": {"enabled": pc is not None, **(pc.stats() if pc else {})}}
        if pc is not None:
            stats["prefix_cache"]["pins"] = [p.describe() for p in self.pins.pins.values()]
            if pc.disk is not None:  # how much of memory a crash now would keep
                stats["prefix_cache"]["disk"]["memory_blocks_on_disk"] = pc.disk.count_present(
                    b.hash for b in pc.pool.blocks())
        if self.loaded.vision is not None:
            stats["vision_cache"] = {"enabled": vc is not None, **(vc.stats() if vc else {})}
        if self.kv_blocks is not None:  # the running batch's paged KV (the solo path's is not in it)
            stats["paged_kv"] = self.kv_blocks.stats()
        # Beside the caches' own byte counts, all MLX holds (weights, running KV, caches), read
        # on the MLX thread between steps: `bench soak` watches it for leaks.
        stats["mlx_memory"] = mlx_memory()
        return stats

    def _reset_cache(self) -> dict:
        if self.prefix_cache is not None:
            self.prefix_cache.reset()
        if self.vision_cache is not None:
            self.vision_cache.clear()
        return self._cache_stats()

    async def cache_stats(self) -> dict:
        """Counters of the prefix cache (and, for a VLM, the vision cache)."""
        return await self.on_mlx_thread("_cache_stats")

    async def reset_cache(self) -> dict:
        """Drop every cached block not in use and every cached image embedding; returns the stats after."""
        return await self.on_mlx_thread("_reset_cache")

    def counters(self) -> dict:
        """The caches' and speculation's counters for /metrics (engine/counters.py)."""
        return engine_counters(self)

    def image_is_cached(self, content_hash: str) -> bool:
        """Whether the vision cache holds this image's embeddings, or dropped them when its KV
        was cached: then its pixel array can wait until the tower needs it, if ever (a
        lock-free peek from any thread: the entry may be evicted soon)."""
        vc = self.vision_cache  # set to None when the engine stops
        return vc is not None and vc.knows(content_hash)

    def pending(self, request_id: str) -> bool:
        """Whether the request's stream has outputs delivered and not yet read: its next one
        comes without waiting (api/sse.py sends such outputs together)."""
        stream = self._streams.get(request_id)
        return stream is not None and bool(stream.items)

    def abort(self, request_id: str) -> None:
        """Free the request's slot at the next step; its stream ends with finish_reason "abort"."""
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            self._commands.put(("abort", request_id))
            try:
                stream.loop.call_soon_threadsafe(stream.put, [ABORTED])
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is iterating

    async def _outputs(self, stream: RequestStream) -> AsyncIterator[RequestOutput]:
        request = stream.request
        params = request.params
        detok = IncrementalDetokenizer(self.tokenizer, self._decode)
        stops = StopStringMatcher(params.stop)
        completion_tokens = 0
        first_token_time = None
        done = False
        try:
            while not done:
                item = await stream.get()
                if isinstance(item, StreamFailure):
                    done = True
                    raise item.error(item.message)
                if item is ABORTED:
                    done = True
                    yield RequestOutput(request.request_id, [], stops.flush() + detok.flush(),
                                        finish_reason="abort",
                                        prompt_tokens=len(request.prompt_token_ids),
                                        completion_tokens=completion_tokens)
                    break
                phases = None
                if first_token_time is None:
                    first_token_time = item.time - request.arrival_time
                    phases = first_token_phases(request.arrival_time, item)
                if item.token is None:  # max_tokens 0: the prompt was scored, nothing generated
                    done = True
                    yield RequestOutput(request.request_id, [], "", finish_reason=item.finish_reason,
                                        prompt_tokens=len(request.prompt_token_ids),
                                        prompt_logprobs=item.prompt_logprobs,
                                        first_token_time=first_token_time)
                    break
                completion_tokens += 1
                finish, stop_reason = item.finish_reason, None
                text = "" if item.is_stop_token else detok.add([item.token])
                if finish:
                    text += detok.flush()
                    stop_reason = item.token if item.is_stop_token else None
                text, stop_string = stops.feed(text)
                if stop_string is not None:
                    finish, stop_reason = "stop", stop_string
                elif finish:
                    text += stops.flush()
                logprobs = None
                if params.logprobs:
                    logprobs = [TokenLogprob(item.token, item.logprob, item.top)]
                yield RequestOutput(
                    request_id=request.request_id,
                    new_token_ids=[item.token],
                    new_text=text,
                    finish_reason=finish,
                    logprobs=logprobs,
                    prompt_tokens=len(request.prompt_token_ids),
                    completion_tokens=completion_tokens,
                    cached_tokens=item.cached_tokens,
                    first_token_time=first_token_time,
                    first_token_phases=phases,
                    stop_reason=stop_reason,
                    prompt_logprobs=item.prompt_logprobs,
                )
                if finish:
                    done = True
                    break
        finally:
            if self._streams.get(request.request_id) is stream:
                if done:
                    self._streams.pop(request.request_id, None)
                    self._commands.put(("abort", request.request_id))  # no-op if it already ended
                else:
                    self.abort(request.request_id)

    # ---- MLX thread ----
    def _setup(self):
        """Build the caches, the runner and the scheduler (on the MLX thread); returns the scheduler."""
        from mlxserve.engine.runner import Runner
        from mlxserve.engine.compiled import wanted as compiled_decode_wanted
        from mlxserve.cache.quantized import check_kv_bits, dequantized_attention
        from mlxserve.engine import caches
        from mlxserve.engine.scheduler import Scheduler
        from mlxserve.engine.speculative import make_speculation
        from mlxserve.engine.warmup import make_warmup
        from mlxserve.models.dense import dense_prefill
        from mlxserve.engine.capabilities import capabilities
        from mlxserve.models.families import prefill_batch_size, unbatchable_layers

        cfg = self.config
        dequantize_kv = dequantized_attention(cfg.kv_attention)
        kv_layout = caches.kv_layout(cfg, self.loaded)
        if cfg.kv_bits:
            check_kv_bits(self.loaded.model, cfg.kv_bits, dequantize=dequantize_kv)
        dense_prefill(self.loaded, cfg.dense_from)
        self.prefix_cache = caches.prefix_cache(cfg, self.loaded, dequantize_kv)
        self.vision_cache = caches.vision_cache(cfg, self.loaded)
        max_num_seqs = cfg.max_num_seqs
        unbatchable = unbatchable_layers(self.loaded.model)
        if unbatchable:
            log.warning("batching off: mlx-lm cannot batch %s layers; requests run one at a time",
                        ", ".join(unbatchable))
            max_num_seqs = 1
        solo_path = cfg.solo_fast_path or bool(unbatchable)
        self.serving = capabilities(self.loaded.model, self.loaded.config, disk=bool(cfg.disk_cache_dir),
                                    images=self.loaded.vision is not None,
                                    cache_off=self.prefix_cache.disabled if self.prefix_cache else
                                    "the server runs with --no-prefix-cache")
        if "vision_config" in self.loaded.config and self.loaded.vision is None:
            log.warning("%s", self.serving["limits"][0])  # text only: images refused
        if not unbatchable and prefill_batch_size(self.loaded.config, 2) == 1:
            log.info("prompts are prefilled one at a time (its recurrent layers would take a batch's padding "
                     "into their state); decoding batches")
        self.speculation = make_speculation(cfg, self.loaded, solo_path=solo_path)
        def make_runner(prefix_cache, chunk, speculation):  # the engine's, and the warm-up's own
            return Runner(self.loaded.model, max_num_seqs=max_num_seqs, prefill_chunk_size=chunk,
                          prefill_batch_size=prefill_batch_size(self.loaded.config, cfg.prefill_batch_size),
                          solo_fast_path=solo_path, prefix_cache=prefix_cache, vision=self.loaded.vision,
                          vision_cache=self.vision_cache, vision_step_s=cfg.vision_step_ms / 1e3,
                          kv_bits=cfg.kv_bits, dequantize_kv=dequantize_kv,
                          kv_layout=kv_layout, block_size=cfg.block_size,
                          keep_image_embeddings=cfg.keep_image_embeddings, speculation=speculation,
                          compile_decode=compiled_decode_wanted(cfg.compile_decode))

        def make_scheduler(runner, kv_budget=None, admission_window_s=0.0):
            return Scheduler(runner, eos_token_ids=self.tokenizer.eos_token_ids, vocab_size=self.loaded.vocab_size,
                             max_num_seqs=max_num_seqs, kv_budget=kv_budget, admission_window_s=admission_window_s)

        self.kv_budget = kv_budget_for(self.loaded.model, cfg, dequantize_kv, self.prefix_cache, self.vision_cache,
                                       per_row=kv_layout == "paged")
        scheduler = make_scheduler(make_runner(self.prefix_cache, cfg.prefill_chunk_size, self.speculation),
                                   self.kv_budget, cfg.admission_window_ms / 1e3)
        self.kv_blocks = scheduler.runner.kv_blocks
        if cfg.warmup > 0:
            self.warmup = make_warmup(cfg, self.loaded, self.prefix_cache, max_num_seqs, self.max_model_len,
                                      lambda cache, chunk: make_scheduler(make_runner(cache, chunk, None)))
        return scheduler

    def _run(self) -> None:
        scheduler_ran = False
        try:
            try:
                scheduler = self._setup()
            except Exception as e:  # noqa: BLE001 - reported to start()
                self.fatal_error = f"engine failed to start: {e!r}"
                return
            finally:
                if self.warmup is None:
                    self.warmed.set()
                self._ready.set()
            scheduler_ran = True
            self._loop(scheduler)
        except Exception:  # noqa: BLE001 - a bug in the loop itself
            self.fatal_error = "engine loop crashed:\n" + traceback.format_exc()
            log.error(self.fatal_error)
            self._fail_all("engine loop crashed")
        finally:
            self._stopping = True
            self.warmup = None  # a warm-up cut short by stop(): its private runner goes with the rest
            self.warmed.set()
            self.watchdog.stop()
            # Free this engine's MLX arrays here, in the thread that owns MLX, and wait
            # for its GPU work: left to the garbage collector, they would be freed from
            # whichever thread collects them, maybe while another engine's thread (tests,
            # benchmarks) records a CUDA graph, which MLX-CUDA then aborts on.
            if self.prefix_cache is not None and self.prefix_cache.disk is not None:
                try:
                    self.prefix_cache.disk.close()  # what is queued gets written
                except Exception:  # noqa: BLE001 - the rest of the cleanup must run
                    log.exception("closing the disk tier")
            self.pins.pins.clear()  # their blocks' arrays go with the cache, here
            scheduler = self.prefix_cache = self.vision_cache = self.kv_blocks = None
            if self._release_model:
                self.loaded = None
            gc.collect()
            if scheduler_ran:  # a failed start queued no GPU work; synchronizing anyway made the
                _finish_gpu_work()  # process abort at exit in MLX's teardown (ml-explore/mlx#3126)
            _release_streams()
            # Nobody will run what is still queued: don't leave callers waiting.
            while True:
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                if kind == "call" and arg[1].set_running_or_notify_cancel():  # else nobody waits
                    arg[1].set_exception(EngineDeadError("engine stopped"))
                elif kind == "add":
                    self._publish({arg[0].request_id: [StreamFailure("engine stopped")]})

    def _loop(self, scheduler) -> None:
        while True:
            outbox: dict[str, list] = {}
            block = not scheduler.has_work()
            commands = []
            idle_wait = 0.5
            disk = self.prefix_cache.disk if self.prefix_cache is not None else None
            if block and disk is not None and disk.has_waiting:
                # Idle: copy a stored block for the disk tier's writer, or, when its queue is
                # full, look again soon (not at once: a spinning loop would hold the GIL).
                if disk.copy_pending():
                    block = False
                else:
                    idle_wait = 0.02
            if block and self.warmup is not None and self._commands.empty():
                self._warm_up()  # one phase while idle: a request that arrives waits for it at most
                continue
            if block and self.kv_blocks is not None:
                self.kv_blocks.shrink()  # idle: give back the paged pool's memory a burst grew
            if block:  # idle: sleep until a command arrives (wake now and then)
                try:
                    commands.append(self._commands.get(timeout=idle_wait))
                except queue.Empty:
                    pass
            while True:
                try:
                    commands.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            commands = self._agree(commands)
            for kind, arg in commands:
                if kind == "stop":
                    self._fail_all("engine stopped")
                    return
                if kind == "abort":
                    scheduler.abort(arg)
                elif kind == "call":
                    fn, future = arg
                    if not future.set_running_or_notify_cancel():
                        continue  # its caller gave up: setting a cancelled future's result raises
                    try:
                        future.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        future.set_exception(e)
                elif kind == "add":
                    request, max_tokens = arg
                    try:
                        scheduler.add(request, max_tokens)
                    except Exception as e:  # noqa: BLE001 - fail this request only
                        outbox.setdefault(request.request_id, []).append(StreamFailure(f"{e}"))
            events = []
            if scheduler.has_work():
                self.watchdog.begin()
                try:
                    events = scheduler.step()
                except Exception as e:  # noqa: BLE001 - fail the batch, keep serving
                    log.exception("engine step failed")
                    for seq in scheduler.runner.reset():
                        outbox.setdefault(seq.request_id, []).append(
                            StreamFailure(f"engine step failed: {e!r}"))
                finally:
                    self.watchdog.end()
                self.steps += 1
                if disk is not None and disk.has_waiting:  # busy for long: write as it goes
                    disk.copy_after_step()
                for seq, message in scheduler.runner.failed:
                    outbox.setdefault(seq.request_id, []).append(StreamFailure(message))
                scheduler.runner.failed.clear()
            now = time.perf_counter()
            for ev in events:
                outbox.setdefault(ev.seq.request_id, []).append(
                    StreamToken(ev.token, ev.finish_reason,
                                ev.finish_reason == "stop" and ev.token in ev.seq.stop_ids,
                                ev.logprob, ev.top, ev.seq.cached_tokens, now, ev.prompt_logprobs, ev.phases)
                )
            self.num_running = scheduler.num_running
            self.num_waiting = len(scheduler.waiting)
            if outbox:
                self._publish(outbox)

    def _agree(self, commands: list) -> list:
        """The commands this step applies: these. (A distributed engine's rank 0 sends them to
        the other ranks, which apply rank 0's instead: engine/distributed.py.)"""
        return commands

    def _warm_up(self) -> None:
        self.warmup.run_next()
        if not self.warmup.pending:
            self.warmup_status = self.warmup.status()
            self.warmup = None
            self.warmed.set()

    def _publish(self, outbox: dict[str, list]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, items in outbox.items():
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop.setdefault(stream.loop, []).append((stream, items))
        for loop, deliveries in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, deliveries)
            except RuntimeError:
                pass  # that caller's loop is closed; its requests are gone

    def _fail_all(self, message: str, error: type = EngineError) -> None:
        self._publish({rid: [StreamFailure(message, error)] for rid in list(self._streams)})


def first_token_phases(arrival: float, item: StreamToken) -> FirstTokenPhases | None:
    """Where a request's time to first token went, from its first token's stream item."""
    if item.phases is None or item.phases[0] is None:
        return None
    admitted, prefill_done = item.phases
    if prefill_done is None:  # no pass was seen ending its prompt: its prefill ran up to this token
        prefill_done = item.time
    return FirstTokenPhases(queue=admitted - arrival, prefill=prefill_done - admitted,
                            first_step=item.time - prefill_done)


def _finish_gpu_work() -> None:
    """Wait for the GPU work this thread queued (a pipelined decode step nobody reads)."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream

    try:
        mx.synchronize(generation_stream)
        mx.synchronize()
    except Exception:  # noqa: BLE001 - the thread is ending anyway
        log.exception("waiting for GPU work at engine stop")


def _release_streams() -> None:
    """Destroy the MLX streams this thread made. MLX keeps streams per thread and leaves their
    teardown to each thread (ml-explore/mlx#4327): left to the interpreter's exit, it aborts
    the process ("terminate called without an active exception", exit code 134)."""
    import mlx.core as mx

    try:
        mx.clear_streams()
    except Exception:  # noqa: BLE001 - the thread is ending anyway
        log.exception("releasing the engine thread's MLX streams")


def _deliver(deliveries) -> None:
    for stream, items in deliveries:
        stream.put(items)
