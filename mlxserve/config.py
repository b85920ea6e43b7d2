"""Every setting, once: name, type, default and help text.

The CLI builds its flags from these dataclasses and the Python API takes the
same names as keyword arguments, so the two can never drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field


def setting(default, help: str, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class ModelConfig:
    model: str | None = setting(
        None,
        "Model to serve: a local MLX folder, a .gguf file, a Hugging Face repo id, "
        "a built-in name (default, gemma3-270m) or, with --load-format dummy, a "
        "named shape or config.json. Empty: the embedded default model.",
        positional=True,
    )
    load_format: str = setting(
        "auto",
        "auto: real weights; dummy: random weights of the model's architecture (for benchmarks).",
        choices=("auto", "dummy"),
    )
    dtype: str | None = setting(
        None,
        "Weight dtype for converted and dummy models (float32, bfloat16, float16). "
        "Default: float32 on the CPU backend, bfloat16 on a GPU.",
    )
    quantize: int | None = setting(
        None, "Quantize dummy weights to this many bits (4 or 8).", choices=(4, 8)
    )
    dummy_seed: int = setting(0, "Seed of the random weights of --load-format dummy.")
    draft_model: str | None = setting(
        None,
        "Draft model for speculative decoding (turns it on): any model source, loaded like the "
        "model (same --load-format, --dtype, --quantize, --dummy-seed); it must have the model's "
        "vocabulary. See --num-draft-tokens.",
    )


@dataclass
class EngineConfig:
    max_num_seqs: int = setting(
        # 64: at 64 streams on an H100 (0.6B, 128-token prompts) 32 slots left half the requests
        # queued a whole request long (1.6-1.8 s mean queue, benchmarks/serve-cuda-20261128-0033);
        # the KV budget (--kv-memory) still holds back what does not fit.
        64, "Most sequences decoded together in one batch."
    )
    prefill_chunk_size: int | None = setting(
        None,
        "Prompt tokens prefilled per engine step; long prompts are split into chunks of this size, "
        "with decode steps of running requests in between. Default: 2048 on CUDA (an H200 prefilled "
        "a 4B model's 1k-token prompt 1.7x faster than in chunks of 512), 512 elsewhere.",
    )
    prefill_batch_size: int = setting(
        8, "Most prompts prefilled together in one step."
    )
    max_model_len: int | None = setting(
        None, "Longest prompt plus output, in tokens. Default: the model's context length."
    )
    max_queue: int = setting(
        256, "Most requests waiting for a slot; beyond this new requests are refused (HTTP 429)."
    )
    kv_memory: str = setting(
        "auto",
        "Memory the running requests' KV cache may take, e.g. 8GB or 50% (of what MLX may use). "
        "Each request counts at its full length (prompt + max_tokens; in a batch every row at the "
        "longest row's, as mlx-lm pads them), estimated from the model's cache layers: a request "
        "waits until it fits beside the running ones, and one that could not fit even alone is "
        "refused (HTTP 503; a request that names no max_tokens gets what fits). auto: what MLX may "
        "use (the smaller of mx.get_memory_limit() and the device's memory), less the weights and "
        "the prefix and vision caches' budgets.",
    )
    step_timeout: float = setting(
        120.0,
        "Seconds one engine step may run before the watchdog fails every request in flight (an "
        "HTTP 503, or an error event in a stream), refuses new ones and reports 'stalled' on "
        "/health; the engine serves again when the step returns. 0: no watchdog.",
    )
    default_max_tokens: int = setting(
        4096, "Output tokens of a request that names no limit (capped by the context)."
    )
    strict_max_tokens: bool = setting(
        False,
        "Refuse (HTTP 400) a request whose prompt plus max_tokens exceeds the context, as OpenAI "
        "and vLLM do. Off, max_tokens is capped at what the context leaves and the answer ends "
        "with finish_reason length (stop_reason max_tokens) there, as llama.cpp's server does: "
        "agents ask for more than a local model holds (Claude Code sends max_tokens 32000-128000).",
    )
    prefix_cache: bool = setting(
        True, "Reuse the KV cache of shared prompt prefixes (paged, chain-hashed blocks)."
    )
    cache_memory: str = setting(
        "10%",
        "Byte budget of the prefix cache's blocks in memory: e.g. 4GB, 512MB, or a share "
        "of the memory MLX may use (20%). Least recently used free blocks are evicted beyond it.",
    )
    block_size: int | None = setting(
        None,
        "Tokens per prefix-cache block, the unit of storage (hits are exact to the token). Default: 32 on the CPU "
        "backend, 256 on a GPU, where storing a block costs kernel launches per layer, so "
        "small blocks slow down misses (see benchmarks/prefix-*).",
    )
    checkpoint_interval: int = setting(
        4,
        "For models with recurrent layers (Qwen3.5/3-Next, Mamba hybrids, LFM2), whose "
        "cache can be restored only where a prefill pass stopped: prefill stops to store the "
        "recurrent state every this many blocks, and always at each prompt's last block end "
        "and its last token but one (where a repeat or an agent's next turn continues). 0: only "
        "there. Each state costs memory (see benchmarks/prefix-*); fewer cost recompute when "
        "prompts part midway.",
    )
    kv_bits: int | None = setting(
        None,
        "Quantize the KV cache of full-attention layers to this many bits (4 or 8), from "
        "the first token: about half (8) or a quarter (4) of the KV memory, in the running "
        "batch and in prefix-cache blocks. Sliding-window and recurrent layers stay unquantized.",
        choices=(4, 8),
    )
    kv_attention: str = setting(
        "auto",
        "How attention reads --kv-bits KV: quantized (mlx's quantized matmuls on the packed "
        "values) or dequantized (each layer dequantizes its KV, then runs ordinary attention). "
        "auto: quantized on Metal, dequantized elsewhere (MLX-CUDA has no quantized matmul for "
        "decoding, and on the CPU it is slower than BLAS).",
        choices=("auto", "quantized", "dequantized"),
    )
    kv_layout: str = setting(
        "auto",
        "Where the running batch keeps the KV of full-attention layers. paged: a block pool (blocks "
        "of --block-size tokens), each request a table of block ids, attention reading the blocks, "
        "cache hits taken by reference (docs/paged-kv.md); contiguous: mlx-lm's batch caches (rows "
        "padded to the longest, copied on every admission and removal). auto: paged on CUDA for "
        "text models without --kv-bits (measured faster there at 4-64 streams), contiguous "
        "elsewhere (on Metal paged decoding takes the gather path until its kernel is measured on "
        "a Mac; on the CPU it measured slower). Other layers (sliding window, recurrent) keep their caches either way.",
        choices=("auto", "contiguous", "paged"),
    )
    disk_cache_dir: str | None = setting(
        None,
        "Folder of the prefix cache's disk tier: every full block is also written there (in "
        "the background), and a prompt whose blocks left memory, or were cached before a "
        "restart, reads them back. Default: no disk tier.",
    )
    disk_cache_size: str = setting(
        "20GB", "Byte budget of the disk tier, e.g. 50GB; the least recently used blocks go first."
    )
    disk_cache_write_rate: str = setting(
        "256MB", "Bytes per second the disk tier writes at most (writes wait for their turn); 0: no limit."
    )
    disk_cache_daily_writes: str = setting(
        "100GB", "Bytes per day the disk tier writes at most, against SSD wear (100GB a day spends about "
        "6 percent a year of a 1 TB SSD rated for 600 TB written); past it, blocks stay in memory only. "
        "0: no limit.",
    )
    vision_cache_memory: str = setting(
        "512MB",
        "Byte budget of the vision-embedding cache (images' projected embeddings, by pixel "
        "content), e.g. 1GB or 5%; 0 turns it off.",
    )
    keep_image_embeddings: bool = setting(
        False,
        "Keep an image's embeddings in the vision cache after the prefix cache has stored its "
        "KV blocks. Off (the default), they are dropped then: later turns restore the KV and "
        "never read them, so an image costs its KV alone; the same picture under another "
        "prefix runs the vision tower again.",
    )
    vision_step_ms: float = setting(
        20.0,
        "An image's vision-tower pass runs in slices of about this many ms (at block "
        "boundaries), each between two decode steps of the running requests; 0 runs the "
        "whole tower at once.",
    )
    warmup: float = setting(
        300.0,
        "Seconds of warm-up after start: while idle, the engine runs each serving path once with "
        "synthetic tokens (chunked prefill, prefix-cache restores, decoding alone and in batches up "
        "to --max-num-seqs, sampling; on the CPU three short phases), so that the kernels MLX builds "
        "on first use (minutes on a fresh GPU machine) are built before users' requests. A request "
        "that arrives meanwhile waits for one phase at most; the phases stop once this time is "
        "spent. Nothing of it stays in the prefix cache or the statistics. 0: off.",
    )
    switch_interval_ms: float = setting(
        0.5,
        "Python's thread switch interval while an engine runs (process-wide), in ms: how long the "
        "event loop (HTTP, detokenizing) may wait for the GIL while the MLX thread builds a step. "
        "Shorter sends each token sooner; longer (Python's default is 5) leaves the event loop "
        "more to the MLX thread's waits on the GPU instead of the middle of a step's host work. "
        "`mlxserve bench http` measures either.",
    )
    engine_process: bool = setting(
        False,
        "Run the engine (the MLX thread: model, scheduler, caches) in a process of its own, as "
        "vLLM's v1 does: the server's process then only does HTTP, detokenizing and SSE, and its "
        "Python never waits for the GIL the engine's step building holds (`mlxserve bench http "
        "--modes ...,http-process` measures both). Vision-language models too: the server's process "
        "renders their prompts and preprocesses their images, the engine's runs the tower.",
    )
    parallel: str = setting(
        "auto",
        "Under mlx.launch (several processes, one model): how the model is split across them. "
        "tensor: every layer split across the ranks (mlx-lm's model.shard()); pipeline: the layers "
        "divided among them (mlx-lm's pipeline()); auto: tensor where mlx-lm has it for the "
        "architecture, else pipeline. See docs/distributed.md.",
        choices=("auto", "tensor", "pipeline"),
    )
    distributed_backend: str = setting(
        "any",
        "MLX's distributed backend under mlx.launch: any (what the launcher set up), ring (TCP), "
        "jaccl (RDMA over Thunderbolt 5), mpi or nccl (CUDA GPUs).",
        choices=("any", "ring", "jaccl", "mpi", "nccl"),
    )
    admission_window_ms: float = setting(
        0.0,
        "While requests decode, a new one waits up to this long (ms) to be admitted together with "
        "others arriving, up to a prefill batch (--prefill-batch-size) or the free slots: one "
        "prefill pass and one merge into the running batch instead of one per arrival (requests "
        "reach the engine one by one over HTTP). An idle engine admits at once. 0: admit each at "
        "the next step.",
    )
    dense_from: int | None = setting(
        None,
        "Tokens a call needs before a quantized layer dequantizes its weight and multiplies densely "
        "(prefill; 0: never). MLX's quantized matmul suits few tokens but runs far below the dense "
        "one over many on CUDA (a 4B model's prefill 1.4-1.8x faster dense on an H200) and on the "
        "CPU (a 0.6B model's 12x). "
        "Default: 512 on CUDA, 8 on the CPU, 0 on Metal (not measured there).",
    )
    solo_fast_path: bool = setting(
        True,
        "Decode a lone request with a lean single-sequence loop (like mlx-lm's "
        "generate_step) and move it into the batch when others arrive.",
    )
    compile_decode: str = setting(
        "off",
        "Compile the lone request's one-token decode step (mx.compile: the step's graph is traced "
        "once and replayed, attending over a KV buffer that grows in buckets) for models whose every "
        "layer is plain full attention (Qwen2, Qwen3, Llama; others and --kv-bits decode as before); "
        "the tokens are the same. Off by default: on MLX CUDA it measured 0.74x the eager step (its "
        "masked one-token attention runs unfused), on the CPU no faster; Metal is not measured yet.",
        choices=("on", "off"),
    )
    speculative: str | None = setting(
        None,
        "Speculative decoding for a request that runs alone (the lone path): ngram proposes the "
        "tokens that followed the last --ngram-size tokens' latest earlier occurrence in the prompt "
        "or output (code and JSON edits repeat the prompt); draft: a --draft-model proposes. The "
        "model checks all proposals in one pass and keeps those equal to its own tokens, so the "
        "output is unchanged. Off for batched and grammar-constrained requests and for models "
        "whose cache cannot be rewound (recurrent layers). Default: off, or draft with --draft-model.",
        choices=("ngram", "draft"),
    )
    num_draft_tokens: int = setting(4, "Most tokens proposed per verify pass of speculative decoding.")
    ngram_size: int = setting(
        3, "--speculative ngram: tokens matched to find an earlier occurrence to copy from."
    )


def with_backend_defaults(cfg: EngineConfig) -> EngineConfig:
    """`cfg` with the defaults that depend on the backend (None) filled in for this one."""
    from mlxserve import backend

    unset = {name: backend.default(name) for name in backend.DEFAULTS if getattr(cfg, name) is None}
    return dataclasses.replace(cfg, **unset) if unset else cfg


@dataclass
class ServerConfig:
    host: str = setting("127.0.0.1", "Address to listen on.")
    port: int = setting(8000, "Port to listen on.")
    distributed: str | None = setting(
        None,
        "Serve one model across the hosts of this mlx.launch hosts file (JSON): the server starts "
        "itself once per host through mlx.launch (--distributed-backend, ring unless the file names "
        "one) and this host serves HTTP as rank 0 (the file's first host). See docs/distributed.md.",
    )
    api_key: str | None = setting(
        None, "Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health "
        "and the web page's own files (its data needs the key).",
    )
    metrics_public: bool = setting(
        False, "With --api-key: leave /metrics open, for a Prometheus scraper without the key."
    )
    served_model_name: str | None = setting(
        None, "Model name reported by /v1/models and accepted in requests."
    )
    max_request_bytes: int = setting(32 * 1024 * 1024, "Largest request body accepted (HTTP 413 beyond).")
    shutdown_timeout: float = setting(
        20.0, "On SIGINT/SIGTERM, seconds in-flight requests get to finish before they are ended."
    )
    log_level: str = setting("info", "Log level.", choices=("debug", "info", "warning", "error"))
    allowed_local_media_path: str | None = setting(
        None,
        "Directories (comma-separated) whose images requests may name as file:// URLs. "
        "Default: none, file URLs are refused.",
    )
    allow_private_media_urls: bool = setting(
        False, "Let image URLs point at private, loopback and link-local addresses."
    )
    media_fetch_timeout: float = setting(10.0, "Seconds an image URL gets to download in full.")
    max_media_bytes: int = setting(20 * 1024 * 1024, "Largest image accepted, in bytes (URL, data URL or file).")
    max_image_pixels: int = setting(
        25_000_000, "Largest image (or video frame) accepted, in pixels (width x height), checked before decoding."
    )
    video_fps: float = setting(2.0, "Video frames sampled per second of video_url parts.")
    max_video_frames: int = setting(32, "Most frames taken from one video (an even number is used).")
    responses_store_size: int = setting(
        1000,
        "Responses (/v1/responses) kept in memory for previous_response_id and GET, each with "
        "its whole conversation; the least recently used go first. 0 stores none.",
    )


@dataclass
class PoolConfig:
    config: str | None = setting(
        None,
        "A TOML file (YAML with pyyaml installed: .yaml/.yml) of models to serve, after those named "
        "on the command line: [[models]] tables, each with `model` (its source) and any of alias, "
        "pinned, ttl and the model and engine settings (load_format, dtype, kv_bits, cache_memory, "
        "...); what a table leaves out comes from the command line's flags.",
    )
    alias: str | None = setting(
        None,
        "Other model names requests may use, comma-separated: NAME or PATTERN (shell-style, e.g. "
        "'claude-*') for the first model, NAME=MODEL for another. Agents ask for the names they "
        "know (Claude Code for claude-*, Codex for gpt-5*); --alias 'claude-*,gpt-*' serves them "
        "the default model. Unknown names still get a 404.",
    )
    max_loaded_models: int | None = setting(
        None,
        "Most models loaded at once. A request for another model unloads the least recently used "
        "idle one (never one serving requests, nor a pinned one) or waits for one to become idle. "
        "Default: no limit.",
    )
    models_memory: str | None = setting(
        None,
        "Byte budget of the loaded models, e.g. 8GB or 60%: each counts its weights plus its prefix- "
        "and vision-cache budgets. A model's weights are known once it was loaded (or from its files); "
        "one that turns out bigger than guessed makes idle models unload after it. Default: no limit.",
    )
    model_ttl: float | None = setting(
        None, "Unload a model after this many seconds without requests (pinned models stay). Default: never."
    )
    model_wait: float = setting(
        120.0,
        "Seconds a request for an unloaded model waits for room (for models serving requests to "
        "become idle) before it is refused with a 503.",
    )
    pin: str | None = setting(
        None,
        "A JSON file: a list of prefixes to pin at start, each a body of POST /v1/cache/pin "
        "({model, messages, tools} or {model, prompt}), e.g. agents' fixed system prompts.",
    )


@dataclass
class ModelEntry:
    """What one model of several has besides its model and engine settings."""

    alias: str | None = setting(
        None, "The name requests use for it. Default: its source's name (the first model: --served-model-name)."
    )
    aliases: str | None = setting(
        None, "Other names requests may use for it, comma-separated (a list in the file); shell "
        "patterns match many: 'claude-*, gpt-5*'."
    )
    pinned: bool = setting(False, "Loaded at start and never unloaded for room or idleness.")
    ttl: float | None = setting(None, "Its idle seconds before it is unloaded. Default: --model-ttl.")


@dataclass
class ServedModel:
    """One model to serve: its own entry, how to load it and its engine's settings."""

    entry: ModelEntry
    model: ModelConfig
    engine: EngineConfig


def served_models(sources, model_cfg: ModelConfig, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                  pool_cfg: PoolConfig) -> list[ServedModel]:
    """The models to serve: the command line's `sources`, then --config's entries.

    No source and no file: the embedded default model, as a single-model server
    always had. Raises ValueError naming the file and entry for a bad entry.
    """
    sources = list(sources or [])
    tables = read_models_file(pool_cfg.config) if pool_cfg.config else []
    if not sources and not tables:
        sources = [None]
    out = [ServedModel(ModelEntry(), dataclasses.replace(model_cfg, model=src), engine_cfg) for src in sources]
    for i, table in enumerate(tables):
        where = f"{pool_cfg.config}: models[{i}]"
        if not isinstance(table, dict):
            raise ValueError(f"{where}: must be a table of settings, not {type(table).__name__}")
        parts = {}
        for cls, base in ((ModelEntry, ModelEntry()), (ModelConfig, model_cfg), (EngineConfig, engine_cfg)):
            names = {f.name: f for f in dataclasses.fields(cls)}
            given = {k: _checked(names[k], _joined(v) if k == "aliases" else v, f"{where}.{k}")
                     for k, v in table.items() if k in names}
            parts[cls] = dataclasses.replace(base, **given)
        known = {f.name for cls in parts for f in dataclasses.fields(cls)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{where}: unknown setting {unknown[0]!r}; known: {', '.join(sorted(known))}")
        out.append(ServedModel(parts[ModelEntry], parts[ModelConfig], parts[EngineConfig]))
    if server_cfg.served_model_name and out[0].entry.alias is None:
        out[0].entry.alias = server_cfg.served_model_name
    return out


def read_models_file(path: str) -> list:
    """The `models` list of a TOML (or YAML) file."""
    from pathlib import Path

    try:
        text = Path(path).expanduser().read_text()
    except OSError as e:
        raise ValueError(f"--config {path}: cannot read it: {e}") from None
    if path.lower().endswith((".yaml", ".yml")):
        try:
            import yaml
        except ImportError:
            raise ValueError(f"--config {path}: reading YAML needs pyyaml (pip install pyyaml); "
                             "or write the file as TOML") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"--config {path}: not valid YAML: {e}") from None
    else:
        import tomllib

        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"--config {path}: not valid TOML: {e}") from None
    if not isinstance(data, dict) or set(data) - {"models"}:
        raise ValueError(f"--config {path}: must hold `models` only: a list of tables ([[models]] in TOML)")
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise ValueError(f"--config {path}: `models` must be a non-empty list of tables")
    return models


def _joined(value):
    """A list of names in a file (aliases = ["claude-*", "gpt-5*"]) as the setting's comma form."""
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return ",".join(value)
    return value


_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,)}


def _checked(f: dataclasses.Field, value, where: str):
    """A file's value for setting `f`, checked against its type and choices."""
    kind, _, none = f.type.partition(" | ")
    if value is None and none == "None":
        return None
    allowed = _TYPES[kind]
    if not isinstance(value, allowed) or (kind != "bool" and isinstance(value, bool)):
        what = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false"}[kind]
        raise ValueError(f"{where}: must be {what}, not {value!r}")
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"{where}: must be one of {', '.join(map(str, choices))}, not {value!r}")
    return float(value) if kind == "float" else value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_arguments(parser: argparse.ArgumentParser, *config_classes, positional: bool = True,
                  exclude: set[str] = frozenset()) -> None:
    """Add one flag per setting of the given config dataclasses (but those in `exclude`).

    With positional=False, settings marked positional (the model) become
    options too, for commands whose own positional argument is a prompt;
    with positional="many", the positional takes any number of values (serve A B C).
    """
    for cls in config_classes:
        for f in dataclasses.fields(cls):
            if f.name in exclude:
                continue
            meta = f.metadata
            kwargs = {"help": meta["help"].replace("%", "%%") + _default_note(f.default, meta["help"])}
            if "choices" in meta:
                kwargs["choices"] = meta["choices"]
            default = f.default
            if f.type in ("bool",) or isinstance(default, bool):
                parser.add_argument(
                    _flag(f.name), dest=f.name, default=default,
                    action=argparse.BooleanOptionalAction, **kwargs,
                )
                continue
            kind = {"int": int, "int | None": int, "float": float, "float | None": float}.get(f.type, str)
            if meta.get("positional") and positional:
                nargs = "*" if positional == "many" else "?"
                parser.add_argument(f.name, nargs=nargs, default=default, type=kind, **kwargs)
            else:
                parser.add_argument(_flag(f.name), dest=f.name, default=default, type=kind, **kwargs)


def _default_note(default, help_text: str) -> str:
    """" (default: X)" for --help, unless there is none to show or the help already says it."""
    if default is None or "default" in help_text.lower():
        return ""
    if isinstance(default, bool):
        return f" (default: {'on' if default else 'off'})"
    return f" (default: {default})".replace("%", "%%")


def from_namespace(cls, namespace: argparse.Namespace):
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(namespace).items() if k in names})


def split_kwargs(kwargs: dict, *config_classes):
    """Python API: route keyword arguments to config dataclasses by name."""
    built = []
    remaining = dict(kwargs)
    for cls in config_classes:
        names = {f.name for f in dataclasses.fields(cls)}
        built.append(cls(**{k: remaining.pop(k) for k in list(remaining) if k in names}))
    if remaining:
        raise TypeError(f"unknown settings: {', '.join(sorted(remaining))}")
    return built
