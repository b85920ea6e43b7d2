"""Every vision-language model type mlx-vlm ships is served with images, batched and cached
with unchanged tokens, or served as text through mlx-lm, or refused at load with its reason.

One test per type served with images (mlxserve.models.vlm_architectures), on a tiny
random-weight config built from mlx-vlm's config classes (mlxserve.models.tiny_vlm), an
image in every prompt: greedy tokens alone, in batches of 2 and 3 prompts of different
lengths, cold, from a full hit (the image's KV reused) and a partial hit, with the cache off
and after a restart from the disk tier are all the same (tests/parity.py), and are mlx-vlm's
own whole-prompt pass's; a darker picture gives other tokens (so the image's rows count).
Every other package of mlx-vlm is accounted for: a model type mlx-lm serves as text, or
refused at load with its reason.
"""

import json

import numpy as np
import pytest

from mlxserve.cache.layers import model_specs, spec_kinds
from mlxserve.models.architectures import REFUSED
from mlxserve.models.files import ModelLoadError
from mlxserve.models.load import load
from mlxserve.models.tiny_vlm import tiny_vlm_config
from mlxserve.models.vlm import ADAPTERS
from mlxserve.models.vlm_architectures import VLM_REFUSED, is_vlm, state, text_type, vlm_packages
from mlxserve.models.vlm_generic import FAMILIES
from mlxserve.multimodal.prompt import chat_prompt

from parity import check_served_alike
from test_vlm import mlx_vlm_greedy, picture

SETTINGS = dict(block_size=16, prefill_chunk_size=32, checkpoint_interval=1, warmup=0)
TYPES = sorted({*ADAPTERS, *FAMILIES})

# Served one request at a time or uncached, the same tokens still: mlxserve says so at start
# and in /v1/models. A type that starts batching or caching fails, so this cannot go stale.
LIMITED: dict[str, tuple[bool, bool]] = {  # model type -> (batches, caches)
    "glm5_next": (False, False),  # its PoolingCache: mlx-vlm's own caches (models/vlm.py TextModel)
    "qwen4_exp": (False, False),  # its QSAKVCache, as glm5_next's PoolingCache
}
# Whose whole prompt attends both ways (PaliGemma's prefix): a cached block serves the same prompt only,
# so b, parting from a after the image, hits none of a's blocks (a repeat still hits all but its last token).
WHOLE_PROMPT = {"paligemma"}


def load_config(config, folder):
    (folder / "config.json").write_text(json.dumps(config))
    return load(str(folder / "config.json"), load_format="dummy", progress=False)


def user(*parts):
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str)
                                         else {"type": "image", "image": p} for p in parts]}]


QUESTION = ("Describe this picture: its colours, the shapes in it, what it may show and where it might have "
            "been taken, in a few plain words.")


def image_prompts(loaded):
    """(a, b, c, shared): a and b ask about one picture, b asking on where a ends (they part
    `shared` tokens in, after the image), c about another picture, in fewer words."""
    a = chat_prompt(loaded, user(picture(1), QUESTION))
    b = chat_prompt(loaded, user(picture(1), QUESTION + " Then say what is odd about it."))
    c = chat_prompt(loaded, user(picture(2, (90, 80)), "What is this?"))
    shared = next(i for i, (x, y) in enumerate(zip(a[0], b[0])) if x != y)
    image = a[1][0]
    assert shared > image.start + image.num_tokens and len({len(p[0]) for p in (a, b, c)}) == 3
    return a, b, c, shared


def another_image(loaded, a):
    """a's words about its picture darkened to a quarter (every pixel changed, the layout the
    same): tokens that differ from a's show the image's rows change them, else rows put in the
    wrong place would pass. (Another noise picture of a's size changed too little what towers
    that pool their patches give: 8 types gave a's tokens with one, 4 with this one.)"""
    from PIL import Image

    darker = Image.fromarray(np.asarray(picture(1)) // 4)
    other = chat_prompt(loaded, user(darker, QUESTION))
    assert len(other[0]) == len(a[0]) and other[1][0].num_tokens == a[1][0].num_tokens
    return other


def own_forward(loaded, prompt, n):
    """mlx-vlm's own greedy tokens of a one-image prompt: its get_input_embeddings over the
    whole prompt with the image's inputs, then its language model."""
    import mlx.core as mx

    vision, (ids, images) = loaded.vision, prompt
    pixels = images[0].pixels
    inputs = {"pixel_values": vision.tower_pixels(pixels) if hasattr(vision, "tower_pixels")
              else mx.array(vision.pixels(pixels))}
    layout = getattr(vision, "images", None)  # the generic adapter's image processor
    if hasattr(layout, "prompt_kwargs"):  # its processor's other inputs point into the ids (positions, masks)
        inputs |= layout.prompt_kwargs(pixels, images[0].start, len(ids))
    elif layout is not None:  # its processor's other inputs (the grid)
        inputs |= layout.image_kwargs(pixels)
    elif pixels.grid_thw is not None:
        inputs["image_grid_thw"] = mx.array([pixels.grid_thw])
    if hasattr(vision, "mlx_vlm_ids"):  # the ids as mlx-vlm's processor gives them (Phi-4-MM's -200)
        ids = vision.mlx_vlm_ids(ids, images)
    return mlx_vlm_greedy(vision, ids, n, **inputs)


@pytest.mark.parametrize("model_type", TYPES)
def test_vlm_type_is_served_with_images_batched_and_cached(model_type, tmp_path):
    loaded = load_config(tiny_vlm_config(model_type), tmp_path)
    assert loaded.vision is not None
    a, b, c, shared = prompts = image_prompts(loaded)
    if model_type in WHOLE_PROMPT:
        prompts = a, b, c, 0
    recurrent = "state" in spec_kinds(model_specs(loaded.model))
    serving, stats = check_served_alike(loaded, SETTINGS, tmp_path / "kv", block_granular=recurrent,
                                        prompts=prompts, expected=own_forward(loaded, a, 4),
                                        unlike=another_image(loaded, a))
    if serving["caches"]:
        assert stats["disabled"] is None and stats["misses"]["unrestorable"] == 0
    assert (serving["batches"], serving["caches"]) == LIMITED.get(model_type, (True, True)), serving["limits"]


def test_every_mlx_vlm_package_is_served_or_refused():
    """Each package of mlx-vlm is served with images, served as text (mlx-lm has its model
    type), or refused with its reason; no refusal names a type mlxserve serves."""
    unknown = [p for p in vlm_packages() if state(p)[0] == "unknown"]
    assert not unknown, f"mlx-vlm packages neither served nor refused: {unknown}"
    for package in VLM_REFUSED:
        assert package in vlm_packages() and package not in TYPES and text_type(package) is None, package
    assert not set(VLM_REFUSED) & set(REFUSED)  # mlx-lm's refusals are test_architectures.py's
    assert all(is_vlm(t) for t in TYPES)


@pytest.mark.parametrize("model_type", sorted(VLM_REFUSED))
def test_refused_vlm_type_is_refused_at_load_with_its_reason(model_type, tmp_path):
    """A model folder of the type (its config with a vision tower's), before its weights are
    read; and the bare type with --load-format dummy."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, "vision_config": {}}))
    for source, load_format in ((str(tmp_path), "auto"), (model_type, "dummy")):
        with pytest.raises(ModelLoadError) as e:
            load(source, load_format=load_format, progress=False)
        assert VLM_REFUSED[model_type] in str(e.value) and "\n" not in str(e.value)


def test_vlm_type_mlx_lm_has_is_served_as_text_with_images_refused(caplog, tmp_path):
    """A VLM folder of a type without an image adapter that mlx-lm has (here Gemma 3n): its
    language model is served; /v1/models and the start say it is text only, and a request
    with an image is a 400 in the API's shape."""
    import httpx

    from conftest import LiveServer
    from mlxserve.models.tiny import tiny_config
    from test_vlm import data_url

    config = tiny_config("gemma3n") | {"vision_config": {"model_type": "gemma3n_vision", "hidden_size": 32}}
    assert state("gemma3n") == ("text", "gemma3n")
    live = LiveServer(load_config(config, tmp_path))
    try:
        serving = httpx.get(f"{live.base_url}/models").json()["data"][0]["serving"]
        body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(picture(1))}},
                                                          {"type": "text", "text": "What is this?"}]}],
                "max_tokens": 2}
        r = httpx.post(f"{live.base_url}/chat/completions", json=body, timeout=60)
        text = httpx.post(f"{live.base_url}/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    finally:
        live.close()
    assert serving["images"] is False and serving["limits"][0].startswith("text only")
    assert r.status_code == 400 and "text only" in r.json()["error"]["message"]
    assert text.status_code == 200
    assert "text only: a vision-language model" in caplog.text

