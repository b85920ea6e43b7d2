"""Fast float32 matmuls for MLX's CPU backend on Linux.

The Linux `mlx-cpu` wheel bundles a reference BLAS: a 1024^3 float32 matmul
takes ~500 ms there and ~10 ms with OpenBLAS. Loading OpenBLAS with
RTLD_GLOBAL *before* MLX is imported makes MLX's `cblas_*` symbols resolve to
it. This module must run before the first `import mlx`.
"""

import ctypes
import ctypes.util
import os
import sys

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)

INSTALL_HINT = (
    "MLX's CPU backend is using its bundled reference BLAS{why}: float32 matmuls run about 30x "
    "slower. Install OpenBLAS and mlxserve loads it at start, with nothing to configure: "
    "`apt-get install libopenblas0-pthread` (Debian/Ubuntu), `dnf install openblas` (Fedora), "
    "or point MLXSERVE_OPENBLAS at a libopenblas.so."
)

openblas_path: str | None = None


def _find_openblas() -> str | None:
    explicit = os.environ.get("MLXSERVE_OPENBLAS")
    if explicit:
        return explicit
    for path in OPENBLAS_CANDIDATES:
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("openblas")


def preload_openblas() -> str | None:
    """Load OpenBLAS globally (Linux only). Returns its path, or None."""
    global openblas_path
    if not sys.platform.startswith("linux") or os.environ.get("MLXSERVE_NO_OPENBLAS"):
        return None
    if "mlx.core" in sys.modules:
        return openblas_path  # too late to interpose; keep whatever happened before
    path = _find_openblas()
    if path is None:
        return None
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return None
    openblas_path = path
    return path


def check_cpu_blas() -> str | None:
    """A warning when MLX runs on the CPU on Linux with its bundled reference BLAS.

    `pip install mlxserve` alone gets there silently: the mlx-cpu wheel vendors the reference
    Netlib BLAS/LAPACK, and no wheel on PyPI ships an OpenBLAS whose symbols are the standard
    `cblas_*` names MLX calls (numpy's and scipy's, and the scipy-openblas wheels, prefix them).
    """
    if not sys.platform.startswith("linux") or openblas_path is not None:
        return None
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:  # MLX-CUDA: matmuls run on the GPU
        return None
    why = " (MLXSERVE_NO_OPENBLAS is set)" if os.environ.get("MLXSERVE_NO_OPENBLAS") else ""
    return INSTALL_HINT.format(why=why)


def check_cuda_backend() -> str | None:
    """A warning when MLX's CUDA package is installed but MLX runs on the CPU.

    `mlx-cpu` and `mlx-cuda-13` both ship `mlx/lib/libmlx.so`; when pip installs
    both (`pip install '.[cuda]'` on Linux), whichever came last wins.
    """
    from importlib.metadata import PackageNotFoundError, version

    try:
        cuda_version = version("mlx-cuda-13")
    except PackageNotFoundError:
        return None
    import mlx.core as mx

    if hasattr(mx, "cuda") and mx.cuda.is_available():
        return None
    return (f"mlx-cuda-13 {cuda_version} is installed but MLX runs on the CPU: the CPU build's "
            "libmlx.so replaced it. Fix: pip install --force-reinstall --no-deps "
            f"mlx-cuda-13=={cuda_version}")
