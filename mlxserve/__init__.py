"""mlxserve: an inference server for LLMs and VLMs on MLX."""

from mlxserve._blas import preload_openblas

preload_openblas()  # must precede the first `import mlx`

__version__ = "0.1.0"

from mlxserve.engine.request import SamplingParams  # noqa: E402
from mlxserve.llm import LLM  # noqa: E402

__all__ = ["LLM", "SamplingParams", "__version__"]
