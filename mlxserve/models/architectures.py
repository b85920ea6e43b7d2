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


def is_text_architecture(model_type: str) -> bool:
    """Whether mlx-lm builds `model_type` (with its remapping: "mistral" is its Llama)."""
    from mlx_lm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type) in text_architectures()


def _refused() -> dict[str, str]:
    import importlib.util

    import mlx.core as mx

    refused = {}
    if importlib.util.find_spec("hf_olmo") is None:
        # mlx-lm 0.32's olmo.py calls sys.exit(1) at import without it: the server would just end.
        refused["olmo"] = ("mlx-lm's OLMo (1) needs the ai2-olmo package (pip install ai2-olmo), "
                           "which is not installed")
    if not mx.metal.is_available():
        metal = "has no code path without Metal, which this machine lacks"
        refused["bitnet"] = f"mlx-lm's BitNet (ternary BitLinear layers, a Metal kernel) {metal}"
        refused["muse_spark"] = f"mlx-lm's Muse Spark (fused QK-norm/RoPE and routing Metal kernels) {metal}"
    return refused


# Model types mlxserve refuses at load, with why, on this machine (docs/architectures.md lists
# them; tests/test_architectures.py checks each is refused, so the list cannot go stale).
REFUSED: dict[str, str] = _refused()


def check_served(config: dict, source: str) -> None:
    """A one-line ModelLoadError if `config`'s model type is on REFUSED, or is mlx-vlm's and on
    vlm_architectures.VLM_REFUSED."""
    family = config.get("model_type")
    why = REFUSED.get(family)
    if why is None and isinstance(family, str) and not is_text_architecture(family):
        from mlxserve.models.vlm_architectures import VLM_REFUSED, package_of

        why = VLM_REFUSED.get(package_of(family))  # mlx-vlm's types served neither way (aliases too: "rf-detr")
    if why is not None:
        raise ModelLoadError(f"{source}: model type {family!r} cannot be served: {why}")


def text_model_classes(config: dict, source: str):
    """mlx-lm's (Model, ModelArgs) for `config`; a one-line ModelLoadError if it has none
    or mlxserve refuses it (REFUSED)."""
    from mlx_lm.utils import _get_classes

    check_served(config, source)
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
