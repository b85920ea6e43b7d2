"""mlxserve: an inference server for LLMs and VLMs on MLX."""

from mlxserve._blas import preload_openblas
from mlxserve._cuda import prefer_mlx_attention, smaller_cuda_graphs

preload_openblas()  # must precede the first `import mlx`
prefer_mlx_attention()
smaller_cuda_graphs()

__version__ = "0.1.0"

from mlxserve.engine.request import SamplingParams  # noqa: E402
from mlxserve.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]
