"""MiniCPM-V 4.7's canvas M-RoPE positions for the generic adapter (models/vlm_generic.py,
Family.positions "canvas").

An image is its thumbnail, then its slices (MiniCPM-V 4.6's layout, models/vlm_spans.py). 4.7
places them on one 2-D canvas: the thumbnail's rows spread over the whole canvas, each slice's
over its cell, the marks between them at the cell edges, all at one temporal position; the text
after the image goes on from past the canvas's longer side. mlx-vlm computes this in its
get_input_embeddings over the whole prompt (its CanvasRoPE), from the prompt's ids and every
crop's patch grid (tgt_sizes), and its language model refuses to compute positions of a prompt
with image tokens itself: here the same CanvasRoPE is run on the whole prompt, each image's
grids from its layout, once per prompt; the engine slices it per chunk as for Qwen's M-RoPE.
"""

from __future__ import annotations

import numpy as np


def canvas_positions(model, token_ids: list[int], images: list) -> tuple:
    """(positions (3, 1, len), delta) of a whole prompt, as mlx-vlm's get_input_embeddings gives
    them; `images`: the prompt's ImageInputs in order, each with its crops' tgt_sizes."""
    import mlx.core as mx
    from mlx_vlm.models.minicpmv4_7.rope import CanvasRoPE

    config = model.config
    ids = np.asarray([token_ids])
    kinds = np.where(ids == config.image_token_id, 1, np.where(ids == config.video_token_id, 2, 0))
    grids = [np.asarray(im.extras["tgt_sizes"]).reshape(-1, 2) for im in images]
    positions, deltas = CanvasRoPE(config).get_rope_index(
        ids, mm_token_type_ids=kinds, target_sizes=np.concatenate(grids) if grids else None,
        downsample_mode=config.downsample_mode)
    return mx.array(positions), int(deltas.reshape(-1)[0])
