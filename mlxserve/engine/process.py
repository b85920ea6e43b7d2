"""The engine in a process of its own (`--engine-process`), as vLLM's v1 splits its server.

The server's process keeps all of a request but the MLX work: HTTP, chat rendering,
detokenizing, stop strings, SSE. A child process loads the model and runs the engine's
MLX thread (`AsyncEngine`, unchanged). So the server's Python, per token (detokenizing,
JSON, socket writes), never waits for the GIL that the engine's step building holds, nor
the engine for the server's.

They talk over one pipe in pickled messages:
- parent -> child: ("add", request, max_tokens), ("abort", request_id), ("call", id, method,
  args): an engine method run on the MLX thread between two steps (cache stats, pins),
  ("peek", id, method, args): one answered at once by the child's receiving thread, also
  while a step runs (health, counters), and ("stop",).
- child -> parent: ("ready", meta) or ("failed", error), once; ("out", outbox, running,
  waiting, steps): one step's tokens for all its requests, one message a step;
  ("reply", id, ok, value); ("warmed", status).
The parent's `ProcessEngine` is an `AsyncEngine` whose MLX half is the child: `submit`,
the output streams and `abort` are the same code, fed by a thread reading the pipe.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import sys
import threading
from dataclasses import replace

from mlxserve.engine.engine import AsyncEngine, EngineDeadError
from mlxserve.engine.request import EngineError, EngineStalledError
from mlxserve.engine.stream import StreamFailure, StreamToken

log = logging.getLogger("mlxserve.engine")

PEEK_TIMEOUT_S = 2.0  # a child that does not answer a peek this fast is reported stalled
STOP_TIMEOUT_S = 30.0  # then it is killed


class ProcessEngine(AsyncEngine):
    """The server's side of an engine process: requests in, each step's tokens out."""

    @classmethod
    def launch(cls, model_cfg, engine_cfg) -> "ProcessEngine":
        """Start the child and wait until it has loaded the model and its engine runs (its
        warm-up may still be going). Raises what loading raises (ModelLoadError, ValueError)
        or EngineDeadError."""
        ctx = multiprocessing.get_context("spawn")  # not fork: MLX and threads live here
        conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=child_main, name="mlxserve-engine", daemon=True,
                              args=(child_conn, model_cfg, engine_cfg, logging.getLogger().level))
        process.start()
        child_conn.close()
        try:
            while not conn.poll(0.5):
                if exited(process):
                    raise EngineDeadError(f"the engine process exited while starting{exit_code(process)}")
            kind, payload = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            exited(process, 5)
            raise EngineDeadError(f"the engine process exited while starting{exit_code(process)}") from None
        if kind == "failed":
            exited(process, 10)
            raise payload
        try:
            loaded = _parent_loaded(payload)
        except BaseException:  # the child would hold the model's memory with nobody to stop it
            try:
                conn.send_bytes(pickle.dumps(("stop",)))
            except OSError:
                pass
            stop_child(process, STOP_TIMEOUT_S)
            process.join(1)  # reaped, where no event loop has reaped it already
            raise
        return cls(loaded, engine_cfg, process, conn, payload)

    def __init__(self, loaded, config, process, conn, meta: dict):
        super().__init__(loaded, config)
        self.max_model_len = meta["max_model_len"]
        self.kv_budget = meta["kv_budget"]  # admission is checked here, as in-process
        self.serving = meta["serving"]
        self._process = process
        self._conn = conn
        self._send_lock = threading.Lock()
        self._commands = _Commands(self)  # what submit() and abort() put goes to the child
        self._replies: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._read, name="engine-process-reader", daemon=True)
        self._thread.start()

    # ---- lifetime ----
    def start(self, wait_warmup: bool = False) -> "ProcessEngine":
        # The reading thread hands each step's tokens to the event loop: like the MLX thread
        # in-process, it should not wait Python's default 5 ms for the GIL.
        sys.setswitchinterval(self.config.switch_interval_ms / 1e3)
        if wait_warmup:
            self.warmed.wait()
        return self

    def stop(self, timeout: float = STOP_TIMEOUT_S, release_model: bool = False) -> None:
        """Stop the child (its memory goes with it); its requests end with "engine stopped"."""
        if self._stopping and exited(self._process):
            return
        self._stopping = True
        try:
            self._send(("stop",))
        except EngineDeadError:
            pass
        stop_child(self._process, timeout)
        self._thread.join(5)

    @property
    def alive(self) -> bool:
        return not self._stopping and self.fatal_error is None and not exited(self._process)

    def health(self) -> dict:
        if not self.alive:
            return super().health()  # "dead", with the reason
        try:
            return self._request("peek", "health").result(PEEK_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return {"status": "stalled", "reason": f"the engine process did not answer within {PEEK_TIMEOUT_S:g} s"}
        except EngineDeadError as e:
            return {"status": "dead", "reason": str(e)}

    def counters(self) -> dict:
        if not self.alive:
            return {}
        try:
            return self._request("peek", "counters").result(PEEK_TIMEOUT_S)
        except (concurrent.futures.TimeoutError, EngineDeadError):
            return {}

    async def on_mlx_thread(self, method: str, *args):
        return await asyncio.wrap_future(self._request("call", method, *args))

    def call(self, fn):
        raise TypeError("an engine process runs engine methods by name: use on_mlx_thread()")

    def image_is_cached(self, content_hash: str) -> bool:
        """The child's vision cache, asked over the pipe (from the API's image-preparing thread).
        An image said cached goes without its pixel array but with its decoded image, from which
        the child makes the array if the entry is evicted meanwhile, as in-process."""
        if self.loaded.vision is None or not self.alive:
            return False
        try:
            return bool(self._request("peek", "image_is_cached", content_hash).result(PEEK_TIMEOUT_S))
        except (concurrent.futures.TimeoutError, EngineDeadError):
            return False

    # ---- the pipe ----
    def _send(self, message) -> None:
        data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
        try:
            with self._send_lock:
                self._conn.send_bytes(data)
        except (OSError, ValueError):  # a closed pipe: the child is gone
            raise EngineDeadError(self.fatal_error or "the engine process is not running") from None

    def _request(self, kind: str, method: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not self.alive:
            future.set_exception(EngineDeadError(self.fatal_error or "the engine process is not running"))
            return future
        call_id = next(self._ids)
        self._replies[call_id] = future
        try:
            self._send((kind, call_id, method, args))
        except EngineDeadError as e:
            self._replies.pop(call_id, None)
            future.set_exception(e)
        return future

    def _read(self) -> None:
        """(its own thread) Hand the child's messages on until the pipe closes."""
        try:
            while True:
                message = pickle.loads(self._conn.recv_bytes())
                kind = message[0]
                if kind == "out":
                    _, outbox, self.num_running, self.num_waiting, self.steps = message
                    self._publish({request_id: [StreamToken(*item) if type(item) is tuple else item for item in items]
                                   for request_id, items in outbox.items()})
                elif kind == "reply":
                    _, call_id, ok, value = message
                    future = self._replies.pop(call_id, None)
                    if future is not None and future.set_running_or_notify_cancel():
                        future.set_result(value) if ok else future.set_exception(value)
                elif kind == "warmed":
                    self.warmup_status = message[1]
                    self.warmed.set()
        except (EOFError, OSError):
            pass
        except Exception:  # noqa: BLE001 - a bug here must not leave callers waiting
            log.exception("reading the engine process's messages")
        exited(self._process, 1)
        if not self._stopping:
            self.fatal_error = f"the engine process exited{exit_code(self._process)}"
            log.error("%s", self.fatal_error)
        self.warmed.set()
        for future in list(self._replies.values()):
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(self.fatal_error or "engine stopped"))
        self._replies.clear()
        self._fail_all(self.fatal_error or "engine stopped")
        self._conn.close()


class _Commands:
    """Stands for the MLX thread's command queue on the parent's side: sends to the child."""

    def __init__(self, engine: ProcessEngine):
        self.engine = engine

    def put(self, command) -> None:
        kind, arg = command
        if kind == "add":
            request, max_tokens = arg
            if request.params.grammar is not None:  # the child makes its own matcher from grammar_text
                request = replace(request, params=replace(request.params, grammar=None))
            try:
                self.engine._send(("add", request, max_tokens))
            except EngineDeadError:
                self.engine._streams.pop(request.request_id, None)
                raise
        elif kind == "abort":
            try:
                self.engine._send(("abort", arg))
            except EngineDeadError:
                pass  # its stream ends through the reader's _fail_all
        else:
            raise ValueError(f"an engine process takes no {kind!r} command")


def stop_child(process, timeout: float) -> None:
    """Wait up to `timeout` s for a child told to stop; then kill it, its threads' stacks printed first."""
    if exited(process, timeout):
        return
    log.warning("the engine process did not stop within %.0f s: killing it (its threads' stacks follow)", timeout)
    try:
        if hasattr(signal, "SIGUSR1"):  # faulthandler in the child prints them
            os.kill(process.pid, signal.SIGUSR1)
            exited(process, 1)
        process.kill()
    except ProcessLookupError:
        pass
    exited(process, 5)


def exited(process, timeout: float = 0) -> bool:
    """Whether the child has exited, waiting up to `timeout` s. Read from its sentinel (a pipe the
    exit closes), not from waitpid as `Process.is_alive()` does: an event loop that reaps child
    processes (uvloop's) would leave that saying "alive" forever."""
    return bool(multiprocessing.connection.wait([process.sentinel], timeout))


def exit_code(process) -> str:
    """The text " (exit code N)" when this process reaped the child, else nothing."""
    code = process.exitcode if exited(process) else None
    return "" if code is None else f" (exit code {code})"


def _parent_loaded(meta: dict):
    """The parent's LoadedModel: everything but the weights (the tokenizer read from the same folder).
    For a vision-language model, its family's adapter over a model object whose weights are never
    loaded nor evaluated (MLX makes parameters lazily): the parent only renders prompts and
    preprocesses images with it, off the MLX thread, which is the child's."""
    from mlx_lm.utils import load_tokenizer

    from mlxserve.models.load import LoadedModel
    from mlxserve.models.vlm import build_vlm

    tokenizer = load_tokenizer(meta["tokenizer_dir"], eos_token_ids=meta["eos_token_ids"])
    vision = meta["processor_config"] is not None
    loaded = LoadedModel(model=build_vlm(meta["config"]) if vision else None, tokenizer=tokenizer,
                         fingerprint=meta["fingerprint"], name=meta["name"], context_length=meta["context_length"],
                         config=meta["config"], source=meta["source"], tokenizer_dir=meta["tokenizer_dir"],
                         remote_weights_nbytes=meta["weights_nbytes"])
    if vision:
        loaded.with_vision(meta["processor_config"]).model = None  # the text half is the child's
    return loaded


# ---- the child ----

class _ChildEngine(AsyncEngine):
    """The engine in the child: each step's outbox goes down the pipe instead of to event loops."""

    def __init__(self, loaded, config, send):
        super().__init__(loaded, config)
        self._send = send
        self._llg = None  # llguidance's tokenizer, built on the first grammar

    def add(self, request, max_tokens: int) -> None:
        """(receiving thread)"""
        if request.params.grammar_text is not None:
            request.params.grammar = self._matcher(request.params.grammar_text)
        if self.watchdog.stalled:
            self._publish({request.request_id: [StreamFailure(str(self._stalled_error()), EngineStalledError)]})
            return
        self._streams[request.request_id] = None  # what _fail_all fails; values unused here
        self._commands.put(("add", (request, max_tokens)))

    def drop(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))

    def _matcher(self, grammar: str):
        from llguidance import LLMatcher

        from mlxserve.engine.grammar import llg_tokenizer

        if self._llg is None:
            self._llg = llg_tokenizer(self.tokenizer, self.loaded.vocab_size)
        return LLMatcher(self._llg, grammar, log_level=0)

    def _publish(self, outbox: dict[str, list]) -> None:
        """(MLX thread; the watchdog's on a stall) Queued for the sending thread: pickling and
        writing then overlap the MLX thread's next step (its waits on the device free the GIL)."""
        for request_id, items in outbox.items():
            last = items[-1]
            if isinstance(last, StreamFailure) or last.finish_reason is not None:
                self._streams.pop(request_id, None)
        self._send(("out", outbox, self.num_running, self.num_waiting, self.steps))


class _Sender:
    """The child's one writer to the pipe: a thread that pickles and sends what is queued, in
    order. Step outputs go as tuples (a dataclass pickles several times slower)."""

    def __init__(self, conn):
        self.conn = conn
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="engine-sender", daemon=True)
        self.thread.start()

    def put(self, message) -> None:
        self.queue.put(message)

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join(10)

    def _run(self) -> None:
        broken = False
        while (message := self.queue.get()) is not None:
            if broken:
                continue  # the parent is gone; the receiving thread sees the pipe close and stops
            if message[0] == "out":
                outbox = {request_id: [_as_tuple(item) for item in items] for request_id, items in message[1].items()}
                message = ("out", outbox, *message[2:])
            try:
                data = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - what does not pickle fails its caller, never leaves it waiting
                data = pickle.dumps(_unpicklable(message, e))
            try:
                self.conn.send_bytes(data)
            except OSError:
                broken = True


def _unpicklable(message, e: Exception):
    """What goes instead of a message that does not pickle: the reply, or each request of a step's
    outputs, fails with the error (the parent would otherwise wait for them for ever)."""
    error = EngineError(f"{e}")
    if message[0] == "reply":
        return ("reply", message[1], False, error)
    if message[0] == "out":
        return ("out", {request_id: [StreamFailure(f"{e}")] for request_id in message[1]}, *message[2:])
    return ("failed", error)


def _as_tuple(item):
    if isinstance(item, StreamToken):
        return (item.token, item.finish_reason, item.is_stop_token, item.logprob, item.top, item.cached_tokens,
                item.time, item.prompt_logprobs, item.phases)
    return item


def child_main(conn, model_cfg, engine_cfg, log_level: int) -> None:
    """The engine process: load the model, run the engine, serve the parent's messages."""
    code = 1
    try:
        _serve_parent(conn, model_cfg, engine_cfg, log_level)
        code = 0
    finally:
        # Leave without the interpreter's teardown (spawn's child would sys.exit): MLX arrays
        # freed at exit abort the process (ml-explore/mlx#3126); the engine's thread has
        # already freed what it held and waited for its GPU work.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _serve_parent(conn, model_cfg, engine_cfg, log_level: int) -> None:
    from mlxserve.engine.pool import weights_nbytes
    from mlxserve.models.files import ModelLoadError
    from mlxserve.models.load import load_configured

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s")
    if hasattr(signal, "SIGUSR1"):  # the parent asks for the threads' stacks before it kills a stuck child
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl+C (and `timeout`, a shell's kill) signal the whole process group: the server drains its
    # requests and then stops this process; left to die here, they would fail at once. A server
    # gone for good closes the pipe, and that ends this process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    sender = _Sender(conn)
    send = sender.put

    try:
        loaded = load_configured(model_cfg)
        if loaded.tokenizer_dir is None:
            raise ModelLoadError(f"{loaded.name}: its tokenizer's folder is not known, so the server's "
                                 "process cannot read it; serve it without --engine-process")
        engine = _ChildEngine(loaded, engine_cfg, send).start()
    except Exception as e:  # noqa: BLE001 - handed to the parent, which reports it
        send(("failed", _picklable(e)))
        sender.close()
        return
    send(("ready", {"tokenizer_dir": str(loaded.tokenizer_dir), "eos_token_ids": sorted(loaded.tokenizer.eos_token_ids),
                    "fingerprint": loaded.fingerprint, "name": loaded.name, "context_length": loaded.context_length,
                    "config": loaded.config, "source": loaded.source, "weights_nbytes": weights_nbytes(loaded),
                    "max_model_len": engine.max_model_len, "kv_budget": engine.kv_budget, "serving": engine.serving,
                    "processor_config": loaded.vision.processor_config if loaded.vision is not None else None}))

    def report_warmed():
        engine.warmed.wait()
        send(("warmed", engine.warmup_status))

    threading.Thread(target=report_warmed, name="warmed", daemon=True).start()
    try:
        while True:
            try:
                message = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError):
                break  # the parent is gone
            kind = message[0]
            if kind == "add":
                try:
                    engine.add(message[1], message[2])
                except Exception as e:  # noqa: BLE001 - fail this request, not the engine
                    engine._publish({message[1].request_id: [StreamFailure(f"{e}")]})
            elif kind == "abort":
                engine.drop(message[1])
            elif kind in ("call", "peek"):
                _, call_id, method, args = message
                _answer(engine, send, kind, call_id, method, args)
            elif kind == "stop":
                break
    finally:
        engine.stop()
        sender.close()  # what the engine's stop failed goes out first
        conn.close()


def _answer(engine: _ChildEngine, send, kind: str, call_id: int, method: str, args: tuple) -> None:
    def reply(ok: bool, value) -> None:  # a value that does not pickle: the sender replies with the error
        send(("reply", call_id, ok, value if ok else _picklable(value)))

    try:
        fn = engine.method(method)
    except AttributeError as e:
        reply(False, e)
        return
    if kind == "peek":
        try:
            reply(True, fn(*args))
        except Exception as e:  # noqa: BLE001 - handed to the caller
            reply(False, e)
        return

    def done(future: concurrent.futures.Future) -> None:
        error = future.exception()
        reply(error is None, future.result() if error is None else error)

    engine.call(lambda: fn(*args)).add_done_callback(done)


def _picklable(error: BaseException) -> BaseException:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001
        return EngineError(f"{type(error).__name__}: {error}")
