"""Tiny configs of mlx-vlm's vision-language model types, built from their config classes: a
few text and vision layers, small widths and the default tokenizer's vocabulary, for
random-weight tests of every VLM architecture (`--load-format dummy` with a bare model type,
e.g. `mlxserve serve glm4v --load-format dummy`).

The text half is filled as models/tiny.py fills mlx-lm's ModelArgs (the same size rules, by
field name); the vision half by VISION's rules, by field name too. Image token ids are the
Qwen vocabulary's vision tokens, chosen by the field's name. What names cannot tell is in
OVERRIDES, per type; each type's image settings (preprocessor_config.json) are its family's
(models/vlm_generic.py).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib

from mlxserve.models.shapes import QWEN_VOCAB, SHAPES
from mlxserve.models.tiny import HIDDEN, _fill, _merge
from mlxserve.models.vlm_prefix import CHAT_TEMPLATE as PALIGEMMA_TEMPLATE

# The Qwen vocabulary's vision tokens stand in for every family's image tokens.
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 151655, 151656, 151652, 151653
EOS = 151645  # <|im_end|>

VISION_WIDTH = 32
# Vision field names -> tiny value. Images are small (a 64 px tower input, 16 px patches).
VISION_SIZES = {
    ("hidden_size", "embed_dim", "width", "vision_width", "d_model"): VISION_WIDTH,
    ("num_hidden_layers", "depth", "num_layers", "n_layers", "encoder_layers"): 2,
    ("num_attention_heads", "num_heads", "heads", "n_heads", "num_key_value_heads"): 2,
    ("intermediate_size", "mlp_dim", "ffn_dim", "intermediate_dim"): 64,
    ("head_dim",): 16,
    ("image_size",): 64,
    ("patch_size", "spatial_patch_size"): 16,
    ("spatial_merge_size", "temporal_patch_size"): 2,
    ("num_position_embeddings",): 64,
    ("out_hidden_size", "projection_dim", "text_hidden_size"): HIDDEN,
}
VISION_VALUES = {name: value for names, value in VISION_SIZES.items() for name in names}


def token_id(name: str) -> int | None:
    """The stand-in id of an image-token field, by its name; None for other fields."""
    if "video" in name and "token" in name:
        return VIDEO_PAD
    if not any(k in name for k in ("image", "vision", "media", "boi", "eoi", "im_")):
        return None
    if any(k in name for k in ("start", "begin", "boi")):
        return VISION_START
    if any(k in name for k in ("end", "eoi")):
        return VISION_END
    if name in ("image_token_id", "image_token_index", "media_placeholder_token_id", "im_patch_token"):
        return IMAGE_PAD
    return None


def vlm_module(model_type: str):
    """mlx-vlm's package for a model type (with mlx-vlm's remapping)."""
    from mlx_vlm.utils import MODEL_REMAPPING

    return importlib.import_module(f"mlx_vlm.models.{MODEL_REMAPPING.get(model_type, model_type)}")


def _default(args_class, name: str):
    f = args_class.__dataclass_fields__.get(name)
    return None if f is None or f.default is dataclasses.MISSING else f.default


def _fill_vision(args_class) -> dict:
    out = {}
    for f in dataclasses.fields(args_class):
        if f.name in VISION_VALUES:
            out[f.name] = VISION_VALUES[f.name]
    return out


def tiny_vlm_config(model_type: str) -> dict:
    """A small random-weight-ready config of mlx-vlm's `model_type` with its image settings
    (`preprocessor_config`); a one-line ModelLoadError for a type mlxserve refuses."""
    from mlxserve.models.architectures import check_served
    from mlxserve.models.vlm_generic import family_of

    check_served({"model_type": model_type, "vision_config": {}}, model_type)
    if model_type in SHAPED:
        return copy.deepcopy(SHAPES[SHAPED[model_type]])
    module = vlm_module(model_type)
    text_type = _default(module.TextConfig, "model_type") or model_type
    text = _fill(module.TextConfig, text_type)
    if "tie_word_embeddings" in module.TextConfig.__dataclass_fields__:  # (Phi-4-SigLIP's takes no other field)
        text["tie_word_embeddings"] = False
    vision = _fill_vision(module.VisionConfig)
    # The class's own vision model type, else the model type (what most towers accept).
    vision["model_type"] = _default(module.VisionConfig, "model_type") or model_type
    config = {"model_type": model_type, "tie_word_embeddings": False, "vocab_size": QWEN_VOCAB,
              "hidden_size": HIDDEN, "eos_token_id": [EOS], "text_config": text, "vision_config": vision}
    for f in dataclasses.fields(module.ModelConfig):
        value = token_id(f.name)
        if value is not None:
            config[f.name] = value
    _merge(config, OVERRIDES.get(model_type, {}))
    if "thinker_config" in {f.name for f in dataclasses.fields(module.ModelConfig)}:  # Qwen3-Omni
        from mlxserve.models.vlm_thinker import tiny_thinker

        for key in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
            config.setdefault(key, token_id(key))
        config = tiny_thinker(config, _fill_vision(module.AudioConfig) | TINY_AUDIO)
    family = family_of(config)
    config["preprocessor_config"] = copy.deepcopy(family.tiny_preprocessor if family else
                                                  ADAPTER_PREPROCESSORS.get(model_type, {}))
    if family is not None and family.own is not None:
        _processor_spans_tokens(config, family)
    elif family is not None and family.image_processor is not None:
        _own_processor_tokens(config, family)
    return config


def _own_processor_tokens(config: dict, family) -> None:
    """A family whose own processor lays images out names its image tokens by text ("<image>",
    "<fake_token_around_image>"), which the default tokenizer lacks: they become added tokens of
    the tiny model's tokenizer (`added_tokens`, models/load.py load_dummy), past the vocabulary,
    which grows to hold them; the config's image token ids are theirs."""
    from mlxserve.models.chat import hf_of
    from mlxserve.models.load import default_tokenizer
    from mlxserve.models.vlm_images import own_processor

    tokenizer = copy.deepcopy(hf_of(default_tokenizer()))
    size = len(tokenizer)
    proc = own_processor(family.processor, family.image_processor, config["preprocessor_config"], tokenizer)
    # Those it reads off the tokenizer (SmolVLM's, InternVL's) and does not add itself.
    texts = [v for k, v in vars(proc).items() if k.endswith("_token") and isinstance(v, str) and v.startswith("<")]
    missing = [t for t in dict.fromkeys(texts) if tokenizer.convert_tokens_to_ids(t) in (None, tokenizer.unk_token_id)]
    if missing:  # then built again: it reads its token ids off the tokenizer as it is built
        tokenizer.add_special_tokens({"additional_special_tokens": missing})
        proc = own_processor(family.processor, family.image_processor, config["preprocessor_config"], tokenizer)
    config["added_tokens"] = tokenizer.convert_ids_to_tokens(list(range(size, len(tokenizer))))
    # The token the processor fills with image rows (Aya Vision's <|IMG_PATCH|>, not its <image> placeholder).
    image = getattr(proc, "image_token_id", None)
    if not isinstance(image, int):
        image = tokenizer.convert_tokens_to_ids(family.placeholder or proc.image_token)
    for key in family.image_token:
        if key in config:
            config[key] = image
    vocab = max(QWEN_VOCAB, len(tokenizer) + 64 - len(tokenizer) % 64)
    config["vocab_size"] = config["text_config"]["vocab_size"] = vocab


def _processor_spans_tokens(config: dict, family) -> None:
    """As _own_processor_tokens, for a processor models/vlm_spans.py builds: the tokens its
    ProcessorSpec names and those it adds itself become added tokens of the tiny tokenizer."""
    from mlxserve.models.chat import hf_of
    from mlxserve.models.load import default_tokenizer
    from mlxserve.models.vlm_spans import build_processor

    tokenizer = copy.deepcopy(hf_of(default_tokenizer()))
    size = len(tokenizer)
    given = config.get("added_tokens", [])  # its OVERRIDES' (Jina VLM's)
    tokenizer.add_special_tokens({"additional_special_tokens": [*given, *family.own.tokens]})
    proc = build_processor(family.processor, config["preprocessor_config"], tokenizer, family.image_processor)
    # Those the vocabulary has as plain text (MiniCPM-o's <unk>) too: made special, each is one token.
    added = tokenizer.convert_ids_to_tokens(list(range(size, len(tokenizer))))
    config["added_tokens"] = list(dict.fromkeys([*given, *family.own.tokens, *added]))
    image = getattr(proc, "image_token_id", None)
    if not isinstance(image, int):
        image = tokenizer.convert_tokens_to_ids(family.own.image_token or family.placeholder or proc.image_token)
    for key in family.image_token:
        if key in config:
            config[key] = image
    for key, text in (family.own.config_tokens or {}).items():
        config[key] = tokenizer.convert_tokens_to_ids(text)
    vocab = max(QWEN_VOCAB, len(tokenizer) + 64 - len(tokenizer) % 64)
    config["vocab_size"] = config["text_config"]["vocab_size"] = vocab


# Types of the hand-written adapters (models/vlm.py) with a tiny named shape already.
SHAPED = {"qwen2_5_vl": "qwen2.5-vl-tiny", "gemma3": "gemma3-vl-tiny", "llava": "llava-tiny"}
# The others' image settings: 14 px patches, at most 16 tokens.
ADAPTER_PREPROCESSORS = {"qwen2_vl": SHAPES["qwen2.5-vl-tiny"]["preprocessor_config"]}

# Moondream's prompt starts with its image (its processor writes BOS, the image, then the question;
# mlx-vlm has no chat template for it): the tiny configs' template writes each message as it is, so a
# message that starts with its image starts the prompt with it.
IMAGE_FIRST = ("{%- for m in messages %}{{ m['content'] }}{%- endfor %}"
               "{%- if add_generation_prompt %}\n\nAnswer:{%- endif %}")
# 84 px crops of 14 px patches (36 rows an image), the whole image and at most 3 crops overlapping by a patch.
MOONDREAM = {"chat_template": IMAGE_FIRST, "vision_config": {"patch_size": 14, "crop_size": 84, "max_crops": 4,
                                                             "overlap_margin": 1, "proj_inner_dim": 64,
                                                             "proj_out_dim": HIDDEN}}

# DeepSeek-OCR's SAM, tiny (models/vlm_towers.py): SAMViTConfig's fields, in its checkpoints' vision_config.
DEEPSEEK_SAM = {"width": VISION_WIDTH, "layers": 2, "heads": 2, "global_attn_indexes": [], "prompt_embed_dim": 16,
                "downsample_channels": [VISION_WIDTH, VISION_WIDTH]}

# Qwen3-Omni's audio tower (built, not served): one 32-wide layer.
TINY_AUDIO = {"d_model": 32, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 64,
              "num_hidden_layers": 1, "output_dim": HIDDEN, "downsample_hidden_size": 16}

# What the field names cannot tell, per model type.
OVERRIDES: dict[str, dict] = {
    # Tiles of (64 / (16 x 2))^2 = 4 tokens (its processor's img_size, patch_size, downsample_factor).
    "aya_vision": {"downsample_factor": 2, "vision_config": {"model_type": "siglip_vision_model"}},
    # Deepstack rows from both tower blocks; sliding and full layers; M-RoPE sections of a 16-wide head.
    "cohere_compass": {"vision_config": {"deepstack_visual_indexes": [0, 1]},
                       "text_config": {"layer_types": ["sliding_attention", "full_attention"] * 2,
                                       "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                           "mrope_section": [2, 3, 3]}}},
    # Its merge asserts 729 rows: a 384 px SigLIP input of 14 px patches (its processor's fixed size); -200 marks
    # the image (models/vlm_standin.py).
    "llava_bunny": {"image_token_index": -200, "auto_map": {}, "mm_hidden_size": VISION_WIDTH,
                    "vision_config": {"model_type": "siglip_vision_model", "image_size": 384, "patch_size": 14}},
    "dots_ocr": {"vision_config": {"hidden_size": HIDDEN}},  # its tower's output width (embed_dim is its own)
    # Pixtral's [IMG_BREAK] and [IMG_END] (its processor's texts, not config ids in real configs); the
    # tower's rotary table covers image_size / patch_size patches a side, as far as the processor's
    # longest edge (its family's tiny_preprocessor) reaches (beyond it, positions would read past the table).
    "pixtral": {"image_break_token_id": VISION_START, "image_end_token_id": VISION_END},
    "mistral3": {"image_break_token_id": VISION_START, "image_end_token_id": VISION_END, "spatial_merge_size": 2,
                 "vision_config": {"image_size": 128}},
    "mistral_large3": {"image_break_token_id": VISION_START, "image_end_token_id": VISION_END,
                       "spatial_merge_size": 2, "vision_config": {"image_size": 128}},
    # Its projector pools 2 x 2 patches (its processor's downsample_ratio: models/vlm_generic.py DEEPSEEK_TINY).
    "deepseek_vl_v2": {"projector_config": {"input_dim": VISION_WIDTH, "n_embed": HIDDEN, "downsample_ratio": 2},
                       "vision_config": {"model_type": "vision"}},
    # Its processor's real sizes (a 1024 px global view, 273 rows; OCR 2's also a 768 px crop, 401 rows);
    # its SAM (and OCR 2's Qwen2 encoder) sized where real configs describe them (vision_config's width),
    # which models/vlm_towers.py reads: two windowed blocks (no global one), a 16-wide neck. A CLIP-L
    # layout (224 px, 14 px patches) 32 wide, fed SAM's rows (OCR 1); the projector takes both.
    "deepseekocr": {"vision_config": {"model_type": "vision", "layers": 2, "image_size": 224, "patch_size": 14,
                                      "width": {"sam_vit_b": DEEPSEEK_SAM}},
                    "projector_config": {"projector_type": "linear", "input_dim": 2 * VISION_WIDTH, "n_embed": HIDDEN}},
    "deepseekocr_2": {"vision_config": {"model_type": "vision", "width": {
                          "sam_vit_b": DEEPSEEK_SAM, "qwen2-0-5b": {"dim": VISION_WIDTH, "layers": 2, "heads": 2,
                                                                    "kv_heads": 1, "intermediate_size": 64}}},
                      "projector_config": {"projector_type": "linear", "input_dim": VISION_WIDTH, "n_embed": HIDDEN}},
    # Its perceiver pools each crop to image_seq_len latents (its family's processor_config).
    "idefics2": {"perceiver_config": {"model_type": "idefics2_perceiver", "num_key_value_heads": 2,
                                      "resampler_depth": 1, "resampler_head_dim": 16, "resampler_n_heads": 2,
                                      "resampler_n_latents": 4}},
    # 64 px tiles of 4 tokens (16 patches, shuffled 2x2), at most 4 tiles and a thumbnail.
    "internvl": {"max_dynamic_patch": 4},
    "internvl_chat": {"max_dynamic_patch": 4, "vision_config": {"model_type": "intern_vit_6b"}},
    # 140 px crops of 14 px patches, pooled 2 x 2 (its processor cut at the connector's size: models/vlm_patches.py
    # jina_crop_size): the thumbnail and one crop, 64 tokens an image (424 at its real 378 px, which left the tiny
    # model's tokens the same whatever the image or question). Its processor's token ids (151665-151668), which
    # the default vocabulary holds as unused [PAD...] entries: made special, they tokenize back to themselves.
    "jina_vlm": {"added_tokens": [f"[PAD{i}]" for i in range(151665, 151669)],
                 "image_start_token_id": 151666, "image_end_token_id": 151667,
                 "vision_config": {"image_size": 140, "patch_size": 14, "vit_layers": [-1, -2], "output_size": HIDDEN,
                                   "connector_hidden_size": 64}},
    # A 128 px input: 8 x 8 patches in windows of 4, 2 x 2 tokens after its two stride-2 convolutions.
    "got": {"vision_config": {"img_size": 128, "out_chans": 16, "out_dim": VISION_WIDTH, "window_size": 4,
                              "global_attn_indexes": [1]}},
    # Its QFormers' heads are 64 wide; features added at layer 0 (deepstack) and 1 (spatial). Text rows
    # scaled down (Granite's embedding multiplier is 12) so the greedy tokens turn on the image's features.
    "granite4_vision": {"image_grid_pinpoints": [[64, 64], [64, 128], [128, 64], [128, 128]], "downsample_rate": "2/4",
                        "deepstack_layer_map": [[-1, 0]], "spatial_target_layers": [1, 1, 1, 1],
                        "text_config": {"model_type": "granite", "embedding_multiplier": 0.1},
                        "vision_config": {"hidden_size": 64}},
    # Text rows scaled down (as granite4_vision's): at Granite's 12 the image changed no greedy token.
    "granite_vision": {"image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                       "text_config": {"embedding_multiplier": 0.1},
                       "vision_feature_layer": [-2, -1], "vision_config": {"image_size": 32}},
    "llava_next": {"image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                   "text_config": {"model_type": "llama"},  # its language model takes Llama's only
                   "vision_config": {"image_size": 32, "model_type": "clip_vision_model"}},
    # Its tiles' grids (its family's tiny_preprocessor), 32 px tiles.
    "llava_onevision": {"image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                        "vision_config": {"image_size": 32, "model_type": "siglip_vision_model"}},
    # Its image token is im_patch_id; text and media experts (two groups of 4) after a dense layer;
    # 3-D rotary sections of a 16-wide head; its resampler takes the tower's width.
    "ernie4_5_moe_vl": {"im_patch_id": IMAGE_PAD, "pixel_hidden_size": VISION_WIDTH, "freq_allocation": 2,
                        "vision_config": {"spatial_merge_size": 2},
                        "text_config": {"moe_num_experts": [4, 4], "moe_intermediate_size": [32, 32],
                                        "moe_layer_start_index": 1, "moe_layer_end_index": 3, "moe_k": 2,
                                        "mrope_section": [3, 3, 2], "freq_allocation": 2}},
    # Its FastViT-HD tower's stages (class attributes in mlx-vlm, 123M parameters) sized here by
    # models/vlm_towers.py: five stages of one block, attention in the last two (32-wide heads); a 192 px
    # image (its family's tiny_preprocessor), 3 x 3 rows after its 64x downsampling, 128 wide into the projector.
    "fastvlm": {"image_token_index": -200, "mm_hidden_size": 128,
                "vision_config": {"projection_dim": HIDDEN, "layers": [1, 1, 1, 1, 1],
                                  "embed_dims": [16, 16, 32, 32, 64]}},
    # Sliding and full layers, a dense MLP then experts; its relative band as short as the window.
    "inkling": {"vision_config": {"patch_size": 32},
                "text_config": {"layer_types": ["hybrid_sliding", "full_attention"] * 2,
                                "mlp_layer_types": ["dense", "moe", "moe", "moe"], "dense_intermediate_size": 128,
                                "rel_extent": 16, "d_rel": 4}},
    "mage_vl": {"vision_config": {"hidden_size": 2 * VISION_WIDTH}},  # its tower's heads: a multiple of 32 wide
    # Its text model is MiMo-V2-Flash's (mlx-lm's tiny layout: sliding and full layers, MoE after the first);
    # a small audio encoder (built whatever the request; its defaults are 235M parameters).
    "mimo_v2": {"text_config": {"hybrid_layer_pattern": [1, 0, 1, 0], "moe_layer_freq": [0, 1, 1, 1],
                                "partial_rotary_factor": 1},
                "audio_config": {"out_hidden_size": HIDDEN, "input_local_dim": 32, "input_local_attn_heads": 2,
                                 "input_local_head_dim": 16, "input_local_intermediate_size": 64,
                                 "input_local_layers": 1}},
    # 4 resampler queries an image (its family's image_feature_size); M-RoPE sections of a 16-wide head.
    "minicpmo": {"query_num": 4, "patch_size": 16, "image_size": 64,
                 "text_config": {"rope_scaling": {"type": "default", "mrope_section": [2, 3, 3]}}},
    # Its language model is Qwen3.5's (linear and full attention layers), M-RoPE sections of 8 rotary dims;
    # its tower merges 2 x 2 windows after its first block, then 2 x 2 again (16 patches a token).
    "minicpmv4_6": {"patch_size": 8, "image_size": 64, "insert_layer_id": 0,
                    "vision_config": {"patch_size": 8},
                    "text_config": {"rope_parameters": {"type": "default", "mrope_section": [2, 1, 1],
                                                        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}},
    # 4.6's, its language model's three M-RoPE axes told apart by its canvas positions; its tower 64 wide
    # (at 32 a darker image changed no greedy token).
    "minicpmv4_7": {"patch_size": 8, "image_size": 64, "insert_layer_id": 0,
                    "vision_config": {"patch_size": 8, "hidden_size": 2 * VISION_WIDTH},
                    "text_config": {"rope_parameters": {"type": "default", "mrope_section": [2, 1, 1],
                                                        "rope_theta": 10000.0, "partial_rotary_factor": 0.5}}},
    # Its text model is Nemotron-H's (mlx-lm's tiny layout: Mamba, attention, Mamba, MLP).
    "nemotron_h_nano_omni": {"img_context_token_id": IMAGE_PAD, "vit_hidden_size": VISION_WIDTH,
                             "projector_hidden_size": 2 * HIDDEN, "text_config": {"hybrid_override_pattern": "M*M-"}},
    # Its text settings are the config's own (no text_config); the image token its tokenizer has, added;
    # mlx-vlm's -200 index; a small audio encoder (built whatever the request).
    # GLM-5 Next: NoPE attention with as many KV heads as query heads; a linear-attention layer, then a sparse one
    # whose indexer picks 2 pools of 4 keys (fewer than a prompt's, so its PoolingCache decides what is attended).
    "glm5_next": {"text_config": {"num_key_value_heads": 4, "qk_rope_head_dim": 0, "num_hidden_layers": 2,
                                  "layer_types": ["linear_attention", "deepseek_sparse_attention"],
                                  "index_topk": 8, "index_kpool": 4, "linear_head_dim": 16, "linear_num_heads": 4},
                  "vision_config": {"projection_intermediate_size": 64}},
    # Qwen4-Exp: its QSA indexer keeps 16 of a prompt's keys (fewer than a prompt's: the selection decides).
    "qwen4_exp": {"text_config": {"indexer_budget": 16, "indexer_head_dim": 16}},
    # Qwen3-Omni: M-RoPE sections of a 16-wide head; deepstack rows from the tower's first block.
    "qwen3_omni_moe": {"text_config": {"rope_scaling": {"mrope_section": [2, 3, 3], "rope_type": "default"}},
                       "vision_config": {"deepstack_visual_indexes": [0]}},
    # PaliGemma's prompt as mlx-vlm makes it (models/vlm_prefix.py; BOS after the image where a tokenizer has
    # one); 96 px images, 36 tokens.
    "paligemma": {"vision_config": {"image_size": 96}, "chat_template": PALIGEMMA_TEMPLATE},
    "phi4mm": {"image_token_index": -200, "added_tokens": ["<|endoftext10|>"], "vocab_size": QWEN_VOCAB + 64,
               "num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "mm_hidden_size": VISION_WIDTH,
               "audio_processor": {"config": {"attention_dim": 32, "attention_heads": 2, "num_blocks": 1,
                                              "linear_units": 64, "ext_pw_out_channel": 32, "conv_channels": 32,
                                              "depthwise_seperable_out_channel": 32, "input_size": 80}}},
    # Its text settings are the config's own (no text_config); its CLIP ViT-L/14-336 tower (a constant in
    # mlx-vlm) sized by vision_config here (models/vlm_towers.py), at the 336 px crops of 14 px patches its
    # processor and merge fix: one crop and the whole image, 313 rows.
    "phi3_v": {"num_hidden_layers": 2, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "vision_config": {"image_size": 336, "patch_size": 14}},
    # 84 px crops of 6 x 6 patches, pooled to 3 x 3 tokens; its image tokens past the text vocabulary.
    "molmo": {"text_config": {"mlp_hidden_size": 128, "embedding_size": QWEN_VOCAB, "additional_vocab_size": 128},
              "vision_config": {"image_default_input_size": [84, 84], "image_num_pos": 37, "image_emb_dim": VISION_WIDTH,
                                "image_num_heads": 2, "image_num_key_value_heads": 2, "image_num_layers": 2,
                                "image_head_dim": 16, "image_mlp_dim": 64, "hidden_size": 64, "d_model": HIDDEN,
                                "vit_layers": [-1, -2], "intermediate_size": 14 * 14 * 3}},
    # 84 px crops of 6 x 6 patches, pooled to 3 x 3 tokens (its family's tiny_preprocessor).
    "molmo2": {"vision_config": {
        "vit_config": {"hidden_size": VISION_WIDTH, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "image_patch_size": 14,
                       "image_num_pos": 36, "image_default_input_size": [84, 84]},
        "adapter_config": {"hidden_size": VISION_WIDTH, "intermediate_size": 64, "text_hidden_size": HIDDEN,
                           "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16, "vit_layers": [-1, -2]}}},
    # A SigLIP tower on 64 px (16 tokens), a two-layer projector.
    "multi_modality": {"num_image_tokens": 16, "text_config": {"model_type": "llama"},
                       "vision_config": {"model_type": "vision", "cls": "SigLIPVisionTower", "params": {}},
                       "projector_config": {"cls": "MlpProjector", "model_type": "mlp_projector",
                                            "params": {"projector_type": "mlp_gelu", "depth": 2}}},
    # A SigLIP tower on 64 px tiles (16 tokens each), its projector 64 wide.
    "plamo2vl": {"vision_config": {"image_feature_size": VISION_WIDTH, "image_proj_hidden_size": HIDDEN}},
    # A SigLIP-2 NaFlex tower of 16 px patches, 4 to 16 of them an image (a 4 x 4 position grid).
    "phi4_siglip": {"mm_vision_tower": "siglip2-so400m-patch16-naflex", "mm_hidden_size": VISION_WIDTH,
                    "min_num_patches": 4, "max_num_patches": 16, "vision_config": {"num_patches": 16}},
    # A tower 64 wide: at 32 a darker image changed no greedy token (12 image rows of a 73-token prompt).
    "qwen3_5": {"vision_config": {"hidden_size": 2 * VISION_WIDTH}},
    "indic_ocr": {"vision_config": {"hidden_size": 2 * VISION_WIDTH}},  # Qwen3.5's
    "qwen2_vl": {"vision_config": {"hidden_size": HIDDEN, "patch_size": 14, "spatial_patch_size": 14},
                 "text_config": {"rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]}}},
    # Its image marks: Qwen's vision tokens and its object and box marks for its four registers; one frame.
    "falcon_ocr": {"img_id": IMAGE_PAD, "image_cls_token_id": VISION_START, "image_reg_1_token_id": 151646,
                   "image_reg_2_token_id": 151647, "image_reg_3_token_id": 151648, "image_reg_4_token_id": 151649,
                   "img_end_id": VISION_END, "vision_config": {"temporal_patch_size": 1}},
    # XD-RoPE's four sections of a 16-wide head, its base low enough that every axis turns (the image's
    # rows and columns change the tokens); a 128 px position table (8 x 8 patches, interpolated).
    "hunyuan_vl": {"vision_config": {"max_image_size": 128},
                   "text_config": {"rope_theta": 1000.0,
                                   "rope_scaling": {"type": "xdrope", "alpha": 1.0, "xdrope_section": [2, 2, 2, 2]}}},
    "moondream2": MOONDREAM,
    # Its rotary on half a 16-wide head; experts from the third layer; as many KV heads as heads (its
    # temperatures scale each head's values).
    "moondream3": {**MOONDREAM, "text_config": {"rope_dim": 8, "moe_start_layer": 2, "num_key_value_heads": 4}},
    # The processor's fixed sizes: a 728 px image, 14 px patches, downsampled 4x a side to 13 x 13 tokens.
    "step3p7": {"vision_config": {"image_size": 728, "patch_size": 14, "layers": 1}},
}
