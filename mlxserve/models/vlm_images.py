"""Image and video processors of the generic adapter's families (models/vlm_generic.py): how
an image becomes the tower's input (numpy, off the engine thread), how many tokens it takes,
and what else mlx-vlm's get_input_embeddings wants with its pixels (its grid, its size).
Each follows the family's own processor (transformers' or mlx-vlm's), read from the model
folder's preprocessor_config.json as that processor is."""

from __future__ import annotations

import importlib
import inspect
import math
from functools import partial

import numpy as np

from mlxserve.models.vlm import ImageInput, video_groups
from mlxserve.models.vlm_layouts import GotImages, InternVLTiles


def qwen_image_processor(config: dict, pc: dict):
    """Qwen's image processor from preprocessor_config.json: min/max pixels, or Qwen3-VL's
    `size: {shortest_edge, longest_edge}` (the same bounds, in pixels)."""
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLImageProcessor

    vc = config["vision_config"]
    size = pc.get("size") if isinstance(pc.get("size"), dict) else {}
    return Qwen3VLImageProcessor(
        patch_size=pc.get("patch_size", vc.get("patch_size", 14)),
        merge_size=pc.get("merge_size", vc.get("spatial_merge_size", 2)),
        temporal_patch_size=pc.get("temporal_patch_size", vc.get("temporal_patch_size", 2)),
        min_pixels=pc.get("min_pixels", size.get("shortest_edge", 56 * 56)),
        max_pixels=pc.get("max_pixels", size.get("longest_edge", 14 * 14 * 4 * 1280)),
        image_mean=pc.get("image_mean"),
        image_std=pc.get("image_std"),
    )


def image_settings(pc: dict) -> dict:
    """preprocessor_config.json's own settings, without the other files' read beside it
    (models/vlm.py processor_config)."""
    return {k: v for k, v in pc.items() if k not in ("video_preprocessor_config", "processor_config")}


class QwenImages:
    """Qwen3-VL / Qwen3.5: the image smart-resized to multiples of patch x merge, one (1, h, w) grid."""

    def __init__(self, config: dict, pc: dict):
        self.proc = qwen_image_processor(config, pc)

    def layout(self, image) -> ImageInput:
        h, w = self.proc._resolved_size(image.height, image.width)
        grid = (1, h // self.proc.patch_size, w // self.proc.patch_size)
        return ImageInput(None, grid, math.prod(grid) // self.proc.merge_size**2)

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self.proc(images=[image])["pixel_values"])

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {"image_grid_thw": mx.array([inp.grid_thw])}


class Gemma4Images:
    """Gemma 4: resized within a patch budget (max_soft_tokens x pool^2), sides multiples of pool x patch."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.gemma4.processing_gemma4 import Gemma4ImageProcessor

        self.proc = Gemma4ImageProcessor(**image_settings(pc))

    def layout(self, image) -> ImageInput:
        from mlx_vlm.models.gemma4.processing_gemma4 import get_aspect_ratio_preserving_size

        p, k = self.proc.patch_size, self.proc.pooling_kernel_size
        h, w = get_aspect_ratio_preserving_size(image.height, image.width, p, self.proc.max_soft_tokens * k * k, k)
        return ImageInput(None, None, (h // p) * (w // p) // (k * k))

    def pixels(self, image) -> np.ndarray:
        data, _ = self.proc([image.convert("RGB")])
        pv = data["pixel_values"]
        return np.asarray(pv) if isinstance(pv, np.ndarray) else np.asarray(pv[0])[None]

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        return {}


class PatchGrid:
    """An image processor that gives an image's patches and its (t, h, w) patch grid, as Qwen2-VL's
    does: transformers' (its numpy/PIL backend: GLM-4V's) or mlx-vlm's own (PaddleOCR-VL's). Its
    tokens: the grid over merge x merge. Read from preprocessor_config.json as the model's own
    processor is."""

    def __init__(self, class_name: str, config: dict, pc: dict):
        import transformers

        vc = config["vision_config"]
        settings = {"patch_size": vc.get("patch_size"), "merge_size": vc.get("spatial_merge_size"),
                    "temporal_patch_size": vc.get("temporal_patch_size")}
        settings = {k: v for k, v in settings.items() if v is not None} | image_settings(pc)
        if ":" in class_name:  # a processor of mlx-vlm's own ("module:Class")
            module, name = class_name.split(":")
            self.proc = getattr(importlib.import_module(module), name)(**settings)
        else:
            self.proc = getattr(transformers, class_name).from_dict(settings)
        self.merge = self.proc.merge_size

    def _run(self, image) -> dict:
        # Asked for numpy, unless it takes no such argument (mlx-vlm's ERNIE 4.5 VL's: numpy always).
        taken = inspect.signature(self.proc.preprocess).parameters
        asks = "return_tensors" in taken or any(p.kind == p.VAR_KEYWORD for p in taken.values())
        return self.proc(images=[image.convert("RGB")], **({"return_tensors": "np"} if asks else {}))

    def layout(self, image) -> ImageInput:
        out = self._run(image)  # the processor's resize decides the grid: its pixels come with it
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        return ImageInput(np.asarray(out["pixel_values"]), grid, math.prod(grid) // self.merge**2)

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self._run(image)["pixel_values"])

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {"image_grid_thw": mx.array([inp.grid_thw])}


class PixtralImages:
    """Pixtral / Mistral 3: the image resized to fit a longest edge, sides multiples of patch x
    merge (mlx-vlm's PixtralImageProcessor), laid out as rows of image tokens, each ended by a
    break token and the last by an end token ([IMG]...[IMG_BREAK]...[IMG_END]), as mlx-vlm's
    PixtralProcessor renders it. Its tokens: rows x (columns + 1)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.pixtral.image_processing_pixtral import PixtralImageProcessor

        settings = image_settings(pc)
        self.proc = PixtralImageProcessor(**{k: v for k, v in settings.items()
                                             if k in ("size", "image_mean", "image_std", "do_resize", "do_rescale",
                                                      "rescale_factor", "do_normalize", "resample")})
        # As mlx-vlm's Mistral3Processor reads them: the tower's patch, the model's merge.
        names = pc.get("processor_config", {})
        merge = config.get("spatial_merge_size", names.get("spatial_merge_size", 1))
        self.step = config["vision_config"].get("patch_size", 16) * merge
        self.break_text = names.get("image_break_token", "[IMG_BREAK]")
        self.end_text = names.get("image_end_token", "[IMG_END]")

    def layout(self, image) -> ImageInput:
        out = self.proc(images=[image.convert("RGB")], patch_size=self.step)
        h, w = (int(x) for x in out["image_sizes"][0])
        rows, cols = h // self.step, w // self.step
        return ImageInput(np.asarray(out["pixel_values"]), (1, rows, cols), rows * (cols + 1))

    def pixels(self, image) -> np.ndarray:
        return np.asarray(self.proc(images=[image.convert("RGB")], patch_size=self.step)["pixel_values"])

    def image_kwargs(self, inp: ImageInput) -> dict:
        import mlx.core as mx

        _, rows, cols = inp.grid_thw
        return {"image_sizes": mx.array([[rows * self.step, cols * self.step]])}

    def token_ids(self, inp: ImageInput, image: int, brk: int, end: int) -> list[int]:
        _, rows, cols = inp.grid_thw
        return [t for r in range(rows) for t in [image] * cols + [brk if r < rows - 1 else end]]


class CompassImages:
    """Cohere Compass: the image smart-resized to multiples of patch x merge (PIL bicubic), its
    frame doubled on the temporal axis, cut into merge-ordered patches: mlx-vlm's
    CohereCompassImageProcessor's steps, in numpy (it converts its output to MLX arrays)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.cohere_compass.processing_cohere_compass import CohereCompassImageProcessor

        self.proc = CohereCompassImageProcessor(config={"vision_config": config["vision_config"]},
                                                **image_settings(pc))

    def _grid(self, image) -> tuple[int, int]:
        from mlx_vlm.models.cohere_compass.processing_cohere_compass import smart_resize

        p = self.proc
        return smart_resize(image.height, image.width, factor=p.patch_size * p.merge_size, min_pixels=p.min_pixels,
                            max_pixels=p.max_pixels)

    def layout(self, image) -> ImageInput:
        h, w = self._grid(image)
        grid = (1, h // self.proc.patch_size, w // self.proc.patch_size)
        return ImageInput(None, grid, math.prod(grid) // self.proc.merge_size**2)

    def pixels(self, image) -> np.ndarray:
        from PIL import Image

        p, (h, w) = self.proc, self._grid(image)
        x = np.asarray(image.convert("RGB").resize((w, h), Image.Resampling.BICUBIC), np.float32).transpose(2, 0, 1)
        x = (x * p.rescale_factor - np.asarray(p.image_mean)[:, None, None]) / np.asarray(p.image_std)[:, None, None]
        t, m, s = p.temporal_patch_size, p.merge_size, p.patch_size
        x = np.repeat(x[None, None], t, axis=1).reshape(1, 1, t, 3, h // s // m, m, s, w // s // m, m, s)
        return x.transpose(0, 1, 4, 7, 5, 8, 3, 2, 6, 9).reshape(h * w // s // s, 3 * t * s * s)

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {"image_grid_thw": mx.array([inp.grid_thw])}


class KimiImages:
    """Kimi-VL, Kimi K2.5 (MoonViT): the image scaled under a patch budget and cropped or padded to
    multiples of patch x merge kernel (the `rescale` of mlx-vlm's processor for the family, PIL),
    then normalized and cut into (C, patch, patch) patches in numpy, as that processor does with
    MLX (which may not run off the engine thread). Its tokens: the (h, w) patch grid over the
    merge kernel."""

    def __init__(self, processor: str, config: dict, pc: dict):
        module, name = processor.split(":")
        cls = getattr(importlib.import_module(module), name)
        vc, settings = config["vision_config"], image_settings(pc)
        for key in ("patch_size", "in_token_limit", "merge_kernel_size"):  # as mlx-vlm's processors take them
            if key in vc:
                settings.setdefault(key, vc[key])
        accepted = inspect.signature(cls.__init__).parameters
        self.proc = cls(**{k: v for k, v in settings.items() if k in accepted and k not in ("self", "kwargs")})

    def _patches(self, image) -> tuple[np.ndarray, tuple[int, int]]:
        p = self.proc.patch_size
        image = self.proc.rescale(image.convert("RGB"))
        x = np.asarray(image, np.float32) / 255.0
        x = ((x - np.asarray(self.proc.image_mean, np.float32)) / np.asarray(self.proc.image_std, np.float32))
        h, w = x.shape[0] // p, x.shape[1] // p
        patches = x.transpose(2, 0, 1).reshape(3, h, p, w, p).transpose(1, 3, 0, 2, 4).reshape(-1, 3, p, p)
        return np.ascontiguousarray(patches), (h, w)

    def layout(self, image) -> ImageInput:
        patches, (h, w) = self._patches(image)
        kh, kw = self.proc.merge_kernel_size
        return ImageInput(patches, (1, h, w), h * w // (kh * kw))

    def pixels(self, image) -> np.ndarray:
        return self._patches(image)[0]

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        _, h, w = inp.grid_thw
        return {"image_grid_hws": mx.array([[h, w]]), "_grid_shapes": [(h, w)]}


def own_processor(processor: str, image_processor: str, pc: dict, tokenizer):
    """A family's own processor ("module:Class") over `tokenizer` (which it may add its image
    tokens to), with its image processor (transformers' class name, or "module:Class")."""
    import transformers

    def resolve(name: str):
        if ":" in name:
            module, name = name.split(":")
            return getattr(importlib.import_module(module), name)
        return getattr(transformers, name)

    cls = resolve(processor)
    accepted = inspect.signature(cls.__init__).parameters
    own = {k: v for k, v in pc.get("processor_config", {}).items() if k in accepted}
    return cls(image_processor=resolve(image_processor).from_dict(image_settings(pc)), tokenizer=tokenizer, **own)


class OwnLayout:
    """A family whose own processor lays an image out in the prompt: tiles or crops and a
    thumbnail with tokens between them (Idefics3, SmolVLM, InternVL, Phi-3-vision...), an
    any-resolution grid (LLaVA-NeXT). The processor (mlx-vlm's or transformers', built from
    preprocessor_config.json and processor_config.json as its from_pretrained reads them) is
    run on the image's placeholder alone: the ids it gives are the image's span, kept whole
    (one image is one run of the prompt, cached as one), and its other outputs go to the
    tower with the pixels."""

    def __init__(self, processor: str, image_processor: str, config: dict, pc: dict, tokenizer,
                 placeholder: str | None = None):
        self._build(tokenizer, lambda tok: own_processor(processor, image_processor, pc, tok))
        self.placeholder = placeholder or self.proc.image_token

    def _build(self, tokenizer, build, prepare=None) -> None:
        """`self.proc = build(tokenizer)`, on a copy of the tokenizer (`prepare` may set it up).

        The processor adds its image tokens to the tokenizer it is given (a no-op for the model's
        own, which has them): given a copy, a tokenizer that lacks them is found and refused."""
        import copy

        self.tokenizer = copy.deepcopy(tokenizer)
        size = len(self.tokenizer)
        if prepare is not None:
            prepare(self.tokenizer)
        self.proc = build(self.tokenizer)
        if len(self.tokenizer) != size:
            added = self.tokenizer.convert_ids_to_tokens(list(range(size, len(self.tokenizer))))
            raise ValueError(f"the tokenizer lacks the processor's image tokens {added}")
        self._bos = self.tokenizer("")["input_ids"]  # what the tokenizer adds around any text

    def _span(self, ids: list[int], bos: list[int]) -> tuple[list[int], int]:
        """The image's span in the processor's `ids` (without the `bos` it starts with, or the
        tokenizer's closing token), and how many ids were dropped before it; checked to
        tokenize back to itself, as its placeholder text will be."""
        head = 1 if bos and ids[:1] == bos else 0
        tail = 1 if len(self._bos) > 1 and ids[-1:] == self._bos[-1:] else 0
        ids = ids[head: len(ids) - tail]
        text = self.tokenizer.decode(ids, clean_up_tokenization_spaces=False)
        if self.tokenizer(text, add_special_tokens=False)["input_ids"] != ids:
            raise ValueError("the processor's image layout does not tokenize back to itself")
        return ids, head

    def token_id(self) -> int:
        return self.tokenizer.convert_tokens_to_ids(self.placeholder)

    def _run(self, image) -> dict:
        out = self.proc(text=[self.placeholder], images=[image.convert("RGB")])
        return {k: np.asarray(v) for k, v in out.items() if v is not None and k != "attention_mask"}

    def layout(self, image) -> ImageInput:
        out = self._run(image)
        ids, _ = self._span([int(t) for t in out.pop("input_ids")[0]], self._bos[:1])
        pixels = out.pop("pixel_values")
        return ImageInput(pixels, None, len(ids), ids=tuple(ids), extras=out)

    def pixels(self, image) -> np.ndarray:
        return self._run(image)["pixel_values"]

    @staticmethod
    def image_kwargs(inp: ImageInput) -> dict:
        import mlx.core as mx

        return {k: mx.array(v) for k, v in (inp.extras or {}).items()}


def _nemotron_omni(config: dict, pc: dict):
    from mlxserve.models.vlm_omni import NemotronOmniImages

    return NemotronOmniImages(config, pc)


def _inkling(config: dict, pc: dict):
    from mlxserve.models.vlm_omni import InklingImages

    return InklingImages(config, pc)


def _phi4mm(config: dict, pc: dict):
    from mlxserve.models.vlm_omni import Phi4MMImages

    return Phi4MMImages(config, pc)


def _multi_modality(config: dict, pc: dict):
    from mlxserve.models.vlm_fixed import DeepSeekVLImages

    return DeepSeekVLImages(config, pc)


def _plamo2vl(config: dict, pc: dict):
    from mlxserve.models.vlm_fixed import PlamoTiles

    return PlamoTiles(config, pc)


def _deepseek_ocr(config: dict, pc: dict):
    from mlxserve.models.vlm_ocr import DeepSeekOCRImages

    return DeepSeekOCRImages(config, pc)


def image_processor(name: str, config: dict, pc: dict):
    """A family's image processor by its Family.processor name (models/vlm_generic.py)."""
    if name in PROCESSORS:
        return PROCESSORS[name](config, pc)
    return PatchGrid(name, config, pc)


PROCESSORS = {
    "qwen": QwenImages, "gemma4": Gemma4Images, "cohere_compass": CompassImages, "pixtral": PixtralImages,
    "kimi_vl": partial(KimiImages, "mlx_vlm.models.kimi_vl.processing_kimi_vl:KimiVLImageProcessor"),
    "kimi_k25": partial(KimiImages, "mlx_vlm.models.kimi_k25.processing_kimi_k25:KimiK25ImageProcessor"),
    "locateanything": partial(
        KimiImages, "mlx_vlm.models.locateanything.image_processing_locateanything:LocateAnythingImageProcessor"),
    # Several tower inputs an image (models/vlm_layouts.py)
    "internvl": partial(InternVLTiles, chat=False), "internvl_chat": partial(InternVLTiles, chat=True),
    "nemotron_omni": _nemotron_omni, "phi4mm": _phi4mm, "inkling": _inkling,  # models/vlm_omni.py
    "got": GotImages,
    "multi_modality": _multi_modality, "plamo2vl": _plamo2vl,  # models/vlm_fixed.py
    "deepseekocr": _deepseek_ocr, "deepseekocr_2": _deepseek_ocr,  # models/vlm_ocr.py
}


class QwenVideo:
    """Qwen3-VL / Qwen3.5 video, as mlx-vlm's Qwen3VLProcessor renders it: each frame group is a
    vision block of its own after its time, `<1.5 seconds><|vision_start|><|video_pad|>...<|vision_end|>`
    (so M-RoPE places every group as an image of grid (1, h, w), text between them)."""

    def __init__(self, config: dict, pc: dict):
        from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLVideoProcessor

        # As mlx-vlm reads them (_qwen_vl_video_kwargs): video_preprocessor_config.json, else the image settings.
        raw = pc.get("video_preprocessor_config") or pc
        vc = config["vision_config"]
        size = raw.get("size") if isinstance(raw.get("size"), dict) else {}
        kwargs = {"patch_size": vc.get("patch_size", 16), "merge_size": vc.get("spatial_merge_size", 2),
                  "temporal_patch_size": vc.get("temporal_patch_size", 2)}
        kwargs.update({k: raw[k] for k in ("patch_size", "temporal_patch_size", "merge_size", "fps", "min_frames",
                                           "max_frames", "image_mean", "image_std", "rescale_factor", "do_rescale",
                                           "do_normalize", "do_convert_rgb") if k in raw})
        for key, bound in (("min_pixels", "shortest_edge"), ("max_pixels", "longest_edge")):
            if raw.get(key, size.get(bound)) is not None:
                kwargs[key] = raw.get(key, size.get(bound))
        self.processor = Qwen3VLVideoProcessor(**kwargs)

    def groups(self, frames: list, video: int) -> list[ImageInput]:
        """The frame groups, each with its time: its first and last frame's mean, in seconds from the
        decoder's frame times, else (frames given as a list) at the processor's fps, as mlx-vlm does."""
        groups = video_groups(self.processor, frames, video)
        tps = self.processor.temporal_patch_size
        times = list(getattr(frames, "times", None) or [i / self.processor.fps for i in range(len(frames))])
        times += times[-1:] * (len(groups) * tps - len(times))  # the last group is filled with the last frame
        for g, group in enumerate(groups):
            group.seconds = (times[g * tps] + times[(g + 1) * tps - 1]) / 2
        return groups

    @staticmethod
    def placeholder(groups: list[ImageInput], start: str, pad: str, end: str) -> str:
        return "".join(f"<{g.seconds:.1f} seconds>{start}{pad * g.num_tokens}{end}" for g in groups)

    @staticmethod
    def tower_kwargs(group: ImageInput, pixels) -> dict:
        import mlx.core as mx

        return {"pixel_values_videos": pixels, "video_grid_thw": mx.array([group.grid_thw])}


VIDEOS = {"qwen3": QwenVideo}
