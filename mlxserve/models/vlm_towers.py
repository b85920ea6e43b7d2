"""Vision towers whose size mlx-vlm fixes in code, sized by the config in random-weight builds.

mlx-vlm builds Phi-3-vision's CLIP ViT-L/14-336 tower from a constant (24 layers, 1024 wide,
whatever its config says), FastVLM's FastViT-HD tower from class attributes of its VisionConfig
that `from_dict` never reads (stage depths and widths, 123M parameters), DeepSeek-OCR's (1 and 2)
SAM ViT-B from SAMViTConfig's defaults and literal neck widths (12 layers, 768 wide), and OCR 2's
Qwen2 encoder 24 layers deep whatever the config: no tiny config makes them small, so their
generated tests ran (or would run) a real-sized tower on every image.

Here the same classes are built at the sizes the config gives (its vision_config), for the models
`build_vlm` makes (random weights: `--load-format dummy`, the tests; and the parent process's
weightless model, which only renders prompts). A config that gives no size, or the real ones,
builds mlx-vlm's tower unchanged, so every real config sizes it as before (tests compare the
parameter names and shapes with mlx-vlm's own build). Real checkpoints never pass here: their
weights load through mlx-vlm's load_model (models/vlm.py load_vlm_weights), untouched. What the
tower's forward pass or the image processor fixes stays fixed (Phi-3-vision's 336 px crops of 14 px
patches, 12 x 12 rows a crop; FastViT-HD's five stages, 64x downsampling, 32-wide attention
heads; SAM's 16 px patches, its 1024 px input's position table and two stride-2 convolutions), so
the tiny model runs the code a real one runs, on the same layout.
"""

from __future__ import annotations

# Phi-3-vision: the fields of its VisionConfig that size the CLIP constant's encoder.
PHI3_V_SIZES = ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
# FastVLM: the VisionConfig class attributes that size FastViT-HD's stages (its lengths, the stage
# count, stay five: the forward pass downsamples 64x through them) and the widening before the
# projector (mm_hidden_size = embed_dims[-1] * cls_ratio).
FASTVIT_SIZES = ("layers", "embed_dims", "mlp_ratios", "cls_ratio")
# DeepSeek-OCR (1 and 2): their configs describe SAM in vision_config's width["sam_vit_b"] (OCR 2's
# from_dict copies it to params["sam"]), which mlx-vlm's models never read: SAMViTConfig's defaults
# and literal neck widths (256, then 512) build it. Read here by SAMViTConfig's field names:
# prompt_embed_dim is the neck's width, downsample_channels[0] the next.
SAM_SIZES = ("width", "layers", "heads", "window_size", "global_attn_indexes", "prompt_embed_dim",
             "downsample_channels")
# DeepSeek-OCR 2's Qwen2 encoder: from_dict reads its dim from width["qwen2-0-5b"] and writes the rest.
QWEN2_SIZES = ("layers", "heads", "kv_heads", "intermediate_size")


def _phi3_v(model, model_config, config: dict) -> None:
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


def _fastvlm(model, model_config, config: dict) -> None:
    """mlx-vlm's FastViTHDModel reads its stages off VisionConfig class attributes, which
    from_dict drops from a config: those the config gives are set and the tower rebuilt."""
    from mlx_vlm.models.fastvlm.vision import VisionModel

    vc, vision_config = model_config.vision_config, config.get("vision_config") or {}
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


def _deepseek_ocr(model, model_config, config: dict) -> None:
    """mlx-vlm's DeepSeek-OCR models build SAMEncoder from SAMViTConfig() with literal neck widths
    (its output as wide as the tower after it: CLIP-L's 1024, OCR 2's Qwen2 896), and OCR 2's Qwen2
    encoder 24 layers deep whatever the config: rebuilt at the sizes the config's width gives."""
    import mlx.nn as nn
    from mlx_vlm.models.deepseekocr.config import SAMViTConfig
    from mlx_vlm.models.deepseekocr.sam import SAMEncoder

    width = (config.get("vision_config") or {}).get("width")
    width = width if isinstance(width, dict) else {}
    vc, ocr2 = model_config.vision_config, config["model_type"] == "deepseekocr_2"
    if ocr2:
        _qwen2_encoder(model, vc, width.get("qwen2-0-5b") or {})
    real = SAMViTConfig()
    code = {k: getattr(real, k) for k in SAM_SIZES} | {"prompt_embed_dim": 256, "downsample_channels": (512,)}
    given = {k: v for k, v in (width.get("sam_vit_b") or {}).items() if k in SAM_SIZES}
    given |= {"downsample_channels": tuple(given["downsample_channels"][:1])} if "downsample_channels" in given else {}
    sizes = code | {k: tuple(v) if isinstance(v, list) else v for k, v in given.items()}
    if all(sizes[k] == (tuple(v) if isinstance(v, (list, tuple)) else v) for k, v in code.items()):
        return  # the real tower, as mlx-vlm built it
    neck, (mid,) = sizes["prompt_embed_dim"], sizes["downsample_channels"]
    out = vc.params["qwen2"]["dim"] if ocr2 else vc.hidden_size
    sam = SAMEncoder(img_size=real.image_size, patch_size=real.patch_size, embed_dim=sizes["width"],
                     depth=sizes["layers"], num_heads=sizes["heads"], window_size=sizes["window_size"],
                     global_attn_indexes=tuple(sizes["global_attn_indexes"]), out_chans=neck, final_out_chans=out)
    sam.net_2 = nn.Conv2d(neck, mid, kernel_size=3, stride=2, padding=1, bias=False)
    sam.net_3 = nn.Conv2d(mid, out, kernel_size=3, stride=2, padding=1, bias=False)
    model.sam_model = sam


def _qwen2_encoder(model, vc, given: dict) -> None:
    from mlx_vlm.models.deepseekocr_2.config import Qwen2EncoderConfig
    from mlx_vlm.models.deepseekocr_2.vision import Qwen2Decoder2Encoder

    params = vc.params["qwen2"]  # what from_dict wrote: the config's dim, the code's depth and widths
    if all(given.get(k, params[k]) == params[k] for k in QWEN2_SIZES):
        return  # the real encoder, as mlx-vlm built it
    sizes = params | {k: given[k] for k in QWEN2_SIZES if k in given}
    model.vision_model.qwen2_encoder = Qwen2Decoder2Encoder(Qwen2EncoderConfig(**sizes))

TOWERS = {"phi3_v": _phi3_v, "fastvlm": _fastvlm, "deepseekocr": _deepseek_ocr, "deepseekocr_2": _deepseek_ocr}


def size_fixed_tower(model, model_config, config: dict) -> None:
    """Rebuild, at the config's sizes, a tower mlx-vlm sizes in code (no-op for other types and
    for configs that give the real sizes or none)."""
    fix = TOWERS.get(config.get("model_type"))
    if fix is not None:
        fix(model, model_config, config)
