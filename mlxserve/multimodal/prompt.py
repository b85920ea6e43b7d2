"""Chat messages with images -> prompt text with placeholders -> `PromptImage`s.

The chat template sees each image as its family's placeholder text (Qwen:
<|vision_start|><|image_pad|>...<|vision_end|>, one pad per image token;
Gemma 3: <start_of_image><image_soft_token>...<end_of_image>), so any text
template renders it. After tokenizing, each image's run of image tokens is
found in order and checked against the image it stands for.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlxserve.engine.request import PromptImage
from mlxserve.multimodal.media import MediaError, MediaLimits, load_image


@dataclass
class PreparedImage:
    where: str  # the request part it came from, for error messages
    content_hash: str
    pixels: object  # the adapter's ImageInput
    placeholder: str  # text standing for it in the prompt


class ImagePartError(MediaError):
    def __init__(self, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.where = where


def prepare_images(vision, sources: list[tuple[str, str]], limits: MediaLimits,
                   have_embeddings=None) -> list[PreparedImage]:
    """Fetch, decode, hash and preprocess each (where, url). Blocking: run it in a thread.

    `have_embeddings(content_hash)` says whether the vision cache holds an
    image already; then its pixel array is left to be made only if needed.
    """
    out = []
    for where, url in sources:
        try:
            out.append(_prepared(vision, where, load_image(url, limits), have_embeddings))
        except MediaError as e:
            raise ImagePartError(where, str(e)) from None
        except Exception as e:  # noqa: BLE001 - the processor refusing an image (e.g. too small)
            raise ImagePartError(where, f"the image cannot be processed: {e}") from None
    return out


def image_spans(prompt_ids: list[int], image_token_id: int, images: list[PreparedImage]) -> list[PromptImage]:
    """The PromptImage of each image: where its run of image tokens starts in the prompt."""
    runs = []
    i, n = 0, len(prompt_ids)
    while i < n:
        if prompt_ids[i] == image_token_id:
            j = i
            while j < n and prompt_ids[j] == image_token_id:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    if len(runs) != len(images) or any(length != im.pixels.num_tokens for (_, length), im in zip(runs, images)):
        raise MediaError("the prompt's image placeholder tokens do not match its images "
                         "(does the text itself contain the model's image tokens?)")
    return [PromptImage(im.content_hash, start, length, im.pixels) for (start, length), im in zip(runs, images)]


def chat_prompt(loaded, messages: list[dict], limits: MediaLimits | None = None, have_embeddings=None,
                **template_kwargs):
    """(prompt token ids, PromptImages) of a chat whose messages may hold images.

    For Python callers (the LLM class, benchmarks): content is a string or a
    list of parts, {"type": "text", "text": ...}, {"type": "image_url",
    "image_url": {"url": ...}} or {"type": "image", "image": <PIL image>}.
    """
    from mlxserve.llm import render_chat
    from mlxserve.multimodal.media import LoadedImage, pixel_hash

    vision = loaded.vision
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
                if part.get("type") == "image":
                    image = part["image"].convert("RGB")
                    prepared = _prepared(vision, f"messages[{i}].content[{j}]", LoadedImage(image, pixel_hash(image)),
                                         have_embeddings)
                else:
                    (prepared,) = prepare_images(vision, [(f"messages[{i}].content[{j}]", part["image_url"]["url"])],
                                                 limits or MediaLimits(), have_embeddings)
                images.append(prepared)
                text += prepared.placeholder
            m = {**m, "content": text}
        rendered.append(m)
    ids = render_chat(loaded.tokenizer, rendered, **template_kwargs)
    return ids, (image_spans(ids, vision.image_token_id, images) if images else [])


def _prepared(vision, where: str, loaded_image, have_embeddings=None) -> PreparedImage:
    cached = have_embeddings is not None and have_embeddings(loaded_image.content_hash)
    pixels = vision.preprocess(loaded_image.image, pixels=not cached)
    return PreparedImage(where, loaded_image.content_hash, pixels, vision.placeholder(pixels))
