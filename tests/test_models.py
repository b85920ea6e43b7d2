"""Model loading: GGUF conversion against reference weights, folders, dummies, errors."""

import json
import shutil
import time

import mlxserve  # noqa: F401 - preloads OpenBLAS before MLX is imported

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import _get_classes, save_config, save_model

from mlxserve.models import ModelLoadError, build_dummy, convert_gguf, list_shapes, load
from mlxserve.models.shapes import SHAPES
from mlxserve.models.embedded import default_tokenizer_dir

TOKENS = [1, 7, 42, 3, 200, 260, 17, 99]

# ---------------------------------------------------------------------------
# A tiny GGUF, written the way llama.cpp's converter writes one.

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_level_vocab():
    """A small byte-level BPE vocabulary: 256 bytes, a few merges, ChatML specials."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokens = [alphabet[b] for b in range(256)]
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ in"]
    tokens += [m.replace(" ", "") for m in merges]
    types = [1] * len(tokens)
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        tokens.append(special)
        types.append(3)  # control
    return tokens, types, merges


def hf_weights(arch: str, c: dict, rng) -> dict:
    """Random weights in Hugging Face layout (what the converted folder must contain)."""
    h, i, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    nq, nkv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]

    def mat(*shape):
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    def norm(n):
        return (1 + 0.2 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": mat(v, h), "model.norm.weight": norm(h)}
    if not c["tie_word_embeddings"]:
        w["lm_head.weight"] = mat(v, h)
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = norm(h)
        w[p + "post_attention_layernorm.weight"] = norm(h)
        w[p + "self_attn.q_proj.weight"] = mat(nq * d, h)
        w[p + "self_attn.k_proj.weight"] = mat(nkv * d, h)
        w[p + "self_attn.v_proj.weight"] = mat(nkv * d, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, nq * d)
        w[p + "mlp.gate_proj.weight"] = mat(i, h)
        w[p + "mlp.up_proj.weight"] = mat(i, h)
        w[p + "mlp.down_proj.weight"] = mat(h, i)
        if arch == "qwen2":
            for proj, n in (("q", nq), ("k", nkv), ("v", nkv)):
                w[p + f"self_attn.{proj}_proj.bias"] = (0.5 * rng.standard_normal(n * d)).astype(np.float32)
    return w


# HF name fragment -> llama.cpp name fragment (written independently of the converter's table).
TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{TO_GGUF[module]}.{kind}"


def llama_cpp_permute(w, n_heads):
    """llama.cpp's converter reorders Q/K rows of `llama` models like this."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_factors(scaling, head_dim, base):
    """The rope_freqs tensor llama.cpp writes for Llama 3 rope scaling."""
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi / base ** (-i / head_dim)
        old = scaling["original_max_position_embeddings"]
        lo, hi = scaling["low_freq_factor"], scaling["high_freq_factor"]
        if wavelen < old / hi:
            factors.append(1.0)
        elif wavelen > old / lo:
            factors.append(scaling["factor"])
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            factors.append(1 / ((1 - smooth) / scaling["factor"] + smooth))
    return np.array(factors, dtype=np.float32)


def write_tiny_gguf(path, arch: str, seed: int = 0):
    """Write a tiny `arch` GGUF; return (reference config, weights as stored after quantization)."""
    rng = np.random.default_rng(seed)
    tokens, types, merges = byte_level_vocab()
    c = {
        "model_type": arch,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": len(tokens),
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": arch == "llama",
    }
    if arch == "llama":
        c["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 8.0, "original_max_position_embeddings": 256}
    weights = hf_weights(arch, c, rng)

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_rope_freq_base(c["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|endoftext|>"))
    w.add_chat_template(CHATML)
    if arch == "llama":
        w.add_uint32("llama.rope.scaling.original_context_length", 256)
        w.add_tensor("rope_freqs.weight", llama3_factors(c["rope_scaling"], c["head_dim"], c["rope_theta"]))

    stored = {}
    for name, value in weights.items():
        data = value
        if arch == "llama" and "q_proj.weight" in name:
            data = llama_cpp_permute(value, c["num_attention_heads"])
        elif arch == "llama" and "k_proj.weight" in name:
            data = llama_cpp_permute(value, c["num_key_value_heads"])
        if name.endswith(("q_proj.weight", "up_proj.weight", "embed_tokens.weight", "lm_head.weight")):
            q = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(gguf_name(name), q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            # Q8_0 quantizes each row on its own, so it commutes with the row permutation.
            stored[name] = gguf.quants.dequantize(gguf.quants.quantize(value, gguf.GGMLQuantizationType.Q8_0),
                                                  gguf.GGMLQuantizationType.Q8_0)
        elif name.endswith("post_attention_layernorm.weight"):
            w.add_tensor(gguf_name(name), data.astype(np.float16))
            stored[name] = value.astype(np.float16).astype(np.float32)
        else:
            w.add_tensor(gguf_name(name), data)
            stored[name] = value
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return c, stored


def reference_model(config: dict, weights: dict):
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()])
    model.eval()
    return model


@pytest.fixture
def cache(tmp_path_factory, monkeypatch):
    """A private MLXSERVE_CACHE_DIR for conversions."""
    path = tmp_path_factory.mktemp("mlxserve-cache")
    monkeypatch.setenv("MLXSERVE_CACHE_DIR", str(path))
    return path


# ---------------------------------------------------------------------------
# GGUF conversion


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_gguf_conversion_matches_reference_weights(arch, tmp_path, cache):
    path = tmp_path / f"tiny-{arch}.gguf"
    config, weights = write_tiny_gguf(path, arch)
    lm = load(str(path), progress=False)

    assert lm.name == f"tiny-{arch}"
    assert lm.context_length == 2048
    for key in ("tie_word_embeddings", "num_key_value_heads", "head_dim", "vocab_size"):
        assert lm.config[key] == config[key], key
    if arch == "llama":
        assert lm.config["rope_scaling"] == config["rope_scaling"]

    x = mx.array([TOKENS])
    got = lm.model(x)
    want = reference_model(config, weights)(x)
    # Without undoing llama.cpp's Q/K permutation the logits are off by O(1).
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item(), mx.abs(got - want).max().item()

    # The tokenizer comes from the GGUF metadata.
    tok = lm.tokenizer
    text = "in the inn"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(" the")) == 1  # merges applied
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.encode("<|im_end|>") == [end]
    assert end in tok.eos_token_ids
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    # Cached: the second load does not convert again and has the same fingerprint.
    converted = list((cache / "converted").iterdir())
    assert len(converted) == 1
    again = load(str(path), progress=False)
    assert again.fingerprint == lm.fingerprint
    assert list((cache / "converted").iterdir()) == converted
    assert load(str(path), dtype="bfloat16", progress=False).fingerprint != lm.fingerprint


def test_truncated_gguf_fails_cleanly(tmp_path, cache):
    path = tmp_path / "broken.gguf"
    write_tiny_gguf(path, "qwen2")
    data = path.read_bytes()
    for size in (len(data) // 2, 64):
        path.write_bytes(data[:size])
        with pytest.raises(ModelLoadError, match="broken.gguf"):
            load(str(path), progress=False)
    leftovers = [p for p in cache.rglob("*")]
    assert not any(p.is_dir() and p.parent.name == "converted" for p in leftovers), leftovers
    assert not any(p.name.endswith(".tmp") for p in leftovers), leftovers


def test_unsupported_gguf_architecture(tmp_path, cache):
    path = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        convert_gguf(path, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------
# Folders, dummies, errors


def test_local_mlx_folder_loads(tmp_path):
    model, config = build_dummy("qwen3-tiny", dtype="float32", seed=3)
    folder = tmp_path / "my-model"
    save_model(folder, model)
    save_config(config, folder / "config.json")
    for f in default_tokenizer_dir().iterdir():
        shutil.copy(f, folder)

    lm = load(str(folder))
    assert lm.name == "my-model"
    assert lm.context_length == SHAPES["qwen3-tiny"]["max_position_embeddings"]
    x = mx.array([TOKENS])
    assert mx.array_equal(lm.model(x), model(x)).item()
    assert load(str(folder)).fingerprint == lm.fingerprint
    assert load(str(folder), dtype="bfloat16").fingerprint != lm.fingerprint


@pytest.mark.parametrize("shape", ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "lfm2-tiny", "qwen3.5-tiny",
                                   "gemma4-tiny", "gpt-oss-tiny"])
def test_dummy_shapes_load_with_peaked_logits(shape):
    lm = load(shape, load_format="dummy", dtype="float32")
    assert lm.name == shape
    assert lm.tokenizer.vocab_size >= 151_000
    assert (lm.config.get("text_config") or lm.config)["vocab_size"] == 151936
    # Greedy steps: the top-1/top-2 gap keeps argmax robust to rounding noise.
    tokens = list(TOKENS)
    gaps = []
    for _ in range(8):
        logits = lm.model(mx.array([tokens]))[0, -1]
        top2 = mx.sort(logits)[-2:]
        gaps.append((top2[1] - top2[0]).item())
        tokens.append(mx.argmax(logits).item())
    # A soft cap (Gemma 4: 30 * tanh(x / 30)) squashes the top logits together: half the gap.
    capped = bool(lm.config.get("final_logit_softcapping"))
    assert min(gaps) > 1e-3 and np.mean(gaps) > (0.25 if capped else 0.5), gaps
    assert len(set(tokens[len(TOKENS):])) > 1  # not stuck repeating one token


def test_dummy_from_config_and_quantized(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(SHAPES["llama-tiny"]))
    lm = load(str(tmp_path), load_format="dummy", quantize_bits=4)
    assert lm.config["quantization"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert lm.model(mx.array([TOKENS])).shape == (1, len(TOKENS), 151936)


def test_gemma3_tiny_has_local_and_global_layers():
    lm = load("gemma3-tiny", load_format="dummy", dtype="float32")
    layers = lm.model.layers
    local = [layer.self_attn.is_sliding for layer in layers]
    assert any(local) and not all(local) and sum(local) > len(local) / 2
    window = lm.config["sliding_window"]
    # A prompt longer than the window gives the same logits through the KV cache as in one pass.
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([list(range(1, 3 * window))])
    full = lm.model(tokens)[0, -1]
    cache = make_prompt_cache(lm.model)
    lm.model(tokens[:, :-1], cache=cache)
    step = lm.model(tokens[:, -1:], cache=cache)[0, -1]
    assert mx.allclose(full, step, atol=1e-3).item()


def test_fingerprints():
    a = load("llama-tiny", load_format="dummy", dtype="float32", seed=0)
    b = load("llama-tiny", load_format="dummy", dtype="float32", seed=0)
    c = load("llama-tiny", load_format="dummy", dtype="float32", seed=1)
    d = load("llama-tiny", load_format="dummy", dtype="float32", seed=0, quantize_bits=8)
    assert a.fingerprint == b.fingerprint
    assert len({a.fingerprint, c.fingerprint, d.fingerprint}) == 3
    x = mx.array([TOKENS])
    assert mx.array_equal(a.model(x), b.model(x)).item()
    assert not mx.array_equal(a.model(x), c.model(x)).item()


def test_dummy_weights_do_not_depend_on_the_random_state():
    """Parameters left to the class's own init (Qwen3.5's recurrent decay rates) are seeded too:
    one fingerprint, one set of weights, whatever ran before (a disk tier relies on it)."""
    x = mx.array([TOKENS])
    a = load("qwen3.5-tiny", load_format="dummy", dtype="float32")
    mx.random.uniform(shape=(3,))  # move the global generator on
    b = load("qwen3.5-tiny", load_format="dummy", dtype="float32")
    assert a.fingerprint == b.fingerprint
    assert mx.array_equal(a.model(x), b.model(x)).item()


def test_list_shapes():
    names = [name for name, _ in list_shapes()]
    for name in ("qwen3-0.6b", "qwen3-4b", "llama-3.2-1b", "gemma3-270m", "llama-tiny", "qwen3-tiny", "gemma3-tiny",
                 "qwen3.5-9b", "gemma4-e4b", "gpt-oss-20b"):
        assert name in names


def test_an_architecture_no_library_knows_fails_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "foo_bar", "hidden_size": 64}))
    for source, kwargs in ((str(tmp_path / "config.json"), dict(load_format="dummy")), (str(tmp_path), {})):
        with pytest.raises(ModelLoadError) as e:
            load(source, **kwargs)
        message = str(e.value)
        # Named before any weights are looked for, with what is supported instead.
        assert "model type 'foo_bar' is not an architecture mlx-lm" in message and "\n" not in message
        assert all(name in message for name in ("qwen3_5", "gemma4_text", "gpt_oss", "qwen2_5_vl"))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "hidden_size": 64}))
    with pytest.raises(ModelLoadError, match="cannot build a qwen3 model from this config: .*num_hidden_layers"):
        load(str(tmp_path), load_format="dummy")


def test_unknown_source_names_what_was_tried(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as e:
        load("no-such-model-anywhere")
    msg = str(e.value)
    for part in ("not a folder", "not a .gguf", "not a built-in name", "hub lookup failed"):
        assert part in msg, msg
    with pytest.raises(ModelLoadError, match="dummy"):
        load("qwen3-tiny")  # a shape name without load_format="dummy"
    with pytest.raises(ModelLoadError, match="named shape"):
        load("no-such-shape", load_format="dummy")


def test_hub_offline_fails_fast_with_advice(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # an empty hub cache
    start = time.monotonic()
    with pytest.raises(ModelLoadError) as e:
        load("some-org/some-model-that-is-not-cached")
    assert time.monotonic() - start < 10
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "pass its path" in msg and "default model" in msg, msg


# ---------------------------------------------------------------------------
# The embedded default model (converted once per machine, in the user cache)


@pytest.fixture(scope="session")
def default_model():
    return load(progress=False)


def test_default_model_knows_the_capital_of_france(default_model):
    from mlx_lm import generate

    lm = default_model
    assert lm.name == "Qwen2.5-Coder-0.5B-Instruct"
    assert lm.context_length == 32768
    prompt = lm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    out = generate(lm.model, lm.tokenizer, prompt, max_tokens=12)
    assert "Paris" in out, out


def test_gemma3_270m_completes_text():
    from mlx_lm import generate

    lm = load("gemma3-270m", progress=False)
    assert lm.config["sliding_window_pattern"] == 6
    out = generate(lm.model, lm.tokenizer, "def fibonacci(n):", max_tokens=12)
    assert "return" in out or "if n" in out, out
