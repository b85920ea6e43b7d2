"""What mlx-vlm fixes in code. Towers (models/vlm_towers.py): a real config builds exactly
mlx-vlm's model, a tiny config a tiny tower of the same code; Jina VLM's embedding rows read
without copying its table (models/vlm_patches.py)."""

import pytest

# Real configs as their checkpoints ship them (no vision_config: mlx-vlm's loader gives an empty one).
REAL = {
    # microsoft/Phi-3-vision-128k-instruct
    "phi3_v": {"model_type": "phi3_v", "hidden_size": 3072, "intermediate_size": 8192, "num_attention_heads": 32,
               "num_hidden_layers": 32, "num_key_value_heads": 32, "vocab_size": 32064},
    # apple/FastVLM-0.5B (llava_qwen2, which mlx-vlm maps to fastvlm)
    "fastvlm": {"model_type": "llava_qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
                "num_hidden_layers": 24, "num_key_value_heads": 2, "vocab_size": 151936, "mm_hidden_size": 3072,
                "mm_projector_type": "mlp2x_gelu", "tie_word_embeddings": True},
}


def shapes(model):
    from mlx.utils import tree_flatten

    return {name: tuple(p.shape) for name, p in tree_flatten(model.parameters())}


def mlx_vlm_build(config):
    """The model as mlx-vlm's load_model builds it before reading weights."""
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    config = dict(config)
    arch, _ = get_model_and_args(config)
    config.setdefault("text_config", {})
    config.setdefault("vision_config", {})
    model_config = update_module_configs(arch.ModelConfig.from_dict(config), arch, config, ["text", "vision"])
    return arch.Model(model_config)


@pytest.mark.parametrize("model_type", sorted(REAL))
def test_real_config_builds_mlx_vlms_own_tower(model_type):
    """Parameters are made lazily: no weights are computed here."""
    from mlxserve.models.vlm import build_vlm

    config = REAL[model_type] | {"vision_config": {}}
    ours, theirs = shapes(build_vlm(config)), shapes(mlx_vlm_build(config))
    assert ours == theirs
    assert max(n for s in ours.values() for n in s) >= 1024  # a real-sized tower (CLIP-L's 1024, FastViT-HD's 3072)


@pytest.mark.parametrize("model_type", sorted(REAL))
def test_tiny_config_builds_a_tiny_tower_of_the_same_layers(model_type):
    import math
    import re

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm import build_vlm
    from mlxserve.models.vlm_generic import vision_tower

    def kinds(tower):  # its parameters' names, block indices dropped: the kinds of layer it has
        return {re.sub(r"\.\d+(?=\.)", ".*", n) for n in shapes(tower)}

    def size(tower):
        return sum(math.prod(s) for s in shapes(tower).values())

    tiny, real = vision_tower(build_vlm(tiny_vlm_config(model_type))), vision_tower(mlx_vlm_build(REAL[model_type]))
    assert size(tiny) < 1_000_000 and size(real) > 100_000_000
    assert kinds(tiny) == kinds(real)


def test_fastvit_keeps_its_five_stages():
    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm import build_vlm

    config = tiny_vlm_config("fastvlm")
    config["vision_config"]["layers"] = [1, 1]
    with pytest.raises(ValueError, match="5 stages"):
        build_vlm(config)


def test_jina_embedding_rows_are_mlx_vlms_without_the_table_copy():
    """models/vlm_patches.py reads Jina VLM's rows from the table holding each id (mlx-vlm's
    concatenates both tables first): the same rows, from either table."""
    import mlx.core as mx
    from mlx_vlm.models.jina_vlm.language import ExtendedEmbedding

    from mlxserve.models.vlm_patches import _jina_embedding_rows

    _jina_embedding_rows()
    table = ExtendedEmbedding(50, 6, 8)
    table.embedding, table.new_embedding = mx.random.normal((50, 8)), mx.random.normal((6, 8))
    ids = mx.array([[0, 49, 50, 55, 7], [53, 1, 2, 50, 49]])
    ours = table(ids)
    assert mx.array_equal(ours, type(table).__call__.original(table, ids)).item()
    assert mx.array_equal(ours[0, 2], table.new_embedding[0]).item()
    assert mx.array_equal(ours[1, 4], table.embedding[49]).item()


def test_jina_rope_gives_each_batch_row_its_own_positions():
    """mlx-vlm's Jina RoPE gave every row of a batch cache the largest row's offset; mended, each
    row is rotated as it is alone (bit for bit)."""
    import mlx.core as mx
    from mlx_vlm.models.jina_vlm.language import RoPE

    from mlxserve.models.vlm_patches import _jina_row_positions

    _jina_row_positions()
    rope, x = RoPE(16), mx.random.normal((2, 2, 3, 16))
    both = rope(x, offset=mx.array([5, 0]))
    for row, offset in enumerate((5, 0)):
        assert mx.array_equal(both[row], rope(x[row:row + 1], offset=offset)[0]).item()
    assert not mx.allclose(RoPE.__call__.original(rope, x, mx.array([5, 0]))[1], both[1]).item()


def test_jina_crops_follow_its_connector_sizes():
    """Real sizes (or none) leave Jina's processor as mlx-vlm builds it; a tiny config's crops are the
    size its connector reads."""
    from types import SimpleNamespace

    from mlx_vlm.models.jina_vlm.config import VisionConfig
    from mlx_vlm.models.jina_vlm.image_processor import ImageProcessor

    from mlxserve.models.vlm_patches import jina_crop_size

    def crops(vision_config):
        images = SimpleNamespace(proc=SimpleNamespace(_image_proc=ImageProcessor()))
        before = images.proc._image_proc
        jina_crop_size(SimpleNamespace(config=SimpleNamespace(vision_config=vision_config)), images)
        return before, images.proc._image_proc

    before, after = crops(VisionConfig())
    assert after is before
    before, after = crops(VisionConfig(image_size=140))
    assert after is not before and after.base_input_size == (140, 140) and after.tokens_per_image == 25


# DeepSeek-OCR's vision_config as its checkpoints describe SAM (and OCR 2's Qwen2 encoder).
SAM_B = {"width": 768, "layers": 12, "heads": 12, "global_attn_indexes": [2, 5, 8, 11]}
OCR_VISION = {"deepseekocr": {"model_type": "vision", "width": {"sam_vit_b": SAM_B | {"downsample_channels": [512, 1024]}}},
              "deepseekocr_2": {"model_type": "vision", "width": {"sam_vit_b": SAM_B | {"downsample_channels": [512, 896]},
                                                                  "qwen2-0-5b": {"dim": 896}}}}


@pytest.mark.parametrize("model_type", sorted(OCR_VISION))
def test_deepseek_ocr_sam_is_mlx_vlms_for_a_real_config_and_tiny_for_a_tiny_one(model_type):
    import math

    from mlxserve.models.tiny_vlm import tiny_vlm_config
    from mlxserve.models.vlm import build_vlm

    tiny = tiny_vlm_config(model_type)
    real = {**tiny, "vision_config": OCR_VISION[model_type],
            "projector_config": {"projector_type": "linear", "input_dim": 2048 if model_type == "deepseekocr" else 896,
                                 "n_embed": tiny["hidden_size"]}}
    if model_type == "deepseekocr":
        real["vision_config"] |= {"layers": 2, "hidden_size": 1024, "num_attention_heads": 16}  # a shallow CLIP-L
    towers = ("sam_model", "vision_model")
    ours, theirs = build_vlm(real), mlx_vlm_build(real)
    for name in towers:
        assert shapes(getattr(ours, name)) == shapes(getattr(theirs, name)), name
    assert sum(math.prod(s) for s in shapes(theirs.sam_model).values()) > 80_000_000
    small = build_vlm(tiny)
    assert all(sum(math.prod(s) for s in shapes(getattr(small, name)).values()) < 1_000_000 for name in towers)
