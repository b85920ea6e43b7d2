"""Vision towers whose size mlx-vlm fixes in code, sized by the config in random-weight builds.

mlx-vlm builds Phi-3-vision's CLIP ViT-L/14-336 tower from a constant (24 layers, 1024 wide,
whatever its config says) and FastVLM's FastViT-HD tower from class attributes of its
VisionConfig that `from_dict` never reads (stage depths and widths, 123M parameters): no tiny
config makes them small, so their generated tests ran a real-sized tower on every image.

Here the same classes are built at the sizes the config's vision_config gives, for the models
`build_vlm` makes (random weights: `--load-format dummy`, the tests; and the parent process's
weightless model, which only renders prompts). A config that gives no size, or the real ones,
builds mlx-vlm's tower unchanged, so every real config sizes it as before (tests compare the
parameter names and shapes with mlx-vlm's own build). Real checkpoints never pass here: their
weights load through mlx-vlm's load_model (models/vlm.py load_vlm_weights), untouched. What the
tower's forward pass or the image processor fixes stays fixed (Phi-3-vision's 336 px crops of 14 px
patches, 12 x 12 rows a crop; FastViT-HD's five stages, 64x downsampling, 32-wide attention
heads), so the tiny model runs the code a real one runs, on the same layout.
"""

from __future__ import annotations

# Phi-3-vision: the fields of its VisionConfig that size the CLIP constant's encoder.
PHI3_V_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
# FastVLM: the VisionConfig class attributes that size FastViT-HD's stages (its lengths, the stage
# count, stay five: the forward pass downsamples 64x through them) and the widening before the
# projector (mm_hidden_size = embed_dims[-1] * cls_ratio).
FASTVIT_SIZES = ("layers", "embed_dims", "mlp_ratios", "cls_ratio")


def _phi3_v(model, model_config, vision_config: dict) -> None:
    """mlx-vlm's VisionModel builds ClipVModel from CLIP_VIT_LARGE_PATCH14_336_CONFIG and sizes
    its separators and projector for a 1024-wide output; rebuilt with the config's sizes."""
    from types import SimpleNamespace

    import mlx.core as mx
    import mlx.nn as nn
    from mlx_vlm.models.phi3_v.vision import ClipVModel

    tower = model.model.vision_embed_tokens
    fixed = vars(tower.CLIP_VIT_LARGE_PATCH14_336_CONFIG)
    sizes = {k: getattr(model_config.vision_config, k) for k in PHI3_V_SIZES}
    if all(fixed[k] == v for k, v in sizes.items()):
        return  # the real tower, as mlx-vlm built it
    width = sizes["hidden_size"]
    tower.img_processor = ClipVModel(SimpleNamespace(**(fixed | sizes)))
    tower.image_dim_out = width
    tower.glb_GN = mx.zeros([1, 1, width * 4])
    tower.sub_GN = mx.zeros([1, 1, 1, width * 4])
    tower.img_projection[0] = nn.Linear(width * 4, model_config.hidden_size)


def _fastvlm(model, model_config, vision_config: dict) -> None:
    """mlx-vlm's FastViTHDModel reads its stages off VisionConfig class attributes, which
    from_dict drops from a config: those the config gives are set and the tower rebuilt."""
    from mlx_vlm.models.fastvlm.vision import VisionModel

    vc = model_config.vision_config
    given = {k: vision_config[k] for k in FASTVIT_SIZES if k in vision_config}
    if all(getattr(vc, k) == v for k, v in given.items()):
        return  # the real tower, as mlx-vlm built it
    stages = len(vc.layers)
    if any(len(given.get(k, ())) not in (0, stages) for k in ("layers", "embed_dims", "mlp_ratios")):
        raise ValueError(f"FastViT-HD has {stages} stages (its forward pass fixes them): vision_config gives "
                         + ", ".join(f"{k} {v}" for k, v in given.items()))
    for k, v in given.items():
        setattr(vc, k, v)
    model.vision_tower = VisionModel(vc)


TOWERS = {"phi3_v": _phi3_v, "fastvlm": _fastvlm}


def size_fixed_tower(model, model_config, config: dict) -> None:
    """Rebuild, at the config's sizes, a tower mlx-vlm sizes in code (no-op for other types and
    for configs that give the real sizes or none)."""
    fix = TOWERS.get(config.get("model_type"))
    if fix is not None:
        fix(model, model_config, config.get("vision_config") or {})
