"""Which architectures mlx-lm and mlx-vlm can build, and one-line errors for configs they cannot."""

from __future__ import annotations

import pkgutil
from importlib.metadata import version

from mlxserve.models.files import ModelLoadError

# Modules of mlx_lm.models that are shared code, not architectures.
_HELPERS = {"activations", "base", "bitlinear_layers", "cache", "gated_delta", "mla", "pipeline",
            "rope_utils", "ssm", "switch_layers"}


def text_architectures() -> list[str]:
    """The model types mlx-lm's model modules are named after."""
    import mlx_lm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_lm.models.__path__)
                  if m.name not in _HELPERS and not m.name.startswith("_"))


def text_model_classes(config: dict, source: str):
    """mlx-lm's (Model, ModelArgs) for `config`; a one-line ModelLoadError if it has none."""
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        from mlxserve.models.vlm import VLM_FAMILIES

        raise ModelLoadError(
            f"{source}: model type {config.get('model_type')!r} is not an architecture mlx-lm "
            f"{version('mlx-lm')} knows. Text models: {', '.join(text_architectures())}. "
            f"Vision-language models: {', '.join(VLM_FAMILIES)}."
        ) from None


def build_text_model(config: dict, source: str = "config"):
    """An mlx-lm model object for `config` (weights not loaded), or a one-line ModelLoadError."""
    model_class, args_class = text_model_classes(config, source)
    try:
        return model_class(args_class.from_dict(config))
    except Exception as e:  # noqa: BLE001 - a config the class cannot build: say why, in one line
        raise ModelLoadError(
            f"{source}: cannot build a {config.get('model_type')} model from this config: "
            f"{type(e).__name__}: {e}"
        ) from None
