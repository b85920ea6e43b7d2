"""Families laid out by their own processor (vlm_images.OwnLayout) whose processor is not
shaped like Idefics3's: built on the tokenizer alone (its image handling its own: Step3's,
DeepSeek-VL2's), giving its pixels under another name, and outputs that point into the ids
it returns (positions of image tokens, a mask over them), which hold for the image's span
alone and are moved to where the span sits when mlx-vlm's own pass takes a whole prompt.

A family's ProcessorSpec (models/vlm_generic.py Family.own) says which of these it has."""

from __future__ import annotations

import importlib
import inspect

import numpy as np

from mlxserve.models.vlm import ImageInput
from mlxserve.models.vlm_families import ProcessorSpec  # noqa: F401 - its users import it from here too
from mlxserve.models.vlm_images import OwnLayout, image_settings


def build_processor(processor: str, pc: dict, tokenizer, image_processor: str | None = None):
    """The family's own processor ("module:Class") over `tokenizer`, with processor_config.json's
    settings it takes, and (where it takes one) its image processor from preprocessor_config.json."""
    from mlxserve.models.vlm_images import own_processor

    if image_processor is not None:
        return own_processor(processor, image_processor, pc, tokenizer)
    module, name = processor.split(":")
    cls = getattr(importlib.import_module(module), name)
    accepted = inspect.signature(cls.__init__).parameters
    pc = pc or {}
    settings = image_settings(pc) | pc.get("processor_config", {})
    return cls(tokenizer=tokenizer, **{k: v for k, v in settings.items() if k in accepted and k != "tokenizer"})


class ProcessorSpans(OwnLayout):
    """OwnLayout for a processor a ProcessorSpec describes."""

    def __init__(self, processor: str, spec: ProcessorSpec, config: dict, pc: dict, tokenizer,
                 image_processor: str | None = None, placeholder: str | None = None):
        def lend_bos(tok):  # a tokenizer without a BOS (a tiny config's) lends it its EOS
            if spec.bos and tok.bos_token is None:
                tok.bos_token = tok.eos_token

        self.spec = spec
        self._build(tokenizer, lambda tok: build_processor(processor, pc, tok, image_processor), lend_bos)
        unknown = (None, self.tokenizer.unk_token_id)
        missing = [t for t in spec.tokens if self.tokenizer.convert_tokens_to_ids(t) in unknown]
        if missing:
            raise ValueError(f"the tokenizer lacks the processor's tokens {missing}")
        # Molmo's processor puts the image before whatever text it is given: its placeholder is "".
        self.placeholder = placeholder if placeholder is not None else self.proc.image_token
        # Whether it writes each image's index before its span (it may be set not to: MiniCPM-V's use_image_id).
        self.numbers_images = False
        if spec.numbered:
            from PIL import Image

            start = self.tokenizer.convert_tokens_to_ids(spec.numbered[0])
            self.numbers_images = start in self._run(Image.new("RGB", (64, 64)))["input_ids"].reshape(-1).tolist()

    def image_prefix(self, index: int) -> str:
        """The text before the prompt's image `index` (from 0) that its span leaves out."""
        return f"{self.spec.numbered[0]}{index}{self.spec.numbered[1]}" if self.numbers_images else ""

    def _unnumbered(self, ids: list[int]) -> int:
        """How many ids the image's index takes at the start of its span (ProcessorSpec.numbered)."""
        if not self.numbers_images:
            return 0
        start, end = (self.tokenizer.convert_tokens_to_ids(t) for t in self.spec.numbered)
        return ids.index(end) + 1 if ids[:1] == [start] else 0

    def token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.spec.image_token or self.placeholder)

    def _run(self, image) -> dict:
        out = self.proc(text=[self.placeholder], images=[image.convert("RGB")])
        keep = ("input_ids", self.spec.pixels, *self.spec.inputs)
        # Copies: a view of an MLX array's buffer (Molmo's processor gives MLX arrays) does not
        # keep its memory from being reused once the array is freed.
        got = {k: out[k] for k in keep if k in out and out[k] is not None}
        ragged = {self.spec.pixels: tuple(np.array(p, copy=True) for p in got.pop(self.spec.pixels)[0])} \
            if self.spec.ragged else {}
        return {k: np.array(v, copy=True) for k, v in got.items()} | ragged

    def layout(self, image) -> ImageInput:
        out = self._run(image)
        ids = [int(t) for t in np.asarray(out.pop("input_ids")).reshape(-1)]
        ids, head = self._span(ids, self._bos[:1] or ([self.tokenizer.bos_token_id] if self.spec.bos else []))
        cut = self._unnumbered(ids)
        ids, head = ids[cut:], head + cut
        pixels = out.pop(self.spec.pixels)
        for k in self.spec.positions:  # positions in the span, not in the processor's ids
            out[k] = np.where(out[k] >= 0, out[k] - head, out[k])
        for k in self.spec.masks:
            out[k] = out[k].reshape(1, -1)[:, head: head + len(ids)]
        return ImageInput(pixels, None, len(ids), ids=tuple(ids), extras=out)

    def pixels(self, image) -> np.ndarray:
        return self._run(image)[self.spec.pixels]

    def prompt_kwargs(self, inp: ImageInput, start: int, length: int) -> dict:
        """image_kwargs for mlx-vlm's own pass over a whole prompt of `length` ids, the image's
        span at `start` (tests compare with it)."""
        import mlx.core as mx

        out = {}
        for k, v in (inp.extras or {}).items():
            if k in self.spec.positions:
                v = np.where(v >= 0, v + start, v)
            elif k in self.spec.masks:
                whole = np.zeros((1, length), v.dtype)
                whole[:, start: start + v.shape[1]] = v
                v = whole
            out[k] = mx.array(v)
        return out


def deepseek_vl2_spatial_crops() -> None:
    """Give mlx-vlm's DeepSeek-VL2 merge a tile grid for every slot it reads.

    Its get_input_embeddings counts each image's tiles in a loop over
    `pixel_values.shape[1]` (the tiles of the batch's largest image), reading
    `images_spatial_crop[idx][jdx]` for each, though that holds one (width, height)
    a image: past its end MLX reads memory it does not own (no bounds check), so the
    count, and whether any rows are merged at all, changed from run to run (found
    by the generated test). The PyTorch original reads zeros there (its grids are
    padded) and stops; here they are padded with zeros so it does.
    """
    import mlx.core as mx
    import mlx_vlm.models.deepseek_vl_v2.deepseek_vl_v2 as deepseek

    original = deepseek.Model.get_input_embeddings
    if getattr(original, "mlxserve", False):
        return

    def get_input_embeddings(self, input_ids=None, pixel_values=None, images_spatial_crop=None,
                             images_seq_mask=None, **kwargs):
        if pixel_values is not None and images_spatial_crop is not None:
            missing = pixel_values.shape[1] - images_spatial_crop.shape[1]
            if missing > 0:
                zeros = mx.zeros((images_spatial_crop.shape[0], missing, 2), images_spatial_crop.dtype)
                images_spatial_crop = mx.concatenate([images_spatial_crop, zeros], axis=1)
        return original(self, input_ids, pixel_values, images_spatial_crop, images_seq_mask, **kwargs)

    get_input_embeddings.mlxserve = True
    deepseek.Model.get_input_embeddings = get_input_embeddings
