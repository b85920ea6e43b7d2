"""Families whose processor marks an image with ids outside the vocabulary: LLaVA-Bunny's and
FastVLM's one id -200, which mlx-vlm's merge expands into all of the image's rows; Phi-3-vision's
run of -1, one a row.

mlxserve's prompt is the tokenizer's ids, one a row the language model reads, and the engine
splices an image's rows over its span; the prefix cache keys a block by its ids and the content
hash of the images in it. So the span's ids need not say anything of the image: here they are
copies of one stand-in token (ImageInput.ids, found in the prompt by models/../prompt.py's
`_laid_out_spans`), while the tower is given the processor's own ids (ImageInput.tower_ids)
with the pixels. A marker that expands gives a number of rows known only once the tower has
run: it is read once at load off a probe image (`rows`), which holds for every image because
these processors resize each image to one fixed size (checked at every image).
"""

from __future__ import annotations

import numpy as np

from mlxserve.models.vlm import ImageInput


def stand_in(tokenizer) -> int:
    """The token an image's rows stand as in the prompt: the tokenizer's unk, else its pad.

    Why those: a special token is one id whatever text is around it (the placeholder text
    tokenizes back to exactly N of them); chat templates never write unk or pad themselves,
    so a prompt holding one outside an image is the user's own text, which prompt.py refuses
    (it would be read as image rows); and its embedding never reaches the language model (the
    image's rows replace it). Not bos or eos: templates write those around every turn.
    """
    marks = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    for token in (tokenizer.unk_token, tokenizer.pad_token):
        if token is None:
            continue
        tid = tokenizer.convert_tokens_to_ids(token)
        text = tokenizer.decode([tid] * 3, clean_up_tokenization_spaces=False)
        if tid not in marks and tokenizer(text, add_special_tokens=False)["input_ids"] == [tid] * 3:
            return tid
    raise ValueError("the tokenizer has no unk or pad token (apart from its bos and eos) that tokenizes back to "
                     "itself, to stand for an image's rows in the prompt")


class MarkedImages:
    """An image as its family's processor gives it: pixels, and the ids outside the vocabulary
    that its processor writes for it (`_marker`); in the prompt, one stand-in a row."""

    expands = True  # one marker id, expanded by mlx-vlm's merge into all of the image's rows
    rows: int | None = None  # how many: set at load, off a probe image (GenericVLM)
    int_mask = True  # get_input_embeddings is given an integer mask, as the processor's attention_mask is

    def __init__(self, config: dict, pc: dict, tokenizer):
        self.tokenizer = tokenizer
        self.stand_in = stand_in(tokenizer)
        self.marker = config.get("image_token_index", -200)
        self._shape = None  # the probe's pixel shape: every image's, for `rows` to hold

    def probe(self) -> ImageInput:
        """An image for the tower, to count the rows an expanding marker gives."""
        from PIL import Image

        pixels = self.pixels(Image.new("RGB", (64, 48), (127, 90, 30)))
        self._shape = pixels.shape
        return ImageInput(pixels, None, 0, tower_ids=(self.marker,))

    def layout(self, image) -> ImageInput:
        tower = self._marker(image)
        if not self.expands:  # one id a row
            n, pixels = len(tower), None
        else:  # `rows` rows, which this image's pixels must give
            n, pixels = self.rows, self.pixels(image)
            if pixels.shape != self._shape:
                raise ValueError(f"the image processor gave pixels of shape {pixels.shape}, not the {self._shape} "
                                 f"that this model's {self.rows} image rows were counted at")
        return ImageInput(pixels, None, n, ids=(self.stand_in,) * n, tower_ids=tower, extras=self._extras(image))

    def _marker(self, image) -> tuple[int, ...]:
        return (self.marker,)

    def _extras(self, image) -> dict | None:
        return None

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {k: mx.array(v) for k, v in (inp.extras or {}).items()}


class BunnyImages(MarkedImages):
    """LLaVA-Bunny: mlx-vlm ships no processor for it, only its SigLIP ImageProcessor (resized to
    384 px, normalized), built as mlx-vlm's load_image_processor builds it (with its defaults),
    and its prepare_inputs, which splits the prompt at "<image>" and puts image_token_index there."""

    def __init__(self, config: dict, pc: dict, tokenizer):
        super().__init__(config, pc, tokenizer)
        from mlx_vlm.models.llava_bunny.llava_bunny import ImageProcessor

        self.proc = ImageProcessor()

    def pixels(self, image) -> np.ndarray:
        return np.stack(self.proc.preprocess([image.convert("RGB")])).astype(np.float32)


class FastVLMImages(MarkedImages):
    """FastVLM: mlx-vlm's FastVLMImageProcessor (padded square, resized to one size), read from
    preprocessor_config.json as its FastVLMProcessor.from_pretrained reads it; "<image>" is its
    IMAGE_TOKEN_INDEX (-200)."""

    KEYS = ("size", "crop_size", "resample", "do_resize", "do_center_crop", "do_rescale", "do_normalize",
            "do_convert_rgb", "rescale_factor", "image_mean", "image_std")

    def __init__(self, config: dict, pc: dict, tokenizer):
        super().__init__(config, pc, tokenizer)
        from mlx_vlm.models.fastvlm.processing import IMAGE_TOKEN_INDEX, FastVLMImageProcessor

        self.proc = FastVLMImageProcessor(**{k: pc[k] for k in self.KEYS if k in pc})
        self.marker = IMAGE_TOKEN_INDEX

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self.proc(images=[image.convert("RGB")], return_tensors=None)["pixel_values"], np.float32)


class Phi3VImages(MarkedImages):
    """Phi-3-vision: mlx-vlm's Phi3VImageProcessor's HD transform (336 px crops of a grid under
    num_crops, after the whole image resized), its numpy steps (its __call__ returns MLX arrays,
    which may not be made off the engine thread); its processor writes an image as
    calc_num_image_tokens copies of -1 (-2 for a second image: the tower reads any negative id
    as an image row), each a row."""

    expands = False

    def __init__(self, config: dict, pc: dict, tokenizer):
        super().__init__(config, pc, tokenizer)
        from mlx_vlm.models.phi3_v.processing_phi3_v import Phi3VImageProcessor

        self.proc = Phi3VImageProcessor(**{k: pc[k] for k in ("num_crops", "num_img_tokens") if k in pc})

    def pixels(self, image) -> np.ndarray:
        return self.proc._process_single_image(image.convert("RGB"))[0][None].astype(np.float32)

    def _extras(self, image) -> dict:
        from mlx_vlm.models.phi3_v.processing_phi3_v import _calc_hd_transform_size

        width, height = _calc_hd_transform_size(image.width, image.height, self.proc.num_crops)
        return {"image_sizes": np.asarray([[height, width]])}

    def _marker(self, image) -> tuple[int, ...]:
        return (-1,) * self.proc.calc_num_image_tokens(image)


class Phi4SiglipImages(MarkedImages):
    """Phi-4-SigLIP: "<image>" is its IMAGE_TOKEN_INDEX (-200), which mlx-vlm's merge expands into
    one row a valid SigLIP-2 NaFlex patch: the image resized to a patch grid under max_num_patches
    (its count varies with the aspect, so each image's rows are its pixel_attention_mask's sum, not
    a probe's). Its image processor as mlx-vlm's Phi4SigLipProcessor.from_pretrained builds it from
    config.json, in transformers' PIL backend (the other needs torch); NaFlex always: mlx-vlm's
    tower takes NaFlex patches and their spatial shapes only."""

    def __init__(self, config: dict, pc: dict, tokenizer):
        super().__init__(config, pc, tokenizer)
        import transformers
        from mlx_vlm.models.phi4_siglip.processing_phi4_siglip import IMAGE_TOKEN_INDEX

        self.marker = IMAGE_TOKEN_INDEX
        vc, tower = config.get("vision_config") or {}, (config.get("mm_vision_tower") or "").lower()
        patch = vc.get("patch_size") or (14 if "patch14" in tower else 16)
        self.proc = transformers.Siglip2ImageProcessorPil(
            patch_size=patch, max_num_patches=config.get("max_num_patches", 3600),
            min_num_patches=config.get("min_num_patches", 256), do_resize=True, do_rescale=True, do_normalize=True,
            image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])

    def _run(self, image) -> dict:
        out = self.proc(images=[image.convert("RGB")], return_tensors="np")
        return {k: np.asarray(out[k]) for k in ("pixel_values", "spatial_shapes", "pixel_attention_mask")}

    def probe(self) -> ImageInput:
        from PIL import Image

        out = self._run(Image.new("RGB", (64, 48), (127, 90, 30)))
        return ImageInput(out.pop("pixel_values").astype(np.float32), None, 0, tower_ids=(self.marker,), extras=out)

    def layout(self, image) -> ImageInput:
        out = self._run(image)
        n = int(out["pixel_attention_mask"].sum())
        return ImageInput(out.pop("pixel_values").astype(np.float32), None, n, ids=(self.stand_in,) * n,
                          tower_ids=(self.marker,), extras=out)

    def pixels(self, image) -> np.ndarray:
        return self._run(image)["pixel_values"].astype(np.float32)


MARKED = {"llava_bunny": BunnyImages, "fastvlm": FastVLMImages, "phi3_v": Phi3VImages,
          "phi4_siglip": Phi4SiglipImages}
