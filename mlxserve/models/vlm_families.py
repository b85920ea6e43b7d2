"""The generic VLM adapter's table: each mlx-vlm family it serves, as a `Family` (its image
processor, the tokens around an image, how it takes video and positions), and the tiny
configs' image settings (models/tiny_vlm.py). models/vlm_generic.py serves them; a new
family that fits its interface is one entry here.

Imports nothing of mlxserve's VLM modules, so any of them (and models/vlm.py) may read it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessorSpec:
    # The token texts the processor reads off the tokenizer and does not add itself (tiny
    # configs add them: models/tiny_vlm.py).
    tokens: tuple[str, ...] = ()
    pixels: str = "pixel_values"  # the processor's output holding the tower's input
    inputs: tuple[str, ...] = ()  # its other outputs get_input_embeddings takes (the rest are dropped)
    positions: tuple[str, ...] = ()  # of those, positions in its ids (negative: none)
    masks: tuple[str, ...] = ()  # of those, masks over its ids
    # The token its image rows take, where the config names none (Molmo's <im_patch>).
    image_token: str | None = None
    # Config keys of token ids the model reads, by their text (Molmo2's image_patch_id: "<im_patch>"):
    # tiny configs set them to the tiny tokenizer's ids.
    config_tokens: dict | None = None
    # It starts its ids with the tokenizer's BOS whatever the tokenizer adds (DeepSeek-VL2's): dropped
    # from the span (the chat template places the prompt's own); a tokenizer without one (a tiny
    # config's) lends it its EOS, to be dropped the same way.
    bos: bool = False
    # Its pixels are, for each prompt, a list of arrays of different sizes (MiniCPM-V 4.6's thumbnail
    # and slices, each with its own patch grid): carried as a tuple of arrays, given back as one list.
    ragged: bool = False
    # The tokens between which the processor writes an image's index in the prompt before its span
    # (MiniCPM-V's <image_id>0</image_id>): cut from the span, which is then the same wherever the image
    # sits, and written by the prompt before each image, counting them (GenericVLM.image_prefix).
    numbered: tuple[str, str] | None = None


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
    # "canvas": MiniCPM-V 4.7's, an image's crops laid on one 2-D canvas (models/vlm_minicpm.py).
    # "golden": Falcon OCR's (a 1-D position a whole image block, 2-D golden rotary positions of its
    # patches); "xdrope": HunyuanVL's four axes (models/vlm_bothways.py).
    positions: str | None = None
    # The language model's argument saying which tokens of a chunk are media, as its Model.__call__
    # gives it (with its image inputs): ERNIE 4.5 VL's token_type_ids (1: media experts), ZAYA1-VL's
    # visual_pos_masks (its vision LoRA). Decode steps (text) pass none.
    media_mask: str | None = None
    # A config key of the one id mlx-vlm's merge expands into all of an image's rows (Phi-4-MM's
    # -200 index, which no tokenizer gives): the tower is given that id alone, the prompt a run of
    # image_token, one a row.
    expands: str | None = None
    # An image's span attends to itself both ways, but for this many rows at its end, which attend
    # causally (Falcon OCR's end token): prefilled whole, its chunk's mask built for it
    # (models/vlm_bothways.py). None: causal throughout.
    both_ways: int | None = None
    # The whole prompt attends both ways (PaliGemma's prefix: image rows, BOS, text, the closing newline),
    # so it is prefilled in one pass to its last token and cached blocks are keyed by all of it
    # (models/vlm_prefix.py).
    prefix_lm: bool = False


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
    # DeepSeek-OCR (1 and 2): its 1024 px global view and its crops (640 px past 640 px; OCR 2's always,
    # 768 px), rows ended by newline rows: one run of image tokens (models/vlm_ocr.py).
    "deepseekocr": Family("deepseekocr", (None, None), image_token=("image_token_index",), tiny_preprocessor={}),
    "deepseekocr_2": Family("deepseekocr_2", (None, None), image_token=("image_token_index",), tiny_preprocessor={}),
    # Falcon OCR: its image block (CLS, four registers, a token a patch, its end token) attends to itself
    # both ways but for the end token, takes one 1-D position, and its patches 2-D (row, column) ones.
    "falcon_ocr": Family("falcon_ocr", (None, None), image_token=("img_id",), both_ways=1, positions="golden",
                         tiny_preprocessor={}),
    "glm4v": GLM4V,
    # GOT-OCR 2.0: one square tower input, its image tags' ids in the config (<img>, </img>, <imgpad>).
    "got": Family("got", ("im_start_token", "im_end_token"), image_token=("im_patch_token",)),
    "glm4v_moe": GLM4V,
    # GLM-5 Next: a patch grid between its image marks; its sparse attention's PoolingCache keeps mlx-vlm's own
    # caches, so it runs one request at a time, uncached (models/vlm.py TextModel).
    "glm5_next": Family("mlx_vlm.models.glm5_next.processing:Glm5NextImageProcessor",
                        ("image_start_token_id", "image_end_token_id"),
                        tiny_preprocessor={"patch_size": 16, "merge_size": 2, "temporal_patch_size": 2,
                                           "min_image_tokens": 4, "max_image_tokens": 16,
                                           "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}),
    "glm_ocr": Family("Glm4vImageProcessorPil", ("image_start_token_id", "image_end_token_id"),
                      tiny_preprocessor=QWEN_TINY),
    # dots.ocr: its template's image marks are plain text, not ids in its config.
    # Cohere Compass: Qwen3-VL's layout (a patch grid between its vision marks, deepstack rows).
    "cohere_compass": Family("cohere_compass", ("vision_start_token_id", "vision_end_token_id"),
                             tiny_preprocessor=QWEN_TINY | {"min_pixels": 1024, "max_pixels": 16384}),
    "dots_ocr": Family("Qwen2VLImageProcessorPil", ("<|img|>", "<|endofimg|>"), tiny_preprocessor=QWEN_TINY),
    # Qwen4-Exp: Qwen3.5's image layout; its QSA attention keeps mlx-vlm's QSAKVCache (keys, values and the
    # indexer's keys and positions a token), so it runs one request at a time, uncached (models/vlm.py TextModel).
    "qwen4_exp": Family("qwen", ("vision_start_token_id", "vision_end_token_id"), tiny_preprocessor=QWEN_TINY),
    # Qwen3-Omni's thinker (its audio tower and talker are not served): Qwen3-VL's image layout, its settings under
    # thinker_config (models/vlm_thinker.py).
    "qwen3_omni_moe": Family("qwen", ("vision_start_token_id", "vision_end_token_id"), tiny_preprocessor=QWEN_TINY),
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
    # MiniCPM-V 4.6: the whole image between <image> and </image>, then its slices (a grid picked by the
    # image's aspect), each between <slice> and </slice>, rows of slices ended by a newline, all after
    # its index (<image_id>k</image_id>); each crop's patches an array of its own size, placed by image_bound.
    "minicpmv4_6": Family("mlx_vlm.models.minicpmv4_6.processing_minicpmv4_6:MiniCPMVProcessor", (None, None),
                          positions="index",
                          image_processor="mlx_vlm.models.minicpmv4_6.processing_minicpmv4_6:MiniCPMVImageProcessor",
                          tiny_preprocessor={"patch_size": 8, "scale_resolution": 64, "max_slice_nums": 2},
                          own=ProcessorSpec(tokens=("<image>", "</image>", "<slice>", "</slice>", "<image_id>",
                                                    "</image_id>"),
                                            inputs=("tgt_sizes", "image_bound"), positions=("image_bound",),
                                            image_token="<|image_pad|>", ragged=True,
                                            numbered=("<image_id>", "</image_id>"))),
    # MiniCPM-V 4.7: 4.6's layout, its crops placed by canvas M-RoPE, which its model computes from the
    # marks' ids in its config (its merge finds the image rows by image_token_id itself).
    "minicpmv4_7": Family("mlx_vlm.models.minicpmv4_7.processing_minicpmv4_7:MiniCPMV4_7Processor", (None, None),
                          positions="canvas",
                          image_processor="mlx_vlm.models.minicpmv4_6.processing_minicpmv4_6:MiniCPMVImageProcessor",
                          tiny_preprocessor={"patch_size": 8, "scale_resolution": 64, "max_slice_nums": 2},
                          own=ProcessorSpec(tokens=("<image>", "</image>", "<slice>", "</slice>", "<image_id>",
                                                    "</image_id>"),
                                            inputs=("tgt_sizes",), image_token="<|image_pad|>", ragged=True,
                                            numbered=("<image_id>", "</image_id>"),
                                            config_tokens={"image_start_id": "<image>", "image_end_id": "</image>",
                                                           "slice_start_id": "<slice>", "slice_end_id": "</slice>",
                                                           "newline_id": "\u010a"})),  # "\n" (byte-level)
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
    # Moondream 2 / 3: BOS and the image's rows (one crop's patches: 729 in its checkpoints) attend each
    # other both ways; in the prompt, stand-ins for them (models/vlm_bothways.py).
    "moondream2": Family("moondream", (None, None), both_ways=0, tiny_preprocessor={}),
    "moondream3": Family("moondream", (None, None), both_ways=0, tiny_preprocessor={}),
    "mage_vl": Family("qwen", ("vision_start_token_id", "vision_end_token_id"),  # one frame a patch
                      tiny_preprocessor=QWEN_TINY | {"temporal_patch_size": 1}),
    "paddleocr_vl": Family("mlx_vlm.models.paddleocr_vl.processing_paddleocr_vl:ImageProcessor",
                           ("vision_start_token_id", "vision_end_token_id"),
                           tiny_preprocessor={"min_pixels": 1024, "max_pixels": 16384, "patch_size": 16,
                                              "merge_size": 2, "temporal_patch_size": 1}),
    # HunyuanVL: a run of rows x (columns + 1) + 2 image tokens between its image marks, placed by XD-RoPE.
    "hunyuan_vl": Family("hunyuan_vl", ("image_start_token_id", "image_end_token_id"), positions="xdrope",
                         tiny_preprocessor={"min_pixels": 1024, "max_pixels": 16384}),
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
    # Jina VLM: Molmo's layout (the thumbnail, then its 378 px crops, pooled 2 x 2: rows of patch tokens
    # ended by a column token, each between its marks), the features added at the patch tokens its
    # image_input_idx names. Its processor fixes the sizes (at most 12 crops) and the marks' ids
    # (<im_patch> 151665 .. <im_col> 151668), so the patch token is the config's image_patch_token_id.
    "jina_vlm": Family("mlx_vlm.models.jina_vlm.processing_jinavlm:JinaVLMProcessor", (None, None),
                       image_token=("image_patch_token_id",), tiny_preprocessor={},
                       own=ProcessorSpec(inputs=("image_input_idx", "image_masks"), positions=("image_input_idx",))),
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
    # FastVLM's tiny images 192 px, 3 x 3 rows: at 128 px (2 x 2) a darker image moved its logits too little.
    "fastvlm": Family("fastvlm", (None, None), tiny_preprocessor={"size": {"shortest_edge": 192},
                                                                  "crop_size": {"height": 192, "width": 192}}),
    # PaliGemma 1 / 2: SigLIP at a fixed square size, one run of (size / patch)^2 image tokens first in the
    # prompt; the whole prompt attends both ways (models/vlm_prefix.py).
    "paligemma": Family("paligemma", (None, None), image_token=("image_token_index",), prefix_lm=True,
                        tiny_preprocessor={}),
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
