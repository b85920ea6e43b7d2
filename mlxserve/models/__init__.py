"""Model loading: built-in models, MLX folders, GGUF files, the Hugging Face hub and dummies."""

from mlxserve.models.files import ModelLoadError
from mlxserve.models.dummy import build_dummy
from mlxserve.models.shapes import list_shapes
from mlxserve.models.gguf import convert_gguf
from mlxserve.models.load import LoadedModel, load

__all__ = ["LoadedModel", "ModelLoadError", "build_dummy", "convert_gguf", "list_shapes", "load"]
