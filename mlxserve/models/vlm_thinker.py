"""Qwen3-Omni (qwen3_omni_moe): its thinker (a vision tower, an audio tower and the language model
that writes text) served with images; its audio tower and its speech talker are not served.

Its config nests the thinker's settings under `thinker_config` (text_config, vision_config,
audio_config and the image, video and audio token ids), beside the talker's and code2wav's;
mlx-vlm's Model reads them there, and exposes the thinker's language model and merge as its own
(`language_model`, `get_input_embeddings`). The adapters read a VLM's settings at the top of its
config: `thinker_view` puts the thinker's there, the config's own keys kept over them (so mlx-vlm,
which reads `thinker_config`, builds the same model from either).
"""

from __future__ import annotations


def thinker_view(config: dict) -> dict:
    """The config with its thinker's settings at the top level, where a VLM keeps them."""
    thinker = config.get("thinker_config")
    if not isinstance(thinker, dict) or "vision_config" in config:
        return config
    return {**{k: v for k, v in thinker.items() if k != "model_type"}, **config}


def has_thinker_vision(config: dict) -> bool:
    return isinstance(config.get("thinker_config"), dict) and "vision_config" in config["thinker_config"]


def tiny_thinker(config: dict, audio: dict) -> dict:
    """A tiny Qwen3-Omni config from tiny_vlm's flat one: the thinker's settings nested under
    thinker_config (and kept at the top, as thinker_view gives them), a tiny audio tower, no talker
    (mlx-vlm still reads a talker_config's text_config: the thinker's)."""
    keys = ("text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
            "vision_end_token_id")
    thinker = {k: config[k] for k in keys if k in config} | {"audio_config": audio}
    return config | {"thinker_config": thinker, "enable_audio_output": False,
                     "talker_config": {"text_config": config["text_config"]}}


def layer_rows(deep) -> list:
    """Its merge's deepstack rows, [batch, tokens, layers, D] over an image's ids alone, as the
    generic adapter keeps them: one [tokens, D] array a layer."""
    return [deep[0, :, j] for j in range(deep.shape[2])]


def chunk_deepstack(out: dict, media, rows) -> dict:
    """A chunk's deepstack rows as its language model reads them: [batch, tokens, layers, D], the
    chunk's image tokens' rows in place, zeros elsewhere (mlx-vlm's expand_deepstack_visual_embeds)."""
    from mlx_vlm.models.qwen3_omni_moe.language import expand_deepstack_visual_embeds

    out["deepstack_visual_embeds"] = expand_deepstack_visual_embeds(media, out["deepstack_visual_embeds"])
    return out


LAYER_FEATURES = {"qwen3_omni_moe": chunk_deepstack}
