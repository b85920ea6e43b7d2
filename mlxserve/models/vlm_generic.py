"""One adapter for the mlx-vlm families that follow its common interface.

mlx-vlm's models share `get_input_embeddings(input_ids, pixel_values, **image
inputs)`: ids -> the language model's input embeddings, the media rows merged
in, plus what the language model needs beside them (M-RoPE `position_ids`,
Qwen3-VL's `deepstack_visual_embeds` and `visual_pos_masks`, Gemma 4's
`per_layer_inputs`). This adapter uses it twice:

- an image's rows: `get_input_embeddings([image token] * n, its pixels)`, so
  the tower, projector and scaling are mlx-vlm's own; deepstack rows are kept
  beside them (an image is one `[n, 1 + k, D]` array in the vision cache);
- a prompt chunk: `get_input_embeddings(chunk ids)` without pixels gives the
  text rows the way the family scales them and its per-layer inputs (media
  ids zeroed); the image rows are spliced in, and the chunk's extras are
  passed to the language model with them.

A video is cut into frame groups (models/vlm.py `video_groups`), each encoded
like an image: `get_input_embeddings([video token] * n, pixel_values_videos=
its pixels, video_grid_thw=its grid)`, so a group is one vision-cache entry and
one extra key of the prefix blocks it falls in, as an image is.

What a family needs is read off the model (M-RoPE: the language model has
`get_rope_index`; deepstack: `deepstack_visual_indexes`; bidirectional image
attention: `use_bidirectional_attention`), and off the small FAMILIES table:
its image processor, the tokens around an image, how it takes video. A new
family that fits this interface is one FAMILIES entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from mlxserve.models.vlm import ImageInput, VisionAdapter
from mlxserve.models.vlm_images import VIDEOS, OwnLayout, image_processor
from mlxserve.models.vlm_layouts import LAYER_FEATURES, MODEL_FIXES
from mlxserve.models.vlm_spans import ProcessorSpans, ProcessorSpec, deepseek_vl2_spatial_crops
from mlxserve.models.vlm_standin import MARKED


# preprocessor_config.json of the tiny configs (models/tiny_vlm.py): images of at most 16 tokens.
QWEN_TINY = {"size": {"shortest_edge": 1024, "longest_edge": 16384}, "patch_size": 16, "merge_size": 2,
             "temporal_patch_size": 2, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}


@dataclass(frozen=True)
class Family:
    # models/vlm_images.py: a PROCESSORS key ("qwen", "gemma4", "pixtral", "kimi_vl"), a transformers image
    # processor's name or an mlx-vlm one's "module:Class" (patch grids)
    processor: str
    # The tokens before and after an image's run of image tokens: config keys of their ids, literal
    # texts ("<|img|>"), or None.
    wrap: tuple[str | None, str | None]
    video: str | None = None  # "qwen3": timestamped frame groups (vlm_images.QwenVideo); None: images only
    tiny_preprocessor: dict | None = None  # the tiny configs' preprocessor_config.json
    image_token: tuple[str, ...] = ("image_token_id", "image_token_index")  # config keys of the image token's id
    # A family whose own processor lays an image out (vlm_images.OwnLayout): `processor` is that
    # processor's "module:Class", this its image processor's (transformers' name or "module:Class").
    image_processor: str | None = None
    placeholder: str | None = None  # the text the processor expands into an image (its image_token)
    # A processor not shaped like Idefics3's (built on the tokenizer alone, outputs pointing into its
    # ids): what models/vlm_spans.py needs to know of it; `processor` is its "module:Class".
    own: ProcessorSpec | None = None
    # "index": the language model takes M-RoPE positions, but the family places every token at its
    # own index on all three axes (MiniCPM-o: its get_input_embeddings sets them so). "last": its
    # get_rope_index and language model keep the three axes last, (batch, seq, 3) (ERNIE 4.5 VL).
    positions: str | None = None
    # The language model's argument saying which tokens of a chunk are media, as its Model.__call__
    # gives it (with its image inputs): ERNIE 4.5 VL's token_type_ids (1: media experts), ZAYA1-VL's
    # visual_pos_masks (its vision LoRA). Decode steps (text) pass none.
    media_mask: str | None = None
    # A config key of the one id mlx-vlm's merge expands into all of an image's rows (Phi-4-MM's
    # -200 index, which no tokenizer gives): the tower is given that id alone, the prompt a run of
    # image_token, one a row.
    expands: str | None = None


QWEN3 = Family("qwen", ("vision_start_token_id", "vision_end_token_id"), video="qwen3", tiny_preprocessor=QWEN_TINY)
GLM4V = Family("Glm4vImageProcessorPil", ("vision_start_token_id", "vision_end_token_id"), tiny_preprocessor=QWEN_TINY)
# Kimi's chat templates: "image" between its media marks, as text (Kimi-VL's start, K2.5's begin).
KIMI_TINY = {"in_token_limit": 64, "merge_kernel_size": [2, 2], "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5]}
KIMI_IMAGE = ("media_placeholder_token_id", "image_token_index", "image_token_id")
# DeepSeek-VL2's processor settings (processor_config.json): 64 px tiles of 2 x 2 tokens, at most 2 x 2 tiles.
DEEPSEEK_TINY = {"processor_config": {"candidate_resolutions": [[64, 64], [64, 128], [128, 64], [128, 128]],
                                      "patch_size": 16, "downsample_ratio": 2}}
FAMILIES = {
    "qwen3_vl": QWEN3,
    "qwen3_vl_moe": QWEN3,
    "qwen3_5": QWEN3,
    "qwen3_5_moe": QWEN3,
    # ERNIE 4.5 VL: Qwen2-VL's patch grid (its own processor), one run between its image marks; 3-D rotary
    # positions with the axes last; media tokens through their own experts.
    "ernie4_5_moe_vl": Family("mlx_vlm.models.ernie4_5_moe_vl.processing_ernie4_5_moe_vl:ImageProcessor",
                              ("image_start_token_id", "image_end_token_id"), image_token=("im_patch_id",),
                              positions="last", media_mask="token_type_ids",
                              tiny_preprocessor={"min_pixels": 1024, "max_pixels": 16384, "patch_size": 16,
                                                 "merge_size": 2, "temporal_patch_size": 1}),
    # The whole image, a separator, then its tiles (a grid picked from candidate_resolutions), rows of
    # each ended by a newline row: one run of image tokens, placed by the processor's mask over its ids.
    "deepseek_vl_v2": Family("mlx_vlm.models.deepseek_vl_v2.processing_deepsek_vl_v2:DeepseekVLV2Processor",
                             (None, None), image_token=("image_token_index",), tiny_preprocessor=DEEPSEEK_TINY,
                             own=ProcessorSpec(pixels="images", inputs=("images_spatial_crop", "images_seq_mask"),
                                               masks=("images_seq_mask",), bos=True)),
    "glm4v": GLM4V,
    # GOT-OCR 2.0: one square tower input, its image tags' ids in the config (<img>, </img>, <imgpad>).
    "got": Family("got", ("im_start_token", "im_end_token"), image_token=("im_patch_token",)),
    "glm4v_moe": GLM4V,
    "glm_ocr": Family("Glm4vImageProcessorPil", ("image_start_token_id", "image_end_token_id"),
                      tiny_preprocessor=QWEN_TINY),
    # dots.ocr: its template's image marks are plain text, not ids in its config.
    # Cohere Compass: Qwen3-VL's layout (a patch grid between its vision marks, deepstack rows).
    "cohere_compass": Family("cohere_compass", ("vision_start_token_id", "vision_end_token_id"),
                             tiny_preprocessor=QWEN_TINY | {"min_pixels": 1024, "max_pixels": 16384}),
    "dots_ocr": Family("Qwen2VLImageProcessorPil", ("<|img|>", "<|endofimg|>"), tiny_preprocessor=QWEN_TINY),
    "indic_ocr": QWEN3,  # Qwen3.5 with an Indic vocabulary
    # MiMo-V2.6 (omni: its audio tower is not served): Qwen2.5-VL's image layout, one (1, h, w) grid an image.
    # MiniCPM-o (omni: its audio tower is not served) as mlx-vlm's processor renders an image: its
    # resampler's queries between <image> and </image>, <unk> each (4 queries of a 64 px image).
    "minicpmo": Family("mlxserve.models.vlm_omni:MiniCPMOImages", (None, None),
                       image_token=("<unk>",), placeholder="<image>", positions="index",
                       image_processor="mlx_vlm.models.minicpmo.processing_minicpmo:MiniCPMOImageProcessor",
                       tiny_preprocessor={"patch_size": 16, "scale_resolution": 64, "image_feature_size": 4},
                       own=ProcessorSpec(tokens=("<image>", "</image>", "<unk>", "<slice>", "</slice>"),
                                         inputs=("tgt_sizes", "image_bound"), positions=("image_bound",))),
    # Nemotron-3 Nano Omni (its audio tower is not served): the whole image at a patch grid under its
    # budget, one run of image tokens between <img> and </img> (text in its template), 4 patches a token.
    "nemotron_h_nano_omni": Family("nemotron_omni", ("<img>", "</img>"),
                                   image_token=("img_context_token_id", "image_token_index"),
                                   tiny_preprocessor={"norm_mean": [0.5] * 3, "norm_std": [0.5] * 3, "patch_size": 16,
                                                      "min_num_patches": 4, "max_num_patches": 36,
                                                      "max_model_len": 64}),
    # Phi-4-multimodal (its audio tower and speech LoRA are not served): SigLIP-2 NaFlex patches, one
    # token each, as <|endoftext10|> (its image token) in the prompt; mlx-vlm's merge expands -200.
    "phi4mm": Family("phi4mm", (None, None), image_token=("<|endoftext10|>",), expands="image_token_index",
                     tiny_preprocessor={"patch_size": 16, "min_num_patches": 4, "max_num_patches": 16}),
    # Inkling (its audio tower is not served): one image token a 32 px tile (tiny; 40 px in its checkpoints).
    "inkling": Family("inkling", (None, None), tiny_preprocessor={"patch_size": 32}),
    # ZAYA1-VL: Qwen2.5-VL's layout; its vision LoRA applies to an image's tokens in every chunk.
    "zaya1_vl": Family("qwen", ("vision_start_token_id", "vision_end_token_id"), media_mask="visual_pos_masks",
                       tiny_preprocessor=QWEN_TINY),
    # LocateAnything: MoonViT patches (Kimi-VL's processor steps, its own class), one run between <img> and
    # </img>; decoded one token at a time (its PBD decoder's "slow" mode, mlx-vlm's generate), not in blocks.
    "locateanything": Family("locateanything", ("<img>", "</img>"), tiny_preprocessor=KIMI_TINY),
    "mimo_v2": Family("qwen", ("vision_start_token_id", "vision_end_token_id"), tiny_preprocessor=QWEN_TINY),
    "mage_vl": Family("qwen", ("vision_start_token_id", "vision_end_token_id"),  # one frame a patch
                      tiny_preprocessor=QWEN_TINY | {"temporal_patch_size": 1}),
    "paddleocr_vl": Family("mlx_vlm.models.paddleocr_vl.processing_paddleocr_vl:ImageProcessor",
                           ("vision_start_token_id", "vision_end_token_id"),
                           tiny_preprocessor={"min_pixels": 1024, "max_pixels": 16384, "patch_size": 16,
                                              "merge_size": 2, "temporal_patch_size": 1}),
    "kimi_vl": Family("kimi_vl", ("<|media_start|>image<|media_content|>", "<|media_end|>"),
                      tiny_preprocessor=KIMI_TINY, image_token=KIMI_IMAGE),
    "kimi_k25": Family("kimi_k25", ("<|media_begin|>image<|media_content|>", "<|media_end|>"),
                       tiny_preprocessor=KIMI_TINY, image_token=KIMI_IMAGE),
    # Laid out by the family's own processor: tiles with their row and column tags, then the
    # whole image (64 px tiles of 4 tokens each, a 128 px image at most).
    "idefics3": Family("mlx_vlm.models.idefics3.processing_idefics3:Idefics3Processor", (None, None),
                       image_processor="Idefics3ImageProcessorPil",
                       tiny_preprocessor={"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 64},
                                          "processor_config": {"image_seq_len": 4}}),
    # Crops, then the whole image, each a run of patch tokens after its tag (TILE_1, TILE_GLOBAL).
    "aya_vision": Family("mlx_vlm.models.aya_vision.processing_aya_vision:AyaVisionProcessor", (None, None),
                         image_processor="GotOcr2ImageProcessorPil",
                         tiny_preprocessor={"size": {"height": 64, "width": 64}, "crop_to_patches": True,
                                            "max_patches": 4, "processor_config": {
                                                "img_size": 64, "patch_size": 16, "downsample_factor": 2}}),
    # Tiles (and a thumbnail) as one run of image tokens between its marks (as text in its template).
    "internvl": Family("internvl", ("<img>", "</img>"),
                       tiny_preprocessor={"processor_config": {"image_seq_length": 4}}),
    "internvl_chat": Family("internvl_chat", ("<img>", "</img>")),
    # LLaVA-NeXT's layout; the image enters as features added at chosen layers (vlm_layouts.ChunkRows):
    # 64 px tiles of 4 tokens (a 4 x 4 patch grid's 4 x 4 windows read by 2 x 2 queries).
    "granite4_vision": Family("mlx_vlm.models.granite4_vision.processing_granite4_vision:Granite4VisionProcessor",
                              (None, None), image_processor="LlavaNextImageProcessorPil",
                              tiny_preprocessor={"size": {"shortest_edge": 64},
                                                 "crop_size": {"height": 64, "width": 64},
                                                 "image_grid_pinpoints": [[64, 64], [64, 128], [128, 64], [128, 128]],
                                                 "processor_config": {"patch_size": 16, "downsample_rate": "2/4",
                                                                      "vision_feature_select_strategy": "full"}}),
    # LLaVA-NeXT's layout and merge (mended alike), its features from several tower layers.
    "granite_vision": Family("mlx_vlm.models.granite_vision.processing_granite_vision:GraniteVisionProcessor",
                             (None, None), image_processor="LlavaNextImageProcessorPil",
                             tiny_preprocessor={"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
                                                "image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                                                "processor_config": {"patch_size": 16,
                                                                     "vision_feature_select_strategy": "full"}}),
    # LLaVA-NeXT's any resolution, as OneVision's without its downscale (vlm_layouts.anyres_merge
    # mends mlx-vlm's merge): 32 px tiles of 4 tokens, a 2 x 2 grid at most.
    "llava_next": Family("mlx_vlm.models.llava_next.processing_llava_next:LlavaNextProcessor", (None, None),
                         image_processor="LlavaNextImageProcessorPil",
                         tiny_preprocessor={"size": {"shortest_edge": 32}, "crop_size": {"height": 32, "width": 32},
                                            "image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                                            "processor_config": {"patch_size": 16, "num_additional_image_tokens": 1,
                                                                 "vision_feature_select_strategy": "default"}}),
    # Any resolution: the whole image's rows, then its tiles' rows unpadded to the image's aspect, a
    # newline row after each (32 px tiles of 4 tokens, a 2 x 2 grid at most).
    "llava_onevision": Family("mlx_vlm.models.llava_onevision.processing_llava_onevision:LlavaOnevisionProcessor",
                              (None, None), image_processor="LlavaOnevisionImageProcessorPil",
                              tiny_preprocessor={"size": {"height": 32, "width": 32},
                                                 "image_grid_pinpoints": [[32, 32], [32, 64], [64, 32], [64, 64]],
                                                 "processor_config": {"num_image_tokens": 4}}),
    # Crops and the whole image, each a run of perceiver-pooled tokens between boundary tokens.
    "idefics2": Family("mlx_vlm.models.idefics2.processing_idefics2:Idefics2Processor", (None, None),
                       image_processor="Idefics2ImageProcessorPil",
                       tiny_preprocessor={"size": {"longest_edge": 64, "shortest_edge": 32}, "do_image_splitting": True,
                                          "processor_config": {"image_seq_len": 4}}),
    # Idefics3's layout and model; the processor reads its image tokens off the tokenizer.
    "smolvlm": Family("mlx_vlm.models.smolvlm.processing_smolvlm:SmolVLMProcessor", (None, None),
                      image_processor="SmolVLMImageProcessorPil",
                      tiny_preprocessor={"size": {"longest_edge": 128}, "max_image_size": {"longest_edge": 64},
                                         "processor_config": {"image_seq_len": 4}}),
    # Crops (overlapping windows of a grid picked by the image's aspect) and the whole image, pooled 2 x 2,
    # rows of patch tokens ended by a column token, each between its marks, before the text; its
    # processor's image_input_idx places each row (models/vlm_spans.py positions).
    "molmo": Family("mlx_vlm.models.molmo.processing_molmo:MolmoProcessor", (None, None), placeholder="",
                    image_processor="mlx_vlm.models.molmo.processing_molmo:MolmoImageProcessor",
                    tiny_preprocessor={"base_image_input_size": [84, 84], "image_patch_size": 14,
                                       "image_token_length_w": 3, "image_token_length_h": 3, "max_crops": 2,
                                       "overlap_margins": [2, 2]},
                    own=ProcessorSpec(tokens=("<im_patch>", "<im_col>", "<im_start>", "<im_end>"),
                                      inputs=("image_input_idx", "image_masks"), positions=("image_input_idx",),
                                      image_token="<im_patch>")),
    # The whole image, then its crops, pooled 2 x 2, rows of patch tokens ended by a column token,
    # each between its marks (Idefics3's way: its processor and image processor).
    "molmo2": Family("mlx_vlm.models.molmo2.processing:Molmo2Processor", (None, None),
                     image_processor="mlx_vlm.models.molmo2.processing:Molmo2ImageProcessor", placeholder="<|image|>",
                     tiny_preprocessor={"size": {"height": 84, "width": 84}, "max_crops": 2, "overlap_margins": [2, 2],
                                        "patch_size": 14, "pooling_size": [2, 2]},
                     own=ProcessorSpec(tokens=("<|image|>", "<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>",
                                               "<im_end>"),
                                       inputs=("image_token_pooling", "image_grids", "image_num_crops"),
                                       image_token="<im_patch>",
                                       config_tokens={"image_patch_id": "<im_patch>", "image_end_token_id": "<im_end>"})),
    # DeepSeek-VL / Janus: one square input, num_image_tokens rows, which mlx-vlm's merge expands one
    # image token into (the prompt holds a run of them).
    "multi_modality": Family("multi_modality", (None, None), image_token=("image_token_index",),
                             expands="image_token_index", tiny_preprocessor={}),
    # PLaMo 2 VL: Eagle-2 tiles and a thumbnail (64 px, 16 tokens each in the tiny config, fewer than
    # 100 tokens an image), one run between its marks.
    "plamo2vl": Family("plamo2vl", ("<siglip2:img>", "</siglip2:img>"),
                       tiny_preprocessor={"size": {"height": 64, "width": 64}, "patch_size": 16,
                                          "max_image_width": 64, "max_image_height": 64, "downsample_ratio": 1.0,
                                          "tile_context_length": 100}),
    # Rows of image tokens and breaks: no tokens around them.
    "pixtral": Family("pixtral", (None, None), tiny_preprocessor={"size": {"longest_edge": 64}}),
    "mistral3": Family("pixtral", (None, None), tiny_preprocessor={"size": {"longest_edge": 128}}),
    "mistral_large3": Family("pixtral", (None, None), tiny_preprocessor={"size": {"longest_edge": 128}}),
    # Images marked with ids outside the vocabulary, stand-ins in the prompt (models/vlm_standin.py):
    # LLaVA-Bunny's and FastVLM's one -200 (384 px and 1024 px images in their checkpoints), Phi-3-vision's
    # run of -1 (336 px crops, one in the tiny config).
    "llava_bunny": Family("llava_bunny", (None, None), tiny_preprocessor={}),
    "fastvlm": Family("fastvlm", (None, None), tiny_preprocessor={"size": {"shortest_edge": 128},
                                                                  "crop_size": {"height": 128, "width": 128}}),
    "phi3_v": Family("phi3_v", (None, None), tiny_preprocessor={"num_crops": 1}),
    # Phi-4-SigLIP's -200: one row a SigLIP-2 NaFlex patch (4 to 16 patches of 16 px in the tiny config).
    "phi4_siglip": Family("phi4_siglip", (None, None), tiny_preprocessor={}),
    # The whole image (728 px, 169 tokens) after its crops (504 px, 81 tokens each, rows ended by
    # <patch_newline>), each between its marks; sizes fixed by the processor.
    "step3p7": Family("mlx_vlm.models.step3p7.processing_step3p7:Step3VLProcessor", (None, None),
                      own=ProcessorSpec(tokens=("<im_patch>", "<patch_start>", "<patch_end>", "<patch_newline>",
                                                "<im_start>", "<im_end>"),
                                        inputs=("num_patches", "patch_pixel_values"))),
    "gemma4": Family("gemma4", ("boi_token_id", "eoi_token_id"),
                     tiny_preprocessor={"patch_size": 8, "max_soft_tokens": 16, "pooling_kernel_size": 2}),
}


def family_of(config: dict) -> Family | None:
    """The generic path's Family of a config, or None if it has none."""
    return FAMILIES.get(config.get("model_type"))


# What get_input_embeddings may return beside the embeddings; a family giving more
# (cross-attention states, encoder outputs) does not fit this path.
_KNOWN_FEATURES = {"inputs_embeds", "position_ids", "rope_deltas", "per_layer_inputs", "visual_pos_masks",
                   "deepstack_visual_embeds", "attention_mask_4d",
                   "attention_mask"}  # the mask it was given, given back (Cohere Compass)


def _qwen3_5_row_caches() -> None:
    """Let mlx-vlm's Qwen3.5 split mlx-lm's batch caches into rows.

    Qwen3_5Model.__call__ runs a one-row batch (and a left-padded one) row by
    row, cutting each cache with `_extract_row_cache`, which knows mlx-vlm's
    cache classes only: an empty mlx-lm cache of a recurrent layer becomes an
    (mlx-vlm) KVCache, and the layer fails. Here mlx-lm's ArraysCache gives
    its row's arrays (and lengths), an empty batch KV cache an empty KVCache.
    """
    import mlx_vlm.models.qwen3_5.language as qwen3_5
    from mlx_lm.models.cache import ArraysCache, KVCache

    original = qwen3_5._extract_row_cache
    if getattr(original, "mlxserve", False):
        return

    def extract_row_cache(entry, row: int):
        if isinstance(entry, ArraysCache):
            out = ArraysCache(len(entry.cache))
            out.cache = [None if a is None else a[row : row + 1] for a in entry.cache]
            if entry.lengths is not None:
                out.lengths = entry.lengths[row : row + 1]
            return out
        if hasattr(entry, "left_padding") and hasattr(entry, "empty") and entry.empty():
            return KVCache()
        return original(entry, row)

    extract_row_cache.mlxserve = True
    qwen3_5._extract_row_cache = extract_row_cache


# Fixes for mlx-vlm code that meets mlx-lm's batch caches, by the module of the language model
# class (or of a class it derives from: Qwen3.5 MoE's, IndicOCR's).
def _zaya_cache_pairs() -> None:
    """Let mlx-vlm's ZAYA1 split mlx-lm's CacheList into its layer's KV and state caches.

    Its `_split_cache` knows mlx-vlm's CacheList class only; given mlx-lm's (which
    BatchGenerator merges and the prefix cache stores), it takes the pair for a KV cache,
    and the layer fails. Here mlx-lm's pair is split as mlx-vlm's is.
    """
    import mlx_vlm.models.zaya1_vl.language as zaya
    from mlx_lm.models.cache import CacheList

    original = zaya._split_cache
    if getattr(original, "mlxserve", False):
        return

    def split_cache(cache):
        return (cache[0], cache[1]) if isinstance(cache, CacheList) else original(cache)

    split_cache.mlxserve = True
    zaya._split_cache = split_cache


_PATCHES = {"mlx_vlm.models.qwen3_5.language": _qwen3_5_row_caches,
            "mlx_vlm.models.deepseek_vl_v2.language": deepseek_vl2_spatial_crops,  # models/vlm_spans.py
            "mlx_vlm.models.zaya1_vl.language": _zaya_cache_pairs}


def _gemma4_mask_after_cache() -> None:
    """Keep Gemma 4's both-ways image attention in a prompt chunk that follows cached tokens.

    With use_bidirectional_attention='vision' (26B-A4B, 31B) mlx-vlm ORs "same
    image" (a run of media tokens in `mm_token_type_ids`) into the causal mask
    of a pass, but only when the mask is square, i.e. no tokens are cached
    before the chunk; otherwise it returns the causal mask as it is, so an image
    prefilled after cached tokens attends causally only. (mlx-vlm itself
    prefills such prompts in one pass.) Here the overlay covers the chunk's own
    keys, the last L columns of the mask over cache + chunk; the cached keys
    keep what the causal (and sliding-window) mask gives them. That is exact
    because mlxserve never splits an image between passes (Sequence.cut, and
    prefix-cache hits back off to an image's start), so the tokens of an image
    in the chunk have none of their image in the cache. A square mask (nothing
    cached) goes to mlx-vlm's own overlay.
    """
    import mlx.core as mx
    import mlx_vlm.models.gemma4.language as gemma4

    model = gemma4.Gemma4TextModel
    original = model._apply_blockwise_bidirectional_overlay
    if getattr(original, "mlxserve", False):
        return

    def overlay(self, base_mask, mm_token_type_ids):
        chunk, keys = base_mask.shape[-2:]
        if mm_token_type_ids is None or mm_token_type_ids.shape[1] != chunk or keys == chunk:
            return original(self, base_mask, mm_token_type_ids)
        blocks = self._block_sequence_ids_for_mask(mm_token_type_ids)
        same = (blocks[:, :, None] != -1) & (blocks[:, :, None] == blocks[:, None, :])
        cached = mx.zeros((*same.shape[:2], keys - chunk), dtype=mx.bool_)
        return base_mask | mx.concatenate([cached, same], axis=-1)[:, None]

    overlay.mlxserve = True
    overlay.original = original  # mlx-vlm's own (tests compare with it)
    model._apply_blockwise_bidirectional_overlay = overlay


# Families whose mask keeps an image's tokens attending both ways after cached tokens.
_BIDIRECTIONAL = {"gemma4": _gemma4_mask_after_cache}


def tower_blocks(tower) -> list:
    """The tower's transformer blocks, wherever the family keeps them."""
    for path in ("blocks", "encoder.layers", "vision_model.encoder.layers", "layers"):
        obj = tower
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if obj is not None:
            return list(obj)
    return []


def vision_tower(model):
    """The model's vision tower, under whichever name the family gives it."""
    for name in ("vision_tower", "visual", "vision_model", "vision"):
        if getattr(model, name, None) is not None:
            return getattr(model, name)
    return None


def bidirectional_images(config: dict) -> bool:
    """Whether the model's image tokens attend to each other both ways (Gemma 4 26B-A4B / 31B)."""
    return (config.get("text_config") or config).get("use_bidirectional_attention") == "vision"


def check_supported(config: dict) -> None:
    """Refuse, before any weight is read, what this path cannot serve exactly."""
    from mlxserve.models.files import ModelLoadError

    if bidirectional_images(config) and config["model_type"] not in _BIDIRECTIONAL:
        raise ModelLoadError(
            f"{config['model_type']} with use_bidirectional_attention='vision' (attention both ways within each "
            "image) is not supported: mlx-vlm drops it whenever a prompt chunk follows cached tokens, and "
            "mlxserve mends that for Gemma 4 only")


class GenericVLM(VisionAdapter):
    """Any FAMILIES model: images through mlx-vlm's get_input_embeddings, per-chunk extras passed on."""

    def __init__(self, model, config, processor_config, tokenizer):
        self.family = config["model_type"]
        spec = FAMILIES[self.family]
        lm, cfg = model.language_model, model.config
        self.mrope = hasattr(lm, "get_rope_index")  # Qwen3-VL, Qwen3.5: M-RoPE positions from the image grids
        self.deepstack = bool(getattr(cfg.vision_config, "deepstack_visual_indexes", None)  # Qwen3-VL
                              or getattr(cfg, "deepstack_layer_map", None))  # Granite 4 Vision
        check_supported(config)
        for module in {klass.__module__ for klass in type(lm).__mro__} & _PATCHES.keys():
            _PATCHES[module]()
        self.whole_images = bidirectional_images(config)
        if self.whole_images:
            _BIDIRECTIONAL[self.family]()
        super().__init__(model, config, processor_config, tokenizer)
        if spec.processor in MARKED:  # image marks outside the vocabulary: stand-ins in the prompt
            from mlxserve.models.chat import hf_of

            self.images = MARKED[spec.processor](config, processor_config, hf_of(tokenizer))
        elif spec.own is not None:
            from mlxserve.models.chat import hf_of

            self.images = ProcessorSpans(spec.processor, spec.own, config, processor_config, hf_of(tokenizer),
                                         spec.image_processor, spec.placeholder)
        elif spec.image_processor is None:
            self.images = image_processor(spec.processor, config, processor_config)
        else:
            from mlxserve.models.chat import hf_of

            self.images = OwnLayout(spec.processor, spec.image_processor, config, processor_config,
                                    hf_of(tokenizer), spec.placeholder)
        if self.family in MODEL_FIXES:  # mlx-vlm's model mended (models/vlm_layouts.py)
            MODEL_FIXES[self.family](model, self.images)
        self.text_model.positions_last = spec.positions == "last"
        if spec.processor in MARKED:
            self.image_token_id = self.images.stand_in
        elif spec.own is not None and spec.own.image_token:  # a token the config does not name (Molmo's)
            self.image_token_id = self.images.token_id()
        else:
            self.image_token_id = self._token_id(config, spec.image_token)
        self.expands = self._token_id(config, (spec.expands,)) if spec.expands else None
        self._wrap = (self._wrap_text(config, spec.wrap[0]), self.token_text(self.image_token_id),
                      self._wrap_text(config, spec.wrap[1]))
        self._deltas: OrderedDict[tuple, int] = OrderedDict()  # image grids -> M-RoPE delta
        self.videos = VIDEOS[spec.video](config, processor_config) if spec.video else None
        if self.videos is not None:
            self.video_token_id = config.get("video_token_id")
            if self.video_token_id is None:
                raise ValueError(f"{self.family}: config.json lacks video_token_id")
            self.video_processor = self.videos.processor  # VisionAdapter.pixels makes a video's pixels with it
        if getattr(self.images, "expands", False):  # how many rows the marker gives: read once, off a probe image
            self.images.rows = int(self.encode(self.images.probe()).shape[0])

    def _token_id(self, config: dict, keys: tuple[str, ...]) -> int:
        """The first of the config's `keys` it sets (config.json's, else mlx-vlm's default for the family),
        or a literal token text ("<unk>") for a family whose config names none."""
        for key in keys:
            if key.startswith("<"):
                return self.tokenizer.convert_tokens_to_ids(key)
            value = config.get(key, getattr(self.model.config, key, None))
            if isinstance(value, int):
                return value
        raise ValueError(f"{self.family}: config.json lacks the image token id ({' or '.join(keys)})")

    def _wrap_text(self, config: dict, key: str | None) -> str:
        """A token around an image's run: none, a literal text, or the token a config key names."""
        if key is None:
            return ""
        if key.startswith("<"):
            return key
        return self.token_text(self._token_id(config, (key,)))

    def tower_blocks(self) -> list:
        return tower_blocks(vision_tower(self.model))

    def _layout(self, image) -> ImageInput:
        return self.images.layout(image)

    def _pixels(self, image) -> np.ndarray:
        return self.images.pixels(image)

    def _breaks(self) -> tuple[int, int]:
        """Pixtral's row-break and end token ids (its processor's texts, or the config's ids)."""
        return tuple(self._token_id(self.config, (key,)) if key in self.config else
                     self.tokenizer.convert_tokens_to_ids(text)
                     for key, text in (("image_break_token_id", self.images.break_text),
                                       ("image_end_token_id", self.images.end_text)))

    def image_span_ids(self) -> set[int]:
        return {self.image_token_id, *self._breaks()} if hasattr(self.images, "token_ids") else {self.image_token_id}

    def _image_ids(self, image: ImageInput) -> list[int]:
        """The ids of an image's placeholder inside its wrap: its image tokens (and row breaks), or
        the span its family's own processor laid out."""
        if image.ids is not None:
            return list(image.ids)
        if hasattr(self.images, "token_ids"):
            return self.images.token_ids(image, self.image_token_id, *self._breaks())
        return [self.image_token_id] * image.num_tokens

    def placeholder(self, image: ImageInput) -> str:
        if image.ids is not None:  # checked to tokenize back to these ids (OwnLayout.layout)
            return self.images.tokenizer.decode(image.ids, clean_up_tokenization_spaces=False)
        start, _, end = self._wrap
        return start + "".join(self.tokenizer.convert_ids_to_tokens(self._image_ids(image))) + end

    def preprocess_video(self, frames: list, video: int) -> list[ImageInput]:
        if self.videos is None:
            return super().preprocess_video(frames, video)
        return self.videos.groups(frames, video)

    def video_placeholder(self, groups: list[ImageInput]) -> str:
        start, _, end = self._wrap
        return self.videos.placeholder(groups, start, self.token_text(self.video_token_id), end)

    def encode(self, image: ImageInput):
        """The image's (or video frame group's) rows as mlx-vlm's own merge places them: [n, D], or
        [n, 1 + k, D] with Qwen3-VL's k deepstack rows beside each token's embedding."""
        import mlx.core as mx

        pixels = mx.array(self.pixels(image))
        if image.video is None:
            ids = mx.array([list(image.tower_ids) if image.tower_ids is not None else
                            [self.expands] if self.expands is not None else self._image_ids(image)])
            kwargs = {"pixel_values": pixels, **self.images.image_kwargs(image)}
        else:
            ids = mx.array([[self.video_token_id] * image.num_tokens])
            kwargs = self.videos.tower_kwargs(image, pixels)
        # An integer mask where the processor's attention_mask is one the model reads (FastVLM's merge
        # slices the ids by its sums).
        mask = mx.ones(ids.shape, dtype=mx.int32 if getattr(self.images, "int_mask", False) else mx.float32)
        f = self.model.get_input_embeddings(ids, mask=mask, **kwargs)
        extra = {k for k, v in f.to_dict().items() if v is not None} - _KNOWN_FEATURES
        if extra:
            raise ValueError(f"{self.family}: mlx-vlm's get_input_embeddings also gives {sorted(extra)}, "
                             "which this adapter does not pass to the language model")
        rows = f.inputs_embeds[0]
        if self.deepstack:  # a list of rows a layer, or Cohere Compass's wrapper of it (and its mask)
            deep = f.deepstack_visual_embeds
            rows = mx.stack([rows, *getattr(deep, "embeddings", deep)], axis=1)
        return rows

    def _media(self, ids):
        """Which of `ids` are image (or video) tokens."""
        media = ids == self.image_token_id
        return media if self.video_token_id is None else media | (ids == self.video_token_id)

    def mlx_vlm_lm_kwargs(self, token_ids, image_inputs: dict) -> dict:
        """What mlx-vlm's Model.__call__ gives its language model beside the input embeddings, for
        a family whose get_input_embeddings does not give it all (tests compare with its pass)."""
        import mlx.core as mx

        name = FAMILIES[self.family].media_mask
        if name is None:
            return {}
        media = self._media(mx.array([token_ids]))
        return {**image_inputs, name: media.astype(mx.int32) if name == "token_type_ids" else media}

    def mlx_vlm_ids(self, token_ids, images) -> list[int]:
        """The prompt as mlx-vlm's processor gives it (tests compare with its pass): a family whose
        merge expands one id into an image's rows has that id where each image's run is."""
        out = list(token_ids)
        for im in sorted(images, key=lambda im: im.start, reverse=True):
            if im.pixels.tower_ids is not None:  # the processor's own marks (models/vlm_standin.py)
                out[im.start: im.start + im.num_tokens] = im.pixels.tower_ids
            elif self.expands is not None:
                out[im.start: im.start + im.num_tokens] = [self.expands]
        return out

    def inputs(self, token_ids, spans) -> dict:
        """Embeddings of a prompt chunk (the family's own text rows, image rows spliced in at
        `spans`) and the chunk's extras: its deepstack rows, its per-layer inputs."""
        import mlx.core as mx

        ids = mx.array(token_ids)[None]
        text = self.model.get_input_embeddings(ids)
        emb = text.inputs_embeds[0]
        pieces, deep, pos = [], [], 0
        for start, rows in sorted(spans, key=lambda s: s[0]):
            if start > pos:
                pieces.append(emb[pos:start])
            pieces.append((rows[:, 0] if rows.ndim == 3 else rows).astype(emb.dtype))
            if rows.ndim == 3:
                deep.append(rows[:, 1:])
            pos = start + rows.shape[0]
        if pos < emb.shape[0]:
            pieces.append(emb[pos:])
        out = {"inputs_embeds": mx.concatenate(pieces)[None] if spans else emb[None]}
        if deep:
            rows = mx.concatenate(deep).astype(emb.dtype)  # the chunk's image tokens, in prompt order
            media = ids == self.image_token_id
            out["visual_pos_masks"] = media if self.video_token_id is None else media | (ids == self.video_token_id)
            out["deepstack_visual_embeds"] = [rows[:, j] for j in range(rows.shape[1])]
            if self.family in LAYER_FEATURES:
                out = LAYER_FEATURES[self.family](out, media, rows)
        if getattr(text, "per_layer_inputs", None) is not None:
            out["per_layer_inputs"] = text.per_layer_inputs
        name = FAMILIES[self.family].media_mask
        if name is not None:
            out[name] = self._media(ids).astype(mx.int32) if name == "token_type_ids" else self._media(ids)
        if self.whole_images:  # which tokens are media: mlx-vlm's mask lets each run attend to itself both ways
            types = (ids == self.image_token_id).astype(mx.int32)
            if self.video_token_id is not None:
                types = types + 2 * (ids == self.video_token_id)
            out["mm_token_type_ids"] = types
        return out

    def embed(self, token_ids, spans):
        return self.inputs(token_ids, spans)["inputs_embeds"]

    def positions(self, token_ids, images):
        if not self.mrope:
            return None, 0
        import mlx.core as mx

        if FAMILIES[self.family].positions == "index":
            return mx.broadcast_to(mx.arange(len(token_ids))[None, None], (3, 1, len(token_ids))), 0

        # A video's groups go as video grids of (1, h, w) each: mlx-vlm cuts a video's (t, h, w)
        # into those rows itself, one per vision block.
        grids = [im.grid_thw for im in images if im.video is None]
        videos = [im.grid_thw for im in images if im.video is not None]
        # By name: Cohere Compass's takes no video grids.
        pos, delta = self.model.language_model.get_rope_index(
            mx.array([token_ids]), image_grid_thw=mx.array(grids) if grids else None,
            **({"video_grid_thw": mx.array(videos)} if videos else {}))
        if self.text_model.positions_last:
            pos = pos.transpose(2, 0, 1)
        delta = int(delta.reshape(-1)[0].item())
        self._deltas[tuple(im.grid_thw for im in images)] = delta
        while len(self._deltas) > 1024:
            self._deltas.popitem(last=False)
        return pos, delta

    def rope_delta(self, token_ids, images) -> int:
        # As for Qwen2.5-VL: the delta is a function of the image grids alone (a video
        # group's block is placed as an image's of its grid).
        key = tuple(im.grid_thw for im in images)
        delta = self._deltas.get(key)
        if delta is None:
            return self.positions(token_ids, images)[1]
        self._deltas.move_to_end(key)
        return delta
