"""Convert a llama.cpp GGUF file into an MLX model folder.

The folder is what `mlx_lm.utils.load` reads: `config.json`,
`model.safetensors` (dequantized weights, Hugging Face tensor names) and the
tokenizer files. Supported architectures: qwen2, llama, gemma3 (text).
"""

import json
import math
from pathlib import Path

import gguf
import numpy as np

from mlxserve.models.files import ModelLoadError, atomic_dir, cache_dir

# llama.cpp architecture -> mlx-lm model_type and HF class name.
ARCHITECTURES = {
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "llama": ("llama", "LlamaForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}

# Per-layer tensors, llama.cpp name -> HF name. Gemma 3 has four norms per
# block; llama.cpp calls the pre-MLP one `ffn_norm` in every architecture.
LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
GEMMA3_LAYER_TENSORS = {
    **LAYER_TENSORS,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# Tokens that end a chat turn. Chat templates emit them, so generation must
# stop on them even when the file's EOS is a different token.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>", "<|end_of_text|>")

# Gemma 3's chat format. Its GGUF files carry no template. There is no system
# role: a system prompt is prepended to the first user turn.
GEMMA3_CHAT_TEMPLATE = (
    "{%- macro text(content) -%}"
    "{%- if content is string -%}{{ content | trim }}"
    "{%- else -%}{%- for part in content if part['type'] == 'text' -%}{{ part['text'] | trim }}{%- endfor -%}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set prefix = text(messages[0]['content']) + '\n\n' -%}"
    "{%- set turns = messages[1:] -%}"
    "{%- else -%}"
    "{%- set prefix = '' -%}"
    "{%- set turns = messages -%}"
    "{%- endif -%}"
    "{%- for message in turns -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (prefix if loop.first else '') + text(message['content']) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def open_gguf(path) -> gguf.GGUFReader:
    """Open and sanity-check a GGUF file; any problem is a ModelLoadError."""
    path = Path(path)
    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError/struct errors
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from e
    size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > size:
            raise ModelLoadError(
                f"{path}: truncated GGUF file: tensor {t.name} ends at byte "
                f"{t.data_offset + t.n_bytes}, the file has {size} bytes"
            )
    return reader


def read_metadata(reader: gguf.GGUFReader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def make_config(md: dict, tensors: dict, path) -> dict:
    """config.json for mlx-lm from the GGUF metadata and tensor table."""
    arch = md.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: unsupported GGUF architecture {arch!r} (supported: {', '.join(ARCHITECTURES)})"
        )
    model_type, hf_class = ARCHITECTURES[arch]

    def get(key, default=None):
        value = md.get(f"{arch}.{key}", default)
        # GGUF stores float32: 1e-6 comes back as 9.99999997e-07.
        return float(f"{value:.7g}") if isinstance(value, float) else value

    hidden = int(get("embedding_length"))
    heads = int(get("attention.head_count"))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    layers = int(get("block_count"))
    # The embedding table, not the token list, fixes the vocab size: files may pad one or the other.
    vocab = tensors["token_embd.weight"].shape[-1] if "token_embd.weight" in tensors else None
    config = {
        "model_type": model_type,
        "architectures": [hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "vocab_size": int(vocab if vocab is not None else len(md["tokenizer.ggml.tokens"])),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensors,
    }
    if arch == "llama":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensors
        config["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    rope_scaling = make_rope_scaling(md, arch, tensors, head_dim, path)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch == "gemma3":
        pattern = sliding_window_pattern(md, layers, path)
        config.update(
            sliding_window=int(get("attention.sliding_window", 512)),
            sliding_window_pattern=pattern,
            layer_types=[
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)
            ],
            # Local layers' RoPE base; files that do not state it use Gemma 3's 10k.
            rope_local_base_freq=float(get("rope.freq_base_swa", 10000.0)),
            # llama.cpp's rule: the 27B model (62 layers) scales queries by
            # hidden/heads, the other sizes by head_dim.
            query_pre_attn_scalar=hidden // heads if layers == 62 else head_dim,
            hidden_activation="gelu_pytorch_tanh",
        )
    if "tokenizer.ggml.bos_token_id" in md and arch != "qwen2":
        config["bos_token_id"] = int(md["tokenizer.ggml.bos_token_id"])
    if "tokenizer.ggml.tokens" in md:
        config["eos_token_id"] = stop_token_ids(md)
    return config


def sliding_window_pattern(md: dict, layers: int, path) -> int:
    """Gemma 3 alternates 5 local layers with 1 global one; newer files say so per layer."""
    flags = md.get("gemma3.attention.sliding_window_pattern")
    if flags is None:
        return 6
    if isinstance(flags, (int, np.integer)):
        return int(flags)
    # A per-layer list of "is sliding" flags: mlx-lm only supports a period.
    flags = [bool(f) for f in flags]
    period = flags.index(False) + 1 if False in flags else layers + 1
    if any(flags[i] != ((i + 1) % period != 0) for i in range(len(flags))):
        raise ModelLoadError(f"{path}: gemma3 sliding-window layers are not periodic: {flags}")
    return period


def make_rope_scaling(md: dict, arch: str, tensors: dict, head_dim: int, path):
    kind = md.get(f"{arch}.rope.scaling.type")
    factor = md.get(f"{arch}.rope.scaling.factor")
    if "rope_freqs.weight" in tensors:
        return llama3_rope_scaling(md, arch, tensors["rope_freqs.weight"], head_dim, path)
    if kind in (None, "none") or factor in (None, 1.0):
        return None
    if kind == "linear":
        return {"type": "linear", "rope_type": "linear", "factor": float(factor)}
    raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r}")


def llama3_rope_scaling(md: dict, arch: str, rope_freqs, head_dim: int, path) -> dict:
    """Recover Llama 3's rope_scaling from the per-frequency factors llama.cpp stores.

    llama.cpp bakes `rope_scaling` into a `rope_freqs` tensor: 1 for short
    wavelengths, `factor` for long ones and a smooth ramp between. The ramp
    is linear in 1/wavelength, so two of its points give the low/high
    frequency factors once the original context length is known (8192 for
    every Llama 3.x; files may state it).
    """
    ratios = np.asarray(dequantize(rope_freqs), dtype=np.float64).reshape(-1)
    factor = float(ratios.max())
    original = int(md.get(f"{arch}.rope.scaling.original_context_length", 8192))
    base = float(md.get(f"{arch}.rope.freq_base", 10000.0))
    freqs = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / freqs
    ramp = np.where((ratios > 1 + 1e-4) & (ratios < factor - 1e-4))[0]
    if factor <= 1.0:
        return None
    if len(ramp) >= 2:
        # smooth = (original / wavelen - low) / (high - low), from 1/r = (1 - smooth)/factor + smooth
        smooth = (1 / ratios[ramp] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(original / wavelen[ramp], smooth, 1)
        low = -intercept / slope
        high = low + 1 / slope
    else:
        low, high = 1.0, 4.0
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": round(float(low), 4),
        "high_freq_factor": round(float(high), 4),
        "original_max_position_embeddings": original,
    }
    if not np.allclose(llama3_ratios(scaling, wavelen), ratios, rtol=1e-3):
        raise ModelLoadError(f"{path}: rope_freqs does not match Llama 3 rope scaling")
    return scaling


def llama3_ratios(scaling: dict, wavelen: np.ndarray) -> np.ndarray:
    low_wl = scaling["original_max_position_embeddings"] / scaling["low_freq_factor"]
    high_wl = scaling["original_max_position_embeddings"] / scaling["high_freq_factor"]
    smooth = (scaling["original_max_position_embeddings"] / wavelen - scaling["low_freq_factor"]) / (
        scaling["high_freq_factor"] - scaling["low_freq_factor"]
    )
    ramp = 1 / ((1 - smooth) / scaling["factor"] + smooth)
    return np.where(wavelen < high_wl, 1.0, np.where(wavelen > low_wl, scaling["factor"], ramp))


def stop_token_ids(md: dict) -> list[int]:
    tokens = md["tokenizer.ggml.tokens"]
    ids = [md.get("tokenizer.ggml.eos_token_id"), md.get("tokenizer.ggml.eot_token_id")]
    index = {t: i for i, t in enumerate(tokens) if t.startswith("<")}
    ids += [index.get(t) for t in END_OF_TURN_TOKENS]
    return sorted({int(i) for i in ids if i is not None})


def dequantize(t) -> np.ndarray:
    """A tensor as float32 in numpy (row-major) shape."""
    shape = tuple(int(d) for d in reversed(t.shape))
    if t.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        data = np.asarray(t.data)
    else:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
    return data.reshape(shape).astype(np.float32, copy=False)


def unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row order for `llama` files.

    Its converter interleaves each head's rotary halves (HF's rotate-half
    layout -> GGML's pairwise layout); this is the inverse.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_name(name: str, arch: str) -> str | None:
    """HF tensor name for a llama.cpp one; None for tensors with no weight (rope_freqs)."""
    stem, _, kind = name.rpartition(".")
    if stem in GLOBAL_TENSORS:
        return f"{GLOBAL_TENSORS[stem]}.{kind}"
    if stem == "rope_freqs":
        return None
    parts = stem.split(".")
    table = GEMMA3_LAYER_TENSORS if arch == "gemma3" else LAYER_TENSORS
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in table:
        return f"model.layers.{parts[1]}.{table[parts[2]]}.{kind}"
    raise KeyError(name)


def convert_weights(reader, config: dict, arch: str, dtype: str, path, progress: bool) -> dict:
    import mlx.core as mx
    from tqdm import tqdm

    mx_dtype = getattr(mx, dtype)
    weights = {}
    for t in tqdm(reader.tensors, desc=f"Converting {Path(path).name}", unit="tensor", disable=not progress):
        try:
            name = hf_name(t.name, arch)
        except KeyError:
            raise ModelLoadError(f"{path}: unexpected tensor {t.name!r} for architecture {arch}") from None
        if name is None:
            continue
        try:
            w = dequantize(t)
        except NotImplementedError as e:
            raise ModelLoadError(f"{path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from e
        if arch == "llama" and ".self_attn.q_proj." in name:
            w = unpermute(w, config["num_attention_heads"])
        elif arch == "llama" and ".self_attn.k_proj." in name:
            w = unpermute(w, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp stores 1 + w; mlx-lm's Gemma RMSNorm adds the 1
        weights[name] = mx.array(w).astype(mx_dtype)
        mx.eval(weights[name])
    return weights


def save_tokenizer(md: dict, out_dir, path) -> None:
    """Build a Hugging Face fast tokenizer from the GGUF metadata and save it.

    transformers can read a GGUF tokenizer itself, but its GGUF reader needs
    torch; its vocabulary-to-tokenizer builders do not, so we read the
    metadata with `gguf` and call those directly.
    """
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )

    arch = md.get("general.architecture")
    tok = {
        name: md[f"tokenizer.{key}"]
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in md
    }
    if "tokens" not in tok:
        raise ModelLoadError(f"{path}: the GGUF file has no tokenizer")
    try:
        backend, _ = convert_gguf_tokenizer(arch, tok)
    except Exception as e:
        raise ModelLoadError(f"{path}: cannot build its tokenizer ({e})") from e

    tokens = tok["tokens"]
    special = {}
    for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
        token_id = md.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            special[name] = tokens[int(token_id)]
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", tok.get("tokenizer_type") == "llama"))
    if arch == "qwen2":
        # Qwen files name <|endoftext|> as BOS and some set add_bos_token, but
        # Qwen's own tokenizer has no BOS and its chat template writes none.
        special.pop("bos_token", None)
        add_bos = False
    template = md.get("tokenizer.chat_template")
    if template is None and arch == "gemma3":
        template = GEMMA3_CHAT_TEMPLATE
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=add_bos,
        add_eos_token=bool(md.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=template,
        clean_up_tokenization_spaces=False,
        **special,
    )
    tokenizer.save_pretrained(str(out_dir))


def convert_gguf(gguf_path, out_dir, *, dtype: str = "float32", progress: bool = True, sha256: str | None = None) -> Path:
    """Convert `gguf_path` into an MLX model folder at `out_dir` (which must not exist).

    The folder appears atomically: on any error nothing is left behind.
    `sha256`, when known, is recorded in the folder for fingerprinting.
    """
    import mlx.core as mx

    out_dir = Path(out_dir)
    if out_dir.exists():
        raise FileExistsError(f"{out_dir} already exists")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype!r}")
    reader = open_gguf(gguf_path)
    md = read_metadata(reader)
    tensors = {t.name: t for t in reader.tensors}
    try:
        config = make_config(md, tensors, gguf_path)
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(f"{gguf_path}: missing or invalid model metadata ({type(e).__name__}: {e})") from e
    arch = md["general.architecture"]
    with atomic_dir(out_dir) as tmp:
        save_tokenizer(md, tmp, gguf_path)
        weights = convert_weights(reader, config, arch, dtype, gguf_path, progress)
        mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
        del weights
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        source = {"gguf": str(Path(gguf_path).resolve()), "sha256": sha256, "dtype": dtype}
        (tmp / "mlxserve_source.json").write_text(json.dumps(source, indent=2))
    return out_dir


def converted_path(gguf_path, dtype: str, sha256: str | None = None) -> Path:
    """Where the cached conversion of `gguf_path` lives.

    Keyed by the file's sha256 when the caller knows it (the built-in
    models); else by path, size and mtime, so a user's file is not hashed on
    every load and an edited file is converted again.
    """
    import hashlib

    p = Path(gguf_path).resolve()
    if sha256 is None:
        st = p.stat()
        key = hashlib.sha256(f"{p}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    else:
        key = sha256[:16]
    stem = p.name.removesuffix(".gguf")
    return cache_dir() / "converted" / f"{stem}-{key}-{dtype}"


def convert_gguf_cached(gguf_path, *, dtype: str = "float32", progress: bool = True, sha256: str | None = None) -> Path:
    """Convert once per (file, dtype); later calls return the cached folder."""
    out = converted_path(gguf_path, dtype, sha256)
    if (out / "config.json").is_file():
        return out
    if sha256 is None:
        # Hash now (seconds, once per conversion) so the fingerprint names the weights.
        from mlxserve.models.files import sha256_file

        sha256 = sha256_file(gguf_path) if Path(gguf_path).is_file() else None
    try:
        return convert_gguf(gguf_path, out, dtype=dtype, progress=progress, sha256=sha256)
    except FileExistsError:
        return out  # another process converted it meanwhile


def tokenizer_cache_path(sha256: str) -> Path:
    return cache_dir() / "tokenizers" / sha256[:16]


def convert_tokenizer_cached(gguf_path, sha256: str) -> Path:
    """Just the tokenizer of a GGUF (no weights are read), cached by sha256."""
    out = tokenizer_cache_path(sha256)
    if (out / "tokenizer.json").is_file():
        return out
    md = read_metadata(open_gguf(gguf_path))
    with atomic_dir(out) as tmp:
        save_tokenizer(md, tmp, gguf_path)
    return out


__all__ = ["convert_gguf", "convert_gguf_cached", "convert_tokenizer_cached", "open_gguf"]
