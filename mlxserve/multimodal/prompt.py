"""Chat messages with images and video -> prompt text with placeholders -> `PromptImage`s.

The chat template sees each image as its family's placeholder text (Qwen:
<|vision_start|><|image_pad|>...<|vision_end|>, one pad per image token;
Gemma 3: <start_of_image><image_soft_token>...<end_of_image>), so any text
template renders it. After tokenizing, each image's run of image tokens (a
video's run of video tokens, cut into its frame groups) is found in order and
checked against the image it stands for.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from mlxserve.models.chat import render_chat
from mlxserve.multimodal.media import MediaError, MediaLimits, load_image, load_video, pixel_hash


@dataclass
class PromptImage:
    """An image in a tokenized prompt: which tokens it fills and with what.

    `start` is the index of its first placeholder token in the prompt;
    `content_hash` names its decoded pixels (the vision cache's key, and an
    extra key of the prefix blocks it falls in); `pixels` is what the
    model's vision tower takes (an `ImageInput`: numpy, no MLX).
    """

    content_hash: str
    start: int
    num_tokens: int
    pixels: Any
    # Its prompt attends both ways as a whole (PaliGemma's prefix, models/vlm_prefix.py): every prefix
    # block of the prompt is keyed by all of it (Request.block_extra_keys).
    whole_prompt: bool = False


@dataclass
class PreparedImage:
    """An image, or one frame group of a video, ready for the prompt."""

    where: str  # the request part it came from, for error messages
    content_hash: str
    pixels: object  # the adapter's ImageInput
    placeholder: str | None  # text standing for its part in the prompt (a video's on its first group only)


class ImagePartError(MediaError):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


def prepare_images(vision, sources: list[tuple], limits: MediaLimits,
                   is_cached=None) -> list[PreparedImage]:
    """Fetch, decode, hash and preprocess each (where, url[, "image" | "video"]). Blocking: run it in a thread.

    `is_cached(content_hash)` says whether the caches hold an image already
    (its embeddings, or its KV); then its pixel array is left to be made only
    if needed.
    A video gives one PreparedImage per frame group.
    """
    out = []
    videos = 0
    for where, url, *kind in sources:
        try:
            if kind and kind[0] == "video":
                out += _prepared_video(vision, where, load_video(url, limits), videos, is_cached)
                videos += 1
                continue
            out.append(_prepared(vision, where, load_image(url, limits), is_cached, _images(out)))
        except MediaError as e:
            raise ImagePartError(where, str(e)) from None
        except Exception as e:  # noqa: BLE001 - the processor refusing an image (e.g. too small)
            raise ImagePartError(where, f"the image cannot be processed: {e}") from None
    return out


def image_spans(prompt_ids: list[int], vision, images: list[PreparedImage]) -> list[PromptImage]:
    """The PromptImage of each image (or video frame group): where its tokens start in the prompt.

    Each image is a run of image tokens (with the row breaks between them, for a family
    whose images have some: Pixtral's); a video is one run of video tokens, cut into its
    frame groups in order.
    """
    if any(im.pixels.ids is not None for im in images):
        out = _laid_out_spans(prompt_ids, vision.image_span_ids(), images)
        if getattr(vision, "whole_images", False) and out[-1].start + out[-1].num_tokens == len(prompt_ids):
            # Its pass is held whole and the prompt's last token is left to the pass that samples from
            # it (engine/media.py): a prompt ending on such an image would be fed its last token twice.
            raise MediaError("the prompt ends with an image: this model's image tokens attend to each other "
                             "both ways, and some text must follow its last image")
        return out
    # Token id -> which run it belongs to: an image's (its image tokens and breaks) or a video's.
    kind = {t: "image" for t in vision.image_span_ids()} | {vision.video_token_id: "video"}
    kind.pop(None, None)
    runs = []
    i, n = 0, len(prompt_ids)
    while i < n:
        if prompt_ids[i] in kind:
            j = i
            while j < n and kind.get(prompt_ids[j]) == kind[prompt_ids[i]]:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    out, k = [], 0
    for start, length in runs:
        # An image's run, or a video's: the consecutive groups of one video fill one run.
        video = images[k].pixels.video if k < len(images) else None
        taken = 0
        while k < len(images) and taken < length:
            if taken and (video is None or images[k].pixels.video != video):
                break
            im = images[k]
            out.append(PromptImage(im.content_hash, start + taken, im.pixels.num_tokens, im.pixels))
            taken += im.pixels.num_tokens
            k += 1
        if taken != length:
            break
    if k != len(images) or len(out) != len(images) or sum(r[1] for r in runs) != sum(o.num_tokens for o in out):
        raise MediaError("the prompt's image placeholder tokens do not match its images "
                         "(does the text itself contain the model's image or video tokens?)")
    for im in out:
        im.whole_prompt = getattr(vision, "prompt_both_ways", False)
    return out


def _laid_out_spans(prompt_ids: list[int], marks: set[int], images: list[PreparedImage]) -> list[PromptImage]:
    """Images whose family's processor laid each out as a span of ids (text between its tiles):
    each span found whole, in order, and nothing else in the prompt taking the image token (or
    another id that marks images: `marks`, VisionAdapter.image_span_ids)."""
    import numpy as np

    ids = np.asarray(prompt_ids)
    out, pos = [], 0
    for im in images:
        span = np.asarray(im.pixels.ids)
        starts = np.flatnonzero(ids[pos : len(ids) - len(span) + 1] == span[0]) + pos
        start = next((int(i) for i in starts if (ids[i : i + len(span)] == span).all()), None)
        if start is None:
            raise MediaError("the prompt's image placeholder tokens do not match its images "
                             "(does the text itself contain the model's image tokens?)")
        out.append(PromptImage(im.content_hash, start, len(span), im.pixels))
        pos = start + len(span)
    if any((ids == mark).sum() != sum(im.pixels.ids.count(mark) for im in images) for mark in marks):
        raise MediaError("the prompt's text holds the model's image token outside its images")
    return out


def chat_prompt(loaded, messages: list[dict], limits: MediaLimits | None = None, is_cached=None,
                **template_kwargs):
    """(prompt token ids, PromptImages) of a chat whose messages may hold images.

    For Python callers (the LLM class, benchmarks): content is a string or a
    list of parts, {"type": "text", "text": ...}, {"type": "image_url",
    "image_url": {"url": ...}} or {"type": "image", "image": <PIL image>}.
    """
    from mlxserve.multimodal.media import LoadedImage

    vision = loaded.vision
    limits = limits or MediaLimits()
    rendered, images = [], []
    for i, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            text = ""
            for j, part in enumerate(content):
                if part.get("type") == "text":
                    text += part["text"]
                    continue
                if vision is None:
                    raise MediaError(f"messages[{i}].content[{j}]: this model takes text only")
                where, kind = f"messages[{i}].content[{j}]", part.get("type")
                videos = sum(1 for p in images if p.placeholder and p.pixels.video is not None)
                if kind == "image":
                    image = part["image"].convert("RGB")
                    prepared = [_prepared(vision, where, LoadedImage(image, pixel_hash(image)), is_cached,
                                          _images(images))]
                elif kind == "video":  # a list of frames (PIL images)
                    frames = [f.convert("RGB") for f in part["video"]]
                    prepared = _prepared_video(vision, where, frames, videos, is_cached)
                elif kind == "video_url":
                    frames = load_video(part["video_url"]["url"], limits)
                    prepared = _prepared_video(vision, where, frames, videos, is_cached)
                else:
                    loaded_image = load_image(part["image_url"]["url"], limits)
                    prepared = [_prepared(vision, where, loaded_image, is_cached, _images(images))]
                images += prepared
                text += prepared[0].placeholder
            m = {**m, "content": text}
        rendered.append(m)
    ids = render_chat(loaded.tokenizer, rendered, **template_kwargs)
    return ids, (image_spans(ids, vision, images) if images else [])


def _prepared_video(vision, where: str, frames: list, video: int, is_cached=None) -> list[PreparedImage]:
    """Frame groups of one video, each keyed by its frames' pixels and the size they are resized to.

    The video's pixel array is made here unless the vision cache holds every group.
    """
    groups = vision.preprocess_video(frames, video)
    per_group = -(-len(frames) // len(groups))
    frame_hashes = [pixel_hash(f) for f in frames]
    out = []
    for g, pixels in enumerate(groups):
        key = hashlib.sha256(f"video-group:{pixels.grid_thw}:".encode())
        for h in frame_hashes[g * per_group : (g + 1) * per_group]:
            key.update(h.encode())
        out.append(PreparedImage(where, key.hexdigest(), pixels, vision.video_placeholder(groups) if g == 0 else None))
    if not (is_cached and all(is_cached(p.content_hash) for p in out)):
        for p in out:
            vision.pixels(p.pixels)
    return out


def _images(prepared: list[PreparedImage]) -> int:
    """How many images (not video frame groups) are in the prompt so far."""
    return sum(1 for p in prepared if p.pixels.video is None)


def _prepared(vision, where: str, loaded_image, is_cached=None, index: int = 0) -> PreparedImage:
    """The prompt's image `index` (from 0): a family whose processor numbers its images (MiniCPM-V)
    has the number before the image's placeholder, outside its span."""
    cached = is_cached is not None and is_cached(loaded_image.content_hash)
    pixels = vision.preprocess(loaded_image.image, pixels=not cached)
    prefix = vision.image_prefix(index) if hasattr(vision, "image_prefix") else ""
    return PreparedImage(where, loaded_image.content_hash, pixels, prefix + vision.placeholder(pixels))
