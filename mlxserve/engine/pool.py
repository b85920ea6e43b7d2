"""Several models in one server: an engine each, loaded on demand, unloaded least
recently used first when another one needs the room.

A model is unloaded, waiting (for room), loading, loaded or unloading. A request
holds its model (`acquire` ... `release`: a count of requests in flight) from when
its route resolves the model's name until its response has been sent, so a model
serving requests is never unloaded: room is made from idle, unpinned models only,
least recently used first, and when there is none a load waits (up to `wait_s`)
for a model to become idle.

Loads and unloads run in worker threads (seconds of MLX work); the bookkeeping
runs on the event loop alone, so it needs no thread locks. One asyncio lock
serialises the decisions about room, so two loads never count the same free slot.
"""

from __future__ import annotations

import asyncio
import fnmatch
import gc
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Awaitable, Callable

from mlxserve.config import EngineConfig, ModelConfig, ServedModel
from mlxserve.engine.engine import AsyncEngine, EngineDeadError

log = logging.getLogger("mlxserve.pool")

UNLOADED, WAITING, LOADING, LOADED, UNLOADING = "unloaded", "waiting", "loading", "loaded", "unloading"
RESIDENT = (LOADING, LOADED, UNLOADING)  # states that hold memory, or are about to


class ModelUnavailable(RuntimeError):
    """A configured model cannot be served now: its load failed, or no room can be made."""


class ModelBusy(RuntimeError):
    """The model cannot be unloaded now: it serves requests, is pinned or is loading."""


class PoolLimit(ValueError):
    """Pinning the model would break --max-loaded-models or --models-memory."""


@dataclass
class ModelSpec:
    """A model the pool can load: its name (what requests say) and its settings."""

    name: str
    model: ModelConfig
    engine: EngineConfig
    pinned: bool = False
    ttl: float | None = None
    aliases: tuple[str, ...] = ()  # other names requests may use for it; shell patterns allowed

    @classmethod
    def of(cls, served: ServedModel, default_ttl: float | None = None) -> "ModelSpec":
        from mlxserve.models.load import served_name

        entry = served.entry
        name = entry.alias or served_name(served.model.model, served.model.load_format)
        return cls(name, served.model, served.engine, entry.pinned,
                   default_ttl if entry.ttl is None else entry.ttl, split_names(entry.aliases))


class Entry:
    """One model of the pool and where it stands."""

    def __init__(self, spec: ModelSpec):
        self.spec = spec
        self.name = spec.name
        self.state = UNLOADED
        self.pinned = spec.pinned
        self.loaded = None  # its LoadedModel, while loaded
        self.engine: AsyncEngine | None = None
        self.served: Any = None  # what the pool's `build` made of it (the API's per-model state)
        self.refs = 0  # requests holding it
        self.last_used = 0.0  # time.monotonic() of its last acquire or release
        self.nbytes = 0  # what it counts against --models-memory while resident
        self.error: str | None = None  # why its last load failed
        self.task: asyncio.Future | None = None  # the load or unload under way
        self.reserved = False  # waiting for its room to be freed: counted as resident already
        self.loads = 0
        # Pinned prefixes (id -> token ids): the engine holds their blocks; these are
        # pinned again after every load, so an unloaded model gets them back.
        self.prefix_pins: dict[str, list[int]] = {}

    def describe(self) -> dict:
        out = {"state": self.state, "pinned": self.pinned, "requests": self.refs, "loads": self.loads}
        if self.state in RESIDENT:
            out["bytes"] = self.nbytes
        if self.error:
            out["error"] = self.error
        return out


class ModelPool:
    def __init__(self, specs: list[ModelSpec], *, max_loaded: int | None = None, memory: int | None = None,
                 wait_s: float = 120.0, aliases: str | None = None):
        if not specs:
            raise ValueError("no model to serve")
        self.entries: dict[str, Entry] = {}
        specs = separate_disk_tiers(specs)
        for spec in specs:
            if spec.name in self.entries:
                raise ValueError(f"two models are named {spec.name!r}: give one an alias")
            self.entries[spec.name] = Entry(spec)
        self.aliases: list[tuple[str, Entry]] = []  # (name or pattern, its model), first match wins
        for spec in specs:
            for pattern in spec.aliases:
                self.add_alias(pattern, spec.name)
        for item in split_names(aliases):
            pattern, _, target = item.partition("=")
            self.add_alias(pattern.strip(), target.strip() or self.default.name)
        if max_loaded is not None and max_loaded < 1:
            raise ValueError(f"--max-loaded-models must be at least 1, not {max_loaded}")
        pinned = [s.name for s in specs if s.pinned]
        if max_loaded is not None and len(pinned) > max_loaded:
            raise ValueError(f"{len(pinned)} models are pinned ({', '.join(pinned)}) but "
                             f"--max-loaded-models is {max_loaded}")
        self.max_loaded = max_loaded
        self.memory = memory
        self.wait_s = wait_s
        # build(entry, loaded, engine) -> the API's per-model state; runs in the load thread.
        self.build: Callable[[Entry, Any, AsyncEngine], Any] | None = None
        # After each load, on the event loop (the API pins the entry's prefixes again).
        self.on_loaded: Callable[[Entry], Awaitable[None]] | None = None
        self._sizes: dict[str, int] = {}  # footprints measured at earlier loads
        # (asyncio's primitives bind to the loop that first waits on them, not at creation.)
        self._lock = asyncio.Lock()
        self._changed = asyncio.Event()  # set (and replaced) whenever room may have freed
        self._reaper: asyncio.Task | None = None

    @classmethod
    def of_engine(cls, engine: AsyncEngine, loaded, name: str) -> "ModelPool":
        """A pool of one model already loaded (its engine may not be started yet)."""
        pool = cls([ModelSpec(name, ModelConfig(model=loaded.source), engine.config)])
        pool._loaded(pool.default, loaded, engine)
        return pool

    # ---- lookup ----

    @property
    def default(self) -> Entry:
        """The first model: requests that name none get it."""
        return next(iter(self.entries.values()))

    def get(self, name: str | None) -> Entry | None:
        """The model a request names: its own name, else the first alias that matches it
        (a harness asks for names it knows, e.g. claude-haiku-4-5 or gpt-5-codex)."""
        if name is None:
            return self.default
        entry = self.entries.get(name)
        if entry is None:
            entry = next((e for pattern, e in self.aliases if fnmatch.fnmatchcase(name, pattern)), None)
        return entry

    def add_alias(self, pattern: str, model: str) -> None:
        """Requests naming `pattern` (a name, or a shell pattern: claude-*) get `model`."""
        if not pattern:
            raise ValueError("--alias: an empty name; give NAME or PATTERN, or PATTERN=MODEL")
        if model not in self.entries:
            raise ValueError(f"--alias {pattern}={model}: no model is named {model!r} "
                             f"(served: {', '.join(self.entries)})")
        if pattern in self.entries:
            raise ValueError(f"--alias {pattern}: a served model is already named so")
        self.aliases.append((pattern, self.entries[model]))

    def aliases_of(self, entry: Entry) -> list[str]:
        return [pattern for pattern, e in self.aliases if e is entry]

    def loaded_engines(self) -> list[AsyncEngine]:
        return [e.engine for e in self.entries.values() if e.state == LOADED and e.engine is not None]

    # ---- lifetime ----

    def attach(self, build: Callable) -> None:
        """Set `build`, and run it for the models already loaded."""
        self.build = build
        for e in self.entries.values():
            if e.state == LOADED and e.served is None:
                e.served = build(e, e.loaded, e.engine)

    def preload(self) -> None:
        """Load the default and the pinned models, blocking (before serving: a broken first
        model stops the server at start, as with a single model). Raises what `load` raises."""
        for e in self.entries.values():
            if (e is self.default or e.pinned) and e.state == UNLOADED:
                if self.max_loaded is not None and self._resident() >= self.max_loaded:
                    raise ValueError(f"--max-loaded-models {self.max_loaded} leaves no room for the "
                                     f"pinned model {e.name!r} beside the default one")
                loaded, engine, served = self._load_blocking(e)
                self._loaded(e, loaded, engine, served)
        used = sum(e.nbytes for e in self.entries.values() if e.state in RESIDENT)
        if self.memory is not None and used > self.memory:
            raise ValueError(f"the default and pinned models need {used} bytes (weights and cache budgets), "
                             f"more than --models-memory ({self.memory} bytes)")

    async def start(self) -> None:
        """On the server's loop: start engines not started yet, and the idle-unload timer."""
        for e in self.entries.values():
            if e.state == LOADED:
                await asyncio.to_thread(e.engine.start)  # no-op if already started
        ttls = [e.spec.ttl for e in self.entries.values() if e.spec.ttl is not None]
        if ttls:
            self._reaper = asyncio.create_task(self._reap(min(5.0, max(0.05, min(ttls) / 4))))
        freeze_heap()

    async def stop(self) -> None:
        gc.unfreeze()  # what the server held becomes collectable again (tests start many)
        if self._reaper is not None:
            self._reaper.cancel()
        engines = [e.engine for e in self.entries.values() if e.engine is not None]
        await asyncio.gather(*(asyncio.to_thread(engine.stop) for engine in engines))

    def stop_blocking(self) -> None:
        for e in self.entries.values():
            if e.engine is not None:
                e.engine.stop()

    # ---- requests ----

    async def acquire(self, name: str) -> Entry:
        """The model, loaded (waiting for its load), held until `release`.

        Raises KeyError for an unknown name, ModelUnavailable when it cannot be loaded.
        """
        entry = self.entries[name]
        entry.refs += 1  # from now on it is never chosen to make room
        try:
            while entry.state != LOADED:
                if entry.task is None or entry.task.done():
                    entry.task = _quiet(asyncio.ensure_future(self._load(entry)))
                # shield: a request that gives up waiting does not stop the load for the others
                await asyncio.shield(entry.task)
        except BaseException:
            self.release(entry)
            raise
        entry.last_used = time.monotonic()
        return entry

    def release(self, entry: Entry) -> None:
        entry.refs -= 1
        entry.last_used = time.monotonic()
        self._notify()

    # ---- administration ----

    async def load(self, name: str) -> Entry:
        self.release(await self.acquire(name))
        return self.entries[name]

    async def unload(self, name: str) -> Entry:
        entry = self.entries[name]
        async with self._lock:
            if entry.pinned:
                raise ModelBusy(f"the model {name!r} is pinned: unpin it first (DELETE /v1/models/{name}/pin)")
            if entry.refs:
                raise ModelBusy(f"the model {name!r} is serving {entry.refs} request(s); retry when they are done")
            if entry.state in (WAITING, LOADING):
                raise ModelBusy(f"the model {name!r} is loading; retry when it is loaded")
            if entry.state == LOADED:
                self._begin_unload(entry, "asked to")
        if entry.state == UNLOADING:
            await asyncio.shield(entry.task)
        return entry

    async def pin(self, name: str) -> Entry:
        """Keep the model loaded for good (loading it now if it is not)."""
        entry = self.entries[name]
        if entry.pinned:
            return entry
        pinned = [e for e in self.entries.values() if e.pinned]
        if self.max_loaded is not None and len(pinned) + 1 > self.max_loaded:
            raise PoolLimit(f"cannot pin {name!r}: {len(pinned)} model(s) are pinned already "
                            f"({', '.join(e.name for e in pinned)}) and --max-loaded-models is {self.max_loaded}")
        if self.memory is not None:
            need = sum(self._estimate(e) for e in pinned) + self._estimate(entry)
            if need > self.memory:
                raise PoolLimit(f"cannot pin {name!r}: the pinned models would need about {need} bytes, "
                                f"more than --models-memory ({self.memory} bytes)")
        entry.pinned = True  # before the load: not a candidate to make room from now on
        try:
            return await self.load(name)
        except BaseException:
            entry.pinned = False
            raise

    def unpin(self, name: str) -> Entry:
        entry = self.entries[name]
        entry.pinned = False
        entry.last_used = time.monotonic()
        self._notify()
        return entry

    # ---- loading ----

    async def _load(self, entry: Entry) -> None:
        entry.state = WAITING
        try:
            await self._make_room(entry)
            loaded, engine, served = await asyncio.to_thread(self._load_blocking, entry)
        except asyncio.CancelledError:
            entry.state, entry.reserved = UNLOADED, False
            self._notify()
            raise
        except Exception as e:  # noqa: BLE001 - every failure becomes the requests' error
            entry.state, entry.reserved = UNLOADED, False
            entry.error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            self._notify()
            if not isinstance(e, (ModelUnavailable, ValueError, OSError, EngineDeadError)):
                log.exception("loading %s failed", entry.name)
            if isinstance(e, ModelUnavailable):
                raise
            raise ModelUnavailable(f"the model {entry.name!r} could not be loaded: {entry.error}") from None
        self._loaded(entry, loaded, engine, served)
        freeze_heap()
        log.info("loaded %s (%d bytes counted)", entry.name, entry.nbytes)
        self._notify()
        await self._fit(entry)
        if self.on_loaded is not None:
            await self.on_loaded(entry)

    def _load_blocking(self, entry: Entry):
        """(worker thread) Load the weights, start the engine, build the API's state."""
        from mlxserve.models.load import load_configured

        from mlxserve.engine import collectives

        if collectives.group() is not None:  # rank 0 of several processes (mlx.launch)
            from mlxserve.engine.ranks import start_rank0

            loaded, engine = start_rank0(entry.spec.model, entry.spec.engine)
        elif entry.spec.engine.engine_process:  # the child loads it; here only its tokenizer
            from mlxserve.engine.process import ProcessEngine

            engine = ProcessEngine.launch(entry.spec.model, entry.spec.engine).start()
            loaded = engine.loaded
        else:
            loaded = load_configured(entry.spec.model)
            engine = AsyncEngine(loaded, entry.spec.engine).start()
        try:
            served = self.build(entry, loaded, engine) if self.build is not None else None
        except BaseException:
            engine.stop()
            raise
        return loaded, engine, served

    def _loaded(self, entry: Entry, loaded, engine: AsyncEngine, served=None) -> None:
        entry.loaded, entry.engine, entry.served = loaded, engine, served
        entry.state = LOADED
        entry.error = None
        entry.loads += 1
        entry.last_used = time.monotonic()
        entry.nbytes = self._sizes[entry.name] = footprint(loaded, entry.spec.engine)

    async def _make_room(self, entry: Entry) -> None:
        """Unload idle models (least recently used first) until `entry` fits, waiting for
        models in use to become idle when that is not enough; then `entry` is LOADING."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait_s
        while True:
            async with self._lock:
                changed = self._changed  # a change after this point wakes the wait below
                victims, why, never = self._plan(entry)
                if victims is not None:
                    entry.reserved = True  # counted from now on, while the victims unload
                    entry.nbytes = self._estimate(entry)  # until measured once loaded
                    tasks = [self._begin_unload(v, f"room for {entry.name}") for v in victims]
                    break
                if never:
                    raise ModelUnavailable(why)
            left = deadline - loop.time()
            if left <= 0:
                raise ModelUnavailable(f"{why}; waited {self.wait_s:g} s for one to become idle")
            try:
                await asyncio.wait_for(changed.wait(), left)
            except asyncio.TimeoutError:
                pass
        # Their memory must be free before the new weights come in.
        await asyncio.gather(*(asyncio.shield(t) for t in tasks))
        entry.state = LOADING
        entry.reserved = False

    def _plan(self, entry: Entry):
        """(victims, None, False) when unloading `victims` makes room; else (None, why, whether
        it can never fit: the pinned models alone leave no room)."""
        others = [e for e in self.entries.values() if e is not entry and (e.state in RESIDENT or e.reserved)]
        need = self._estimate(entry)

        def fits(gone) -> bool:
            rest = [e for e in others if e not in gone]
            return ((self.max_loaded is None or len(rest) + 1 <= self.max_loaded)
                    and (self.memory is None or sum(e.nbytes for e in rest) + need <= self.memory))

        fixed = [e for e in others if e.pinned]
        if not fits([e for e in others if not e.pinned]):
            names = ", ".join(e.name for e in fixed) or "none"
            return None, (f"no room for the model {entry.name!r} (about {need} bytes) beside the pinned "
                          f"models ({names}): --max-loaded-models {self.max_loaded}, --models-memory "
                          f"{self.memory} bytes"), True
        victims = []
        for e in sorted((e for e in others if e.state == LOADED and e.refs == 0 and not e.pinned),
                        key=lambda e: e.last_used):
            if fits(victims):
                break
            victims.append(e)
        if fits(victims):
            return victims, None, False
        busy = ", ".join(f"{e.name} ({e.refs} requests)" for e in others if e.refs)
        return None, (f"no room to load the model {entry.name!r}: the loaded models are in use "
                      f"({busy or 'loading'})"), False

    async def _fit(self, entry: Entry) -> None:
        """After a load whose size was guessed low: unload idle models until the memory budget holds."""
        if self.memory is None:
            return
        async with self._lock:
            resident = [e for e in self.entries.values() if e.state in RESIDENT or e.reserved]
            over = sum(e.nbytes for e in resident) - self.memory
            for e in sorted((e for e in resident if e is not entry and e.state == LOADED and not e.refs
                             and not e.pinned), key=lambda e: e.last_used):
                if over <= 0:
                    break
                self._begin_unload(e, f"{entry.name} is bigger than guessed")
                over -= e.nbytes
        if over > 0:
            log.warning("loaded models exceed --models-memory by %d bytes: the others are in use or pinned", over)

    def _estimate(self, entry: Entry) -> int:
        """What `entry` will count once loaded: as measured last time, else from its files."""
        if entry.name in self._sizes:
            return self._sizes[entry.name]
        return file_bytes(entry.spec.model) + cache_budgets(entry.spec.engine, vision=False)

    def _resident(self) -> int:
        return sum(e.state in RESIDENT for e in self.entries.values())

    # ---- unloading ----

    def _begin_unload(self, entry: Entry, why: str) -> asyncio.Future:
        """(under the lock) Start unloading an idle model; returns the task."""
        assert entry.state == LOADED and not entry.refs
        entry.state = UNLOADING
        entry.task = _quiet(asyncio.ensure_future(self._unload(entry, why)))
        return entry.task

    async def _unload(self, entry: Entry, why: str) -> None:
        engine = entry.engine
        # Drop every reference but the engine's, which its own thread drops as it stops:
        # the weights are then freed on the thread that used them.
        entry.loaded = entry.served = entry.engine = None
        log.info("unloading %s (%s)", entry.name, why)
        try:
            await asyncio.to_thread(_stop, engine)
        except Exception:  # noqa: BLE001 - the model is gone either way; its requests must not fail
            log.exception("stopping %s's engine", entry.name)
        finally:
            entry.state = UNLOADED
            self._notify()

    async def _reap(self, every: float) -> None:
        """Unload models idle longer than their ttl."""
        while True:
            await asyncio.sleep(every)
            now = time.monotonic()
            async with self._lock:
                for e in self.entries.values():
                    ttl = e.spec.ttl
                    if (ttl is not None and e.state == LOADED and not e.refs and not e.pinned
                            and now - e.last_used >= ttl):
                        self._begin_unload(e, f"idle for {ttl:g} s")

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()


def split_names(names: str | None) -> tuple[str, ...]:
    """Comma-separated names (a setting's value) as a tuple, blanks left out."""
    return tuple(n.strip() for n in (names or "").split(",") if n.strip())


def separate_disk_tiers(specs: list[ModelSpec]) -> list[ModelSpec]:
    """Models that share a --disk-cache-dir get a folder each in it (named after the model).

    Block keys hash the model's fingerprint, so files never mix, but each disk tier
    keeps its own index and byte budget of the folder it scans: in one folder they
    would count, and evict, each other's files.
    """
    import dataclasses
    import re
    from collections import Counter

    shared = Counter(str(Path(s.engine.disk_cache_dir).expanduser()) for s in specs if s.engine.disk_cache_dir)
    out = []
    for s in specs:
        folder = s.engine.disk_cache_dir and str(Path(s.engine.disk_cache_dir).expanduser())
        if folder and shared[folder] > 1:
            sub = Path(folder) / re.sub(r"[^A-Za-z0-9._-]", "_", s.name.replace("/", "--"))
            s = dataclasses.replace(s, engine=dataclasses.replace(s.engine, disk_cache_dir=str(sub)))
        out.append(s)
    return out


def _quiet(task: asyncio.Future) -> asyncio.Future:
    """A task whose failure is the awaiting requests' business (no 'never retrieved' log
    when they have all gone)."""
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


def _stop(engine: AsyncEngine) -> None:
    import mlx.core as mx

    engine.stop(release_model=True)
    gc.unfreeze()  # the model's objects were frozen with the rest: its cycles must be found
    freeze_heap()
    mx.clear_cache()  # give the freed buffers back, for the next model


def freeze_heap() -> None:
    """Collect, then move every object alive out of the garbage collector's reach: the models',
    the libraries' and the server's own (120k objects with a tiny model). A collection of the
    oldest generation then scans only what requests allocated since; scanning them all took
    80-105 ms on a 2-core CPU with every thread stopped, streams' tokens included. (Unloading a
    model unfreezes first, so nothing it held stays uncollectable.)"""
    gc.collect()
    gc.freeze()


def footprint(loaded, engine_cfg: EngineConfig) -> int:
    """What a loaded model counts against --models-memory: its weights and its caches' budgets."""
    return weights_nbytes(loaded) + cache_budgets(engine_cfg, vision=loaded.vision is not None)


def weights_nbytes(loaded) -> int:
    if loaded.remote_weights_nbytes is not None:  # held by an engine process
        return loaded.remote_weights_nbytes
    from mlx.utils import tree_flatten

    module = loaded.vision.model if loaded.vision is not None else loaded.model
    return sum(v.nbytes for _, v in tree_flatten(module.parameters()))


def cache_budgets(cfg: EngineConfig, vision: bool) -> int:
    from mlxserve.cache.sizes import parse_size

    return ((parse_size(cfg.cache_memory) if cfg.prefix_cache else 0)
            + (parse_size(cfg.vision_cache_memory) if vision else 0))


def file_bytes(m: ModelConfig) -> int:
    """The weight files' size of a local model (a guess of its weights before the first load); 0 if unknown."""
    if m.load_format != "auto" or not m.model:
        return 0
    path = Path(m.model).expanduser()
    if path.is_file():
        return path.stat().st_size
    if path.is_dir():
        return sum(f.stat().st_size for f in path.glob("*.safetensors"))
    return 0
