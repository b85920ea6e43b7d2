"""PaliGemma (1 and 2): a prefix language model. Its prompt, the image's rows, BOS, the text and
the newline that ends it, is one prefix whose every token attends to every other, both ways
(mlx-vlm's mask is the outer product of the prompt's attention mask, and its processor refuses a
prompt without an image); the tokens it generates attend causally.

So a prompt token's keys and values depend on the prompt's later tokens, which the engine serves
as (Family.prefix_lm, the generic adapter's `prompt_both_ways`):

- a prompt is prefilled by one pass from wherever its cached part ends to its last token,
  included, every query attending to every key (engine/media.py); that last token's keys are
  then dropped, and the pass that samples feeds it again: its query attends to every key either
  way, so its keys, values and logits come out as in the whole pass, layer by layer;
- every prefix-cache block of such a prompt is keyed by the whole prompt (engine/request.py
  block_extra_keys), so a hit is the same prompt's own keys: a repeat restores all but its last
  token, and a prompt that parts from a cached one midway hits nothing;
- decoding steps attend causally, a batch row's left padding masked (`PrefixTextModel`).
"""

from __future__ import annotations

import numpy as np

from mlxserve.models.vlm import ImageInput, TextModel

# mlx-vlm's prompt for it (its checkpoints have no chat template): the last message alone, its image
# first, then the newline its processor ends the prompt with. The image's placeholder ends with BOS,
# where the processor writes it (GenericVLM's wrap for this family).
CHAT_TEMPLATE = ("{{ messages[-1]['content'] }}{%- if add_generation_prompt %}{{ '\\n' }}{%- endif %}")
NEEDS_IMAGE = ("this model takes an image with every prompt (PaliGemma's prompt attends both ways as a whole, "
               "after its image; its processor refuses a prompt without one)")


class PrefixTextModel(TextModel):
    """PaliGemma's language model for the engine: a prompt pass (given as embeddings) attends to
    every key, cached and its own; any other pass (decoding, and the prompt's last token fed
    again) is causal, with the batch's padding masked."""

    def __init__(self, language_model, mrope: bool):
        super().__init__(language_model, mrope)
        # mlx-vlm replaces a given mask by a causal one after cached tokens unless the config says
        # both ways; its own whole-prompt pass gives its mask at offset 0 either way, so this
        # changes none of mlx-vlm's tokens, and lets every pass here say its own mask.
        language_model.config.use_bidirectional_attention = True

    def __call__(self, inputs, cache=None, positions=None, inputs_embeds=None, **extras):
        if inputs_embeds is None and cache is not None:
            from mlx_lm.models.base import create_attention_mask

            extras["mask"] = create_attention_mask(inputs, cache[self.offset_index], return_array=True)
        return super().__call__(inputs, cache, positions, inputs_embeds, **extras)


class PaliGemmaImages:
    """PaliGemma's image processor (transformers' SiglipImageProcessor, as its
    preprocessor_config.json sets it): the image resized to the tower's square size, scaled to
    [0, 1] and normalized; (size / patch)^2 image tokens, one run."""

    def __init__(self, config: dict, pc: dict, tokenizer):
        from PIL import Image

        vc = config.get("vision_config") or {}
        size = pc.get("size") or {}
        self.size = size.get("height", vc.get("image_size", 224)) if isinstance(size, dict) else int(size)
        self.rows = (self.size // vc.get("patch_size", 14)) ** 2
        self.mean = np.array(pc.get("image_mean", (0.5, 0.5, 0.5)), np.float32)
        self.std = np.array(pc.get("image_std", (0.5, 0.5, 0.5)), np.float32)
        self.scale = pc.get("rescale_factor", 1 / 255)
        self.resample = Image.Resampling(pc.get("resample", Image.Resampling.BICUBIC))

    def layout(self, image) -> ImageInput:
        return ImageInput(None, None, self.rows)

    def pixels(self, image) -> np.ndarray:
        image = image.convert("RGB").resize((self.size, self.size), self.resample)
        x = (np.asarray(image, np.float32) * np.float32(self.scale) - self.mean) / self.std
        return x.transpose(2, 0, 1)[None].copy()

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


IMAGES = {"paligemma": PaliGemmaImages}


def zero_padding(inputs_embeds, ids, pad_token_id: int):
    """mlx-vlm's merge gives the pad token's rows zeros (its processor pads with it): the same here."""
    import mlx.core as mx

    return mx.where((ids == pad_token_id)[..., None], mx.zeros_like(inputs_embeds), inputs_embeds)
