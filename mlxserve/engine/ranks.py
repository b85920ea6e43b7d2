"""Starting the ranks of a distributed engine: every rank loads its part of the model and checks
that the others loaded the same, rank 0 serves HTTP and the others run its plans, or
`--distributed` starts them all through mlx.launch."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from pathlib import Path

from mlxserve.engine import collectives, plans
from mlxserve.engine.collectives import gather
from mlxserve.engine.distributed import DistributedEngine

log = logging.getLogger("mlxserve.distributed")


class RankMismatch(ValueError):
    """The ranks did not load the same model with the same settings and versions."""


def model_identity(loaded) -> str:
    """What identifies the weights on every machine alike: the dummy model's fingerprint (a hash
    of its config and seed), or a folder's config and weight files' names, sizes and headers
    (its fingerprint hashes modification times, which differ between copies on two machines)."""
    folder = loaded.tokenizer_dir
    if not loaded.fingerprint or folder is None or not any(Path(folder).glob("*.safetensors")):
        return loaded.fingerprint
    h = hashlib.sha256((Path(folder) / "config.json").read_bytes())
    for path in sorted(Path(folder).glob("*.safetensors")):
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f"\0{path.name}\0{path.stat().st_size}\0".encode() + f.read(min(header_len, 100_000_000)))
    return h.hexdigest()


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for p in ("mlxserve", "mlx", "mlx-lm"):
        try:
            out[p] = version(p)
        except PackageNotFoundError:
            out[p] = None
    return out


def _facts(model_cfg, engine_cfg) -> dict:
    """What every rank must share before loading: versions, the model's and engine's settings."""
    engine = dataclasses.asdict(engine_cfg)
    engine.pop("disk_cache_dir", None)  # each rank's own folder (a path per machine)
    return {"versions": _versions(), "model": dataclasses.asdict(model_cfg), "engine": engine,
            "ranks": collectives.group().size()}


def check_ranks(reports: list[dict]) -> None:
    """Raise RankMismatch naming what differs, if any rank failed to load or differs from rank 0."""
    failed = [f"rank {r}: {rep['error']}" for r, rep in enumerate(reports) if rep.get("error")]
    if failed:
        raise RankMismatch("the model failed to load on " + "; ".join(failed))
    diffs = []

    def walk(a, b, path, r):
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b)):
                walk(a.get(k), b.get(k), f"{path}.{k}" if path else k, r)
        elif a != b:
            diffs.append(f"{path}: rank 0 has {a!r}, rank {r} has {b!r}")

    for r, rep in enumerate(reports[1:], 1):
        walk(reports[0]["facts"], rep["facts"], "", r)
    if diffs:
        raise RankMismatch("the ranks differ, so they cannot serve one model together: " + "; ".join(diffs))


def load_rank(model_cfg, engine_cfg):
    """Load this rank's part of the model, check every rank loaded the same, and return it
    (every rank calls this at start, together). Raises RankMismatch or the load's error."""
    from mlxserve.models.load import load_configured
    from mlxserve.models.sharding import Sharding

    sharding = Sharding(collectives.group(), engine_cfg.parallel)
    # Settings and versions first: a mismatch is refused before anything loads.
    check_ranks(gather({"error": None, "facts": _facts(model_cfg, engine_cfg)}))
    loaded, error = None, None
    try:
        if model_cfg.draft_model or engine_cfg.speculative:
            raise ValueError("speculative decoding is not served across processes: drop --draft-model/--speculative")
        if engine_cfg.engine_process:
            raise ValueError("--engine-process does not combine with serving across processes")
        if engine_cfg.kv_layout == "paged":  # a pipeline-parallel MoE gave other tokens with it (a CPU run)
            raise ValueError("--kv-layout paged does not run across processes yet: leave it auto (contiguous there)")
        loaded = load_configured(model_cfg, sharding=sharding)
    except Exception as e:  # noqa: BLE001 - reported by every rank, below
        error = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # Then what was loaded: the same weights, split the same way.
    check_ranks(gather({"error": error, "facts": {
        "weights": model_identity(loaded) if loaded is not None else None, "parallel": sharding.mode}}))
    # Block hashes must be the same on every rank: the weights' identity, not a folder's mtimes,
    # and the split (blocks of another split hold other slices of the KV).
    loaded.fingerprint = hashlib.sha256(
        f"{model_identity(loaded)}/{sharding.mode}{sharding.size}".encode()).hexdigest()
    log.info("rank %d: %s", sharding.rank, sharding.describe())
    return loaded, sharding, plans.connect(sharding.rank, sharding.size, gather)


def run_worker(model_cfg, engine_cfg) -> int:
    """A rank past 0: load its part, run the engine on rank 0's plans until rank 0 stops (0) or
    is lost (1). It serves nothing itself."""
    loaded, sharding, channel = load_rank(model_cfg, engine_cfg)
    engine = DistributedEngine(loaded, engine_cfg, sharding, channel).start()
    engine._thread.join()
    channel.close()
    if engine.fatal_error:
        log.error("rank %d stops: %s", sharding.rank, engine.fatal_error.strip().splitlines()[0])
        return 1
    return 0


def start_rank0(model_cfg, engine_cfg):
    """Rank 0's model and engine (the server's model pool calls this)."""
    loaded, sharding, channel = load_rank(model_cfg, engine_cfg)
    engine = DistributedEngine(loaded, engine_cfg, sharding, channel).start()
    channel.watch(lambda rank: engine._lost(f"rank {rank} is gone: its connection to rank 0 closed"))
    return loaded, engine


def launch_command(hostfile: str, backend: str, serve_args: list[str]) -> list[str]:
    """The mlx.launch command that runs `mlxserve serve SERVE_ARGS` once per host of `hostfile`
    (`--distributed`): this Python on every host, so the same install must sit at the same path."""
    import sys

    if not Path(hostfile).is_file():
        raise ValueError(f"--distributed {hostfile}: no such hosts file")
    launcher = "import sys; from mlx._distributed_utils.launch import main; sys.argv[0] = 'mlx.launch'; sys.exit(main())"
    cmd = [sys.executable, "-c", launcher, "--hostfile", hostfile]
    if backend != "any":
        cmd += ["--backend", backend]
    return cmd + ["--", sys.executable, "-m", "mlxserve", "serve", *serve_args]


def without_flag(args: list[str], flag: str) -> list[str]:
    """`args` less `flag VALUE` and `flag=VALUE`."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


def serve_ranks(models, server_cfg, pool_cfg, serve) -> int:
    """`mlxserve serve` in one of several processes: rank 0 serves HTTP (`serve`), the others
    run the engine's steps with it. Returns the process's exit code."""
    rank = collectives.group().rank()
    logging.basicConfig(level=server_cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if len(models) != 1:
        log.error("serving across processes takes one model; %d were named", len(models))
        return 2
    if pool_cfg.model_ttl is not None:
        log.error("--model-ttl: a model served across processes stays loaded (every rank holds a part)")
        return 2
    if rank == 0:
        return serve(models, server_cfg, pool_cfg)
    try:
        return run_worker(models[0].model, models[0].engine)
    except ValueError as e:  # RankMismatch, a bad setting or model: said on rank 0 too
        log.error("%s", e)
        return 2
