"""One entry point for every kind of model source."""

import copy
import functools
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlxserve.models.files import ModelLoadError

DEFAULT_CONTEXT_LENGTH = 4096
# Files a model folder needs; Hugging Face downloads fetch only these.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "*.txt"]
DTYPES = ("float32", "float16", "bfloat16")
DEFAULT_DUMMY = "qwen3-0.6b"  # the shape of --load-format dummy without a source


@dataclass
class LoadedModel:
    model: Any  # an mlx-lm model (mlx.nn.Module)
    tokenizer: Any  # mlx_lm.tokenizer_utils.TokenizerWrapper
    fingerprint: str  # stable hex id of weights + quantization + dtype
    name: str  # the name to serve it under
    context_length: int  # most tokens of prompt + output
    config: dict
    source: str  # what the user passed
    vision: Any = None  # a VisionAdapter for vision-language models (`model` is then its text half)
    draft: "LoadedModel | None" = None  # the draft model of speculative decoding (load_draft)
    tokenizer_dir: Path | None = None  # where the tokenizer was read from (an engine process's parent reads it too)
    # Weights held in another process (an engine process's parent has no `model`): their bytes.
    remote_weights_nbytes: int | None = None

    @property
    def vocab_size(self) -> int:
        """Rows of the model's vocabulary (its text config's, for nested configs); 0 if unknown."""
        from mlxserve.models.shapes import text_config

        return text_config(self.config).get("vocab_size") or 0

    def with_vision(self, processor_config: dict) -> "LoadedModel":
        """For a VLM: wrap it in its family's adapter; `model` becomes the text half."""
        from mlxserve.models.vlm import is_vlm_config
        from mlxserve.models.vlm_generic import make_adapter

        if is_vlm_config(self.config) and self.vision is None:
            self.vision = make_adapter(self.model, self.config, processor_config, self.tokenizer)
            self.model = self.vision.text_model
        return self


def load(
    source: str | None = None,
    *,
    load_format: str = "auto",
    dtype: str | None = None,
    quantize_bits: int | None = None,
    seed: int = 0,
    progress: bool = True,
    sharding=None,
) -> LoadedModel:
    """Load a model from a built-in name, MLX folder, .gguf file or Hugging Face repo id.

    With `load_format="dummy"`, `source` is a named shape (see
    `mlxserve.models.dummy.SHAPES`) or a config.json (or its folder), and the
    weights are random (`seed`). `dtype` applies to converted and dummy
    models, and casts a folder's unquantized weights when given.
    `quantize_bits` (4 or 8) quantizes unquantized weights. `sharding`
    (models/sharding.py): load this rank's part of the model only.
    """
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if quantize_bits not in (None, 4, 8):
        raise ValueError(f"quantize_bits must be 4 or 8, not {quantize_bits}")
    if load_format == "dummy":
        return load_dummy(source or DEFAULT_DUMMY, dtype, quantize_bits, seed, sharding)
    if load_format != "auto":
        raise ValueError(f"load_format must be 'auto' or 'dummy', not {load_format!r}")

    from mlxserve.models.embedded import BUILTINS, builtin_model_dir, default_dtype

    key = "default" if source in (None, "") else source
    if key in BUILTINS:
        folder = builtin_model_dir(key, dtype=dtype, progress=progress)
        return load_folder(folder, served_name(source), key, None, quantize_bits, sharding)

    path = Path(source).expanduser()
    if source.lower().endswith(".gguf"):
        from mlxserve.models.gguf import convert_gguf_cached

        if not path.is_file():
            raise ModelLoadError(f"{source}: no such GGUF file")
        folder = convert_gguf_cached(path, dtype=dtype or default_dtype(), progress=progress)
        return load_folder(folder, served_name(source), source, None, quantize_bits, sharding)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{source}: the folder has no config.json, so it is not an MLX model folder")
        return load_folder(path, served_name(source), source, dtype, quantize_bits, sharding)

    tried = [
        f"not a folder ({path.resolve()} does not exist)",
        "not a .gguf file",
        f"not a built-in name ({', '.join(BUILTINS)})",
    ]
    from mlxserve.models.shapes import SHAPES

    if source in SHAPES:
        tried.append(f"{source!r} is a dummy shape: pass load_format='dummy' (--load-format dummy) for it")
    folder = hub_download(source, tried, progress)
    return load_folder(folder, served_name(source), source, dtype, quantize_bits, sharding)


def load_configured(m, sharding=None) -> LoadedModel:
    """The model of a config.ModelConfig (a served model's settings), with its draft model."""
    loaded = load(m.model, load_format=m.load_format, dtype=m.dtype, quantize_bits=m.quantize, seed=m.dummy_seed,
                  sharding=sharding)
    if m.draft_model:  # speculative decoding's proposer, loaded the same way
        load_draft(loaded, m.draft_model, load_format=m.load_format, dtype=m.dtype, quantize_bits=m.quantize,
                   seed=m.dummy_seed)
    return loaded


def served_name(source: str | None, load_format: str = "auto") -> str:
    """The name `load` gives the model of `source`, known without loading it (so a server
    can list, and route requests to, models it has not loaded yet)."""
    if load_format == "dummy":
        from mlxserve.models.shapes import SHAPES

        source = source or DEFAULT_DUMMY
        if source in SHAPES:
            return source
        path = Path(source).resolve()
        return path.parent.name if path.with_suffix("").name == "config" else path.with_suffix("").name
    from mlxserve.models.embedded import BUILTINS

    key = "default" if source in (None, "") else source
    if key in BUILTINS:
        return BUILTINS[key].name
    path = Path(source).expanduser()
    if source.lower().endswith(".gguf"):
        return path.name.removesuffix(".gguf")
    if path.is_dir():
        return path.resolve().name
    return source  # a Hugging Face repo id


def load_draft(target: LoadedModel, source: str, *, load_format: str = "auto", dtype: str | None = None,
               quantize_bits: int | None = None, seed: int = 0, progress: bool = True) -> LoadedModel:
    """Load `source` as the target's draft model (`target.draft`), like the target is loaded.

    A draft proposes token ids the target checks, so both must read ids the
    same way: a draft whose tokenizer's vocabulary differs is refused.
    """
    draft = load(source, load_format=load_format, dtype=dtype, quantize_bits=quantize_bits, seed=seed,
                 progress=progress)
    if draft.vision is not None:
        raise ModelLoadError(f"--draft-model {source}: a vision-language model cannot be a draft model")
    check_same_vocabulary(target, draft)
    target.draft = draft
    return draft


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Raise ModelLoadError (one line) unless both tokenizers map the same strings to the same ids."""
    ours, theirs = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if ours != theirs:
        differ = sum(1 for t, i in ours.items() if theirs.get(t) != i) + len(theirs.keys() - ours.keys())
        raise ModelLoadError(
            f"--draft-model {draft.source}: its vocabulary ({len(theirs)} tokens) is not {target.name}'s "
            f"({len(ours)} tokens, {differ} differ); a draft model must share the model's tokenizer")


def load_dummy(source: str, dtype, quantize_bits, seed, sharding=None) -> LoadedModel:
    from mlxserve.models.dummy import INIT_VERSION, build_dummy, resolve_config
    from mlxserve.models.shapes import SHAPES
    from mlxserve.models.embedded import default_dtype, default_tokenizer_dir

    try:
        config = resolve_config(source)
    except KeyError:
        raise ModelLoadError(
            f"{source}: not a named shape ({', '.join(SHAPES)}), a config.json or a folder holding one, "
            "nor an mlx-lm or mlx-vlm model type (a tiny config of it)"
        ) from None
    dtype = dtype or default_dtype()
    preprocessor = config.get("preprocessor_config", {})
    if sharding is not None:
        _no_vision_sharded(config, source)
    model, config = build_dummy(config, dtype=dtype, quantize_bits=quantize_bits, seed=seed, source=source,
                                sharding=sharding)
    blob = json.dumps(
        {"config": config, "seed": seed, "dtype": dtype, "bits": quantize_bits, "init": INIT_VERSION},
        sort_keys=True,
    )
    name = served_name(source, "dummy")
    tokenizer = default_tokenizer_with(tuple(config.get("added_tokens") or ()), config.get("chat_template"))
    materialize(model)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        fingerprint=hashlib.sha256(b"dummy\0" + blob.encode()).hexdigest(),
        name=name,
        context_length=context_length(config),
        config=config,
        source=source,
        tokenizer_dir=default_tokenizer_dir(),
    ).with_vision(preprocessor)


@functools.lru_cache(maxsize=1)
def default_tokenizer():
    """The default model's tokenizer, which every dummy model uses: read once per process
    (1.5-2 s on a CPU), one object for them all (nothing changes a tokenizer once loaded)."""
    from mlx_lm.utils import load_tokenizer

    from mlxserve.models.embedded import default_tokenizer_dir

    return load_tokenizer(default_tokenizer_dir())


def _no_vision_sharded(config: dict, source: str) -> None:
    from mlxserve.models.vlm import is_vlm_config

    if is_vlm_config(config):
        raise ModelLoadError(f"{source}: vision-language models are not served across processes yet; "
                             "serve it on one device")
    from mlxserve.models.vlm_text import is_vlm_text

    if is_vlm_text(config.get("model_type")):
        raise ModelLoadError(f"{source}: mlx-vlm's text models are not served across processes yet; "
                             "serve it on one device")


@functools.lru_cache(maxsize=16)
def default_tokenizer_with(added: tuple[str, ...], chat_template: str | None = None):
    """The default tokenizer with a tiny config's image tokens added and its chat template, if it
    names one (models/tiny_vlm.py): a copy made once per set of them (~1 s), shared like
    default_tokenizer itself."""
    if not added and chat_template is None:
        return default_tokenizer()
    from mlxserve.models.chat import hf_of

    tokenizer = copy.deepcopy(default_tokenizer())
    if added:
        hf_of(tokenizer).add_special_tokens({"additional_special_tokens": list(added)})
    if chat_template is not None:
        hf_of(tokenizer).chat_template = chat_template
    return tokenizer


def load_folder(folder: Path, name: str, source: str, dtype, quantize_bits, sharding=None) -> LoadedModel:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import load_model, load_tokenizer

    from mlxserve.models.vlm import is_vlm_config, load_vlm_weights, processor_config

    from mlxserve.models.architectures import text_model_classes
    from mlxserve.models.vlm_text import is_vlm_text, load_vlm_text
    from mlxserve.models.vlm_thinker import thinker_view

    folder = Path(folder)
    try:
        # Qwen3-Omni's thinker's settings where a VLM's are (models/vlm_thinker.py; mlx-vlm reads the file itself).
        config = thinker_view(json.loads((folder / "config.json").read_text()))
        vlm_text = is_vlm_text(config.get("model_type"))  # mlx-vlm's text-only types mlx-lm lacks
        if not is_vlm_config(config) and not vlm_text:
            text_model_classes(config, source)  # an unknown architecture: say so before reading weights
        if sharding is not None:
            _no_vision_sharded(config, source)
            # Lazily: a pipeline stage never reads the layers it drops, a tensor shard only its slices.
            model, config = load_model(folder, lazy=True)
            sharding.before_weights(model, config.get("model_type", "?"))
            sharding.after_weights(model)
        elif is_vlm_config(config):
            model = load_vlm_weights(folder)
        elif vlm_text:
            model = load_vlm_text(folder, source)
        else:
            model, config = load_model(folder)
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except ModelLoadError:
        raise
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{source}: cannot load the model folder {folder}: {e}") from e
    quantized = "quantization" in config
    if dtype is not None and not quantized:
        model.set_dtype(getattr(mx, dtype))
    if quantize_bits and not quantized:
        if hasattr(model, "check_quantizable"):  # mlx-vlm's text models (models/vlm_text.py)
            model.check_quantizable(source)
        nn.quantize(
            model,
            group_size=64,
            bits=quantize_bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
        config["quantization"] = {"group_size": 64, "bits": quantize_bits, "mode": "affine"}
    materialize(model)
    weight_dtype = str(next(v.dtype for _, v in _flat(model) if mx.issubdtype(v.dtype, mx.floating)))
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        fingerprint=folder_fingerprint(folder, weight_dtype, config.get("quantization")),
        name=name,
        context_length=context_length(config),
        config=config,
        source=source,
        tokenizer_dir=folder,
    ).with_vision(processor_config(folder))


def materialize(model) -> None:
    """Evaluate every array the model's modules hold, not only their parameters.

    Some classes keep lazily computed arrays in private attributes (mlx-lm's
    rotary embeddings keep `_freqs`). MLX streams belong to the thread that
    made them, so such an array, first evaluated on the engine thread, fails
    with "There is no Stream(cpu, 0) in current thread" (Gemma 4, Llama 3 RoPE).
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlx.nn as nn

    arrays = []
    for _, module in model.named_modules():
        # Private entries (`_freqs`) sit in the module's dict, which `parameters()` skips.
        for value in [*module.values(), *vars(module).values()]:
            arrays += [a for _, a in tree_flatten(value) if isinstance(a, mx.array)]
            if not isinstance(value, (nn.Module, mx.array)) and hasattr(value, "__dict__"):
                # A helper object's arrays (mlx-vlm's PixtralRotaryEmbedding is no Module).
                arrays += [a for a in vars(value).values() if isinstance(a, mx.array)]
    mx.eval(arrays)


def _flat(model):
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def context_length(config: dict) -> int:
    for c in (config, config.get("text_config") or {}):
        for key in ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions"):
            if isinstance(c.get(key), int) and c[key] > 0:
                return c[key]
    return DEFAULT_CONTEXT_LENGTH


def folder_fingerprint(folder: Path, dtype: str, quantization) -> str:
    """Hash of what determines the weights, cheap even for large folders.

    A folder converted from a GGUF records the file's sha256. Otherwise:
    config.json, and per weight file its name, size, mtime, safetensors
    header (tensor names, shapes, offsets) and 16 evenly spaced 64 KiB
    samples of the data. Stable across restarts; any re-write of a weight
    file changes its mtime and so the fingerprint.
    """
    h = hashlib.sha256()
    h.update(json.dumps({"dtype": dtype, "quantization": quantization}, sort_keys=True).encode())
    source = folder / "mlxserve_source.json"
    if source.is_file() and json.loads(source.read_text()).get("sha256"):
        info = json.loads(source.read_text())
        h.update(f"gguf\0{info['sha256']}\0{info['dtype']}".encode())
        return h.hexdigest()
    h.update((folder / "config.json").read_bytes())
    for path in sorted(folder.glob("*.safetensors")):
        st = path.stat()
        h.update(f"\0{path.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        with open(path, "rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            h.update(f.read(min(header_len, 100_000_000)))
            for i in range(16):
                f.seek(st.st_size * i // 16)
                h.update(f.read(1 << 16))
    return h.hexdigest()


def hub_download(repo_id: str, tried: list[str], progress: bool) -> Path:
    """snapshot_download that fails fast and says what to do when the hub is unreachable."""
    import huggingface_hub
    from huggingface_hub import snapshot_download
    from huggingface_hub.utils import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        validate_repo_id,
    )

    def fail(reason: str):
        return ModelLoadError(f"Cannot load model {repo_id!r}: " + "; ".join(tried + [reason]))

    try:
        validate_repo_id(repo_id)
    except HFValidationError as e:
        raise fail(f"not a Hugging Face repo id ({e})") from None

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it now.
    offline = os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    advice = (
        "Download it on a machine with internet access (e.g. `hf download "
        f"{repo_id}`), copy the folder here and pass its path, or run without a model "
        "argument to use the built-in default model."
    )
    if not progress:
        huggingface_hub.utils.disable_progress_bars()
    try:
        path = snapshot_download(
            repo_id, allow_patterns=HUB_PATTERNS, local_files_only=offline, etag_timeout=5
        )
    except (RepositoryNotFoundError, GatedRepoError) as e:
        raise fail(f"Hugging Face hub: {type(e).__name__}: {str(e).splitlines()[0]}") from None
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face hub is unreachable"
        raise fail(f"hub lookup failed: {why} and it is not in the local Hugging Face cache. {advice}") from None
    except Exception as e:  # network errors come from httpx/requests, whichever is installed
        raise fail(f"hub lookup failed ({type(e).__name__}: {e}). {advice}") from None
    finally:
        if not progress:
            huggingface_hub.utils.enable_progress_bars()
    return Path(path)


def save_folder(loaded: LoadedModel, out_dir) -> Path:
    """Write a loaded model as a plain MLX folder (config, safetensors, tokenizer).

    Any mlx-lm tool can load the result: `mlxserve convert` uses this to give
    peers (mlx_lm.server) the very same weights, e.g. of a dummy model.
    """
    from mlx_lm.utils import save_config, save_model

    from mlxserve.models.files import atomic_dir

    out = Path(out_dir)
    with atomic_dir(out) as tmp:
        save_model(tmp, loaded.model)
        save_config(dict(loaded.config), config_path=tmp / "config.json")
        loaded.tokenizer._tokenizer.save_pretrained(tmp)
    return out
