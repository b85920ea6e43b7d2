"""mlx-vlm's model types and how mlxserve serves each of them.

mlx-vlm's `mlx_vlm/models/` holds vision-language models (a vision tower beside a language
model that generates text), text-only copies of mlx-lm's models, and other kinds of model
(encoders, image generators, detectors). Each package is, here:

- served with images: a hand-written adapter (models/vlm.py ADAPTERS) or the generic one
  (models/vlm_generic.py FAMILIES);
- served as text: mlx-lm has the model type (a VLM's config without images, a text model);
- refused at load, with why (VLM_REFUSED, merged into models/architectures.py REFUSED).

tests/test_vlm_architectures.py checks every package is one of these, so the lists cannot
go stale; docs/architectures.md's VLM table is written from them.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import pkgutil


def vlm_packages() -> list[str]:
    """Every model package in mlx-vlm's `mlx_vlm/models/`."""
    import mlx_vlm.models

    return sorted(m.name for m in pkgutil.iter_modules(mlx_vlm.models.__path__) if m.ispkg)


def package_of(model_type: str) -> str:
    """mlx-vlm's package for a config's model type (its aliases remapped)."""
    from mlx_vlm.utils import MODEL_REMAPPING

    return MODEL_REMAPPING.get(model_type, model_type)


@functools.lru_cache(maxsize=None)
def is_vlm(model_type: str) -> bool:
    """Whether mlx-vlm's package for `model_type` is a vision-language model: its config has a
    vision tower's settings and its Model merges image features into the language model's input
    embeddings (`get_input_embeddings`). Imports that one package."""
    try:
        module = importlib.import_module(f"mlx_vlm.models.{package_of(model_type)}")
    except Exception:  # noqa: BLE001 - not a package, or one that cannot be imported here
        return False
    config, model = getattr(module, "ModelConfig", None), getattr(module, "Model", None)
    if config is None or model is None or not dataclasses.is_dataclass(config):
        return False
    fields = {f.name for f in dataclasses.fields(config)}
    thinker = getattr(module, "ThinkerConfig", None)  # Qwen3-Omni's: the vision tower is its thinker's
    if "thinker_config" in fields and thinker is not None and dataclasses.is_dataclass(thinker):
        fields |= {f.name for f in dataclasses.fields(thinker)}
    return "vision_config" in fields and hasattr(model, "get_input_embeddings")


def vlm_model_types() -> list[str]:
    """The vision-language packages of mlx-vlm (imports every package: ~8 s; tests and docs)."""
    return [p for p in vlm_packages() if is_vlm(p)]


def served_with_images(model_type: str) -> bool:
    from mlxserve.models.vlm import ADAPTERS
    from mlxserve.models.vlm_generic import FAMILIES

    return model_type in ADAPTERS or model_type in FAMILIES


def text_type(package: str) -> str | None:
    """The mlx-lm model type that serves mlx-vlm's `package` as text, if mlx-lm has one."""
    from mlx_vlm.utils import MODEL_REMAPPING

    from mlxserve.models.architectures import text_architectures

    from mlx_lm.utils import MODEL_REMAPPING as TEXT_REMAPPING

    names = [package, package.replace("_", "-")] + [a for a, p in MODEL_REMAPPING.items() if p == package]
    return next((n for n in names if TEXT_REMAPPING.get(n, n) in text_architectures()), None)


def state(package: str) -> tuple[str, str]:
    """How mlxserve serves mlx-vlm's `package`: ("images", adapter), ("text", mlx-lm type) or
    ("refused", why)."""
    if served_with_images(package):
        from mlxserve.models.vlm import ADAPTERS

        return "images", "hand-written adapter" if package in ADAPTERS else "generic adapter"
    if package in VLM_REFUSED:
        return "refused", VLM_REFUSED[package]
    served = text_type(package)
    if served is not None:
        return "text", served
    from mlxserve.models.vlm_text import is_vlm_text

    if is_vlm_text(package):
        return "vlm text", "mlx-vlm's own model classes"
    return "unknown", ""


# Reasons shared by several types.
NO_TEXT = "it generates no text to serve"
EMBEDDING = f"an embedding (retrieval) model: {NO_TEXT}"
ENCODER = f"an encoder (no output head over the vocabulary): {NO_TEXT}"
DECISION = f"a decision model (typed answers read off a scoring head): {NO_TEXT}"
IMAGE_GENERATOR = f"an image generation pipeline (diffusion or flow transformer): {NO_TEXT}"
DETECTOR = f"a detection, segmentation or geometry model: {NO_TEXT}"
DIFFUSION_LM = ("a diffusion language model: it fills masked positions in parallel over steps, not one token "
                "after another, which the engine's decoding loop is")
ENCODER_DECODER = ("an encoder-decoder model: its decoder cross-attends to the encoded image, so a prompt is not "
                   "one sequence of token embeddings that cached blocks can hold")
# Vision-language models the adapters do not cover yet: how the family's processor lays an
# image out in the prompt, which the generic adapter (models/vlm_generic.py: one run of image
# tokens per image, its count known from the image alone) does not render.
NOT_YET = "not served with images yet: {what}; mlx-lm has no text model of it either"
TILES = NOT_YET.format(what="its processor cuts an image into tiles or crops (and a thumbnail), with tokens "
                            "between rows or tiles")
# Families whose processor mlx-vlm does not have.
NO_PROCESSOR = ("mlx-vlm ships no processor for it (it takes whatever its checkpoint names through transformers' "
                "AutoProcessor): how an image is cut into the tower's input and how many tokens it takes are not in "
                "mlx-vlm, so mlxserve has no layout to follow or to test against")
AUDIO = NOT_YET.format(what="an omni model (audio and image towers); its image layout (tiles and their tokens) has "
                            "no adapter")


# mlx-vlm model types mlxserve refuses at load, with why: neither served with images nor a
# model type mlx-lm has. (architectures.REFUSED includes them; tests/test_vlm_architectures.py
# checks each is refused, and that the list names no type served otherwise.)
VLM_REFUSED: dict[str, str] = {
    # vision-language models
    "clef": DECISION,
    "colidefics3": EMBEDDING,
    "colqwen2_5": EMBEDDING,
    "d1": DECISION,
    "diffusion_gemma": DIFFUSION_LM,
    "falcon_perception": DETECTOR,
    "florence2": ENCODER_DECODER,
    "llmjpvl": NO_PROCESSOR,
    "mllama": ("cross-attention to the image (Llama 3.2 Vision): image states sit beside the prompt, not in it "
               "as token embeddings, so cached blocks cannot hold them"),
    "molmo_point": ("it decodes through a loop of its own: each step's logits are extended with point logits "
                    "computed from per-request image state kept on the model object (patch keys from the prompt "
                    "pass's hidden states), and generated point tokens are embedded with image features; the engine "
                    "batches plain logits, and a prefix-cache hit skips the pass that builds that state"),
    "nemotron_parse": ENCODER_DECODER,
    "qwen3_vl_embedding": EMBEDDING,
    "sam3": DETECTOR,
    "sam3_1": DETECTOR,
    "unlimited_ocr": ("its language model's RingSlidingKVCache keeps the prompt whole and generated tokens in a ring "
                      "of the last window_size, the ring starting at the cache's first one-token pass: mlx-vlm "
                      "prefills a prompt in one pass, but the engine's last prompt pass is one token for a prompt one "
                      "past a multiple of the prefill chunk, which would start the ring on the prompt's last token "
                      "and, window_size tokens later, drop it from attention (other tokens than mlx-vlm's)"),
    "youtu_vl": NO_PROCESSOR,
    "bert": ENCODER,
    "bonsai": IMAGE_GENERATOR,
    "d1_omni": DECISION,
    "decider2": DECISION,
    "dinov2": ENCODER,
    "embedding_gemma2": EMBEDDING,
    "ernie_image": IMAGE_GENERATOR,
    "flux2": IMAGE_GENERATOR,
    "flux3": IMAGE_GENERATOR,
    "gemma3_embedding": EMBEDDING,
    "gliner2_5": f"a span extraction (named entity) model: {NO_TEXT}",
    "ideogram4": IMAGE_GENERATOR,
    "laya": DECISION,
    "lfm2_colbert": EMBEDDING,
    "lfm2_embedding": EMBEDDING,
    "lfm2_encoder": ENCODER,
    "llada2_moe": DIFFUSION_LM,
    "llada_image": IMAGE_GENERATOR,
    "llama_bidirec": ENCODER,
    "llama_nemotron_vl_embedding": EMBEDDING,
    "mage_flow": IMAGE_GENERATOR,
    "ming_image": IMAGE_GENERATOR,
    "minimax_h3": f"an audio and video generation pipeline: {NO_TEXT}",
    "ministral3_embedding": EMBEDDING,
    "modernbert": ENCODER,
    "moge3": DETECTOR,
    "moss_image": IMAGE_GENERATOR,
    "nemotron_labs_diffusion": DIFFUSION_LM,
    "nemotron_voicechat": "a speech-to-speech model (audio in, audio out), not a text or vision-language model",
    "openai_privacy_filter": f"a token classifier (it labels spans of its input): {NO_TEXT}",
    "pp_doclayout_v3": DETECTOR,
    "qwen3_embedding": EMBEDDING,
    "qwen_image": IMAGE_GENERATOR,
    "rfdetr": DETECTOR,
    "rt_detr_v2": DETECTOR,
    "sam3d_body": DETECTOR,
    "sam3d_objects": DETECTOR,
    "sapiens2": DETECTOR,
    "siglip": ENCODER,
    "video_depth_anything": DETECTOR,
    "xlm_roberta": ENCODER,
    "yolo11": DETECTOR,
    "z_image": IMAGE_GENERATOR,
}
# mlx-vlm's other text-only packages mlx-lm lacks are served through mlx-vlm's own classes
# (models/vlm_text.py, tests/test_vlm_text.py).
