"""Images in requests, for both APIs: fetch, decode and preprocess off the event loop; 400 on any bad one."""

from __future__ import annotations

import asyncio

from mlxserve.api.errors import bad_request
from mlxserve.multimodal.media import MediaError
from mlxserve.multimodal.prompt import ImagePartError, PreparedImage, image_spans, prepare_images


async def prepare(state, sources: list[tuple[str, str]], *, type_name: str) -> list[PreparedImage]:
    """PreparedImages of (where, url) pairs in prompt order; [] if none."""
    if not sources:
        return []
    vision = state.loaded.vision
    if vision is None:
        where = sources[0][0]
        raise bad_request(f"{where}: content of type {type_name!r} is not supported; this model "
                          "takes text only", f"{where}.type")
    try:
        return await asyncio.to_thread(prepare_images, vision, sources, state.media_limits,
                                       state.engine.image_is_cached)
    except ImagePartError as e:
        raise bad_request(str(e), e.where) from None


def placeholders(state, prepared: list[PreparedImage]):
    """An iterator over the images' placeholder texts (None for a text-only model)."""
    return iter([p.placeholder for p in prepared if p.placeholder is not None]) if state.loaded.vision else None


def prompt_images(state, prompt: list[int], prepared: list[PreparedImage], param: str) -> list:
    """The engine's PromptImages: each image's run of tokens in the rendered prompt."""
    if not prepared:
        return []
    try:
        return image_spans(prompt, state.loaded.vision, prepared)
    except MediaError as e:
        raise bad_request(f"{param}: {e}", param) from None


def content_text(parts, placeholders, *, media_types: tuple, where) -> str:
    """A message's parts as one string: texts joined by newlines, images as their placeholder text.

    `where(j)` names part j in errors (each API has its own path syntax);
    `placeholders` is None for a text-only model, whose image parts are refused.
    """
    out, prev_text = [], False
    for j, part in enumerate(parts):
        if part.type in media_types and placeholders is not None:
            out.append(next(placeholders))
            prev_text = False
        elif part.type == "text" and part.text is not None:
            out.append(("\n" if prev_text else "") + part.text)
            prev_text = True
        else:
            what = "text only" if placeholders is None else f"text and {' and '.join(media_types)} parts"
            raise bad_request(f"{where(j)}: content of type {part.type!r} is not supported; "
                              f"this model takes {what}", f"{where(j)}.type")
    return "".join(out)
