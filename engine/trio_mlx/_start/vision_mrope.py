"""M-RoPE vision families (qwen2_vl, qwen2_5_vl): their image prefill's positions (MLX thread).

The language model rotates each query and key by three positions (time, height,
width), each on its own section of the rotary frequencies. A text token has the three
equal, which is plain RoPE at that position: mlx-lm's ``qwen2`` computes it. An
image's tokens take positions from the image's grid (a merged h x w grid spans
max(h, w) positions, not h * w), and every token after the image one less per position
saved, so past the prompt's images a token's position is its index plus the prompt's
``rope_delta`` (negative).

Attention sees only the difference of two tokens' positions: every position of a row
may move by the same amount on all three axes and each score is mathematically the
same. The image prefill here runs the prompt with mlx-vlm's own positions (its
``get_rope_index``) moved by ``-rope_delta``, through mlx-vlm's language model (same
weights, M-RoPE) into the row's mlx-lm cache. Then every token past the images sits at
its index, which is what mlx-lm's cache offset gives it: the row joins the batch, goes
solo, speculates, is trimmed, parked and cached as any text row, and its tokens
continue as in mlx-vlm's own generation.

The prompt cache holds an entry in its own frame: one under the first k images has
them shifted by their own delta. It serves an image prompt only where that frame is
the prompt's (the images past the k change no position: a zero delta); otherwise the
images are prefilled from the start (:func:`frame_fits`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["FAMILIES", "frame_fits", "positions", "run", "text_config"]

#: mlx-vlm families whose language model is mlx-lm's ``qwen2`` with M-RoPE (the same
#: ``get_rope_index`` in both).
FAMILIES = frozenset({"qwen2_vl", "qwen2_5_vl"})


def text_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The mlx-lm ``qwen2`` config of the language model: a Qwen2-VL config is flat (its
    text fields at the top), a newer one may nest them under ``text_config``."""
    nested = config.get("text_config")
    source = dict(nested) if isinstance(nested, dict) and nested else dict(config)
    source.pop("vision_config", None)
    return {**source, "model_type": "qwen2"}


def _grids(arrays: Mapping[str, Any]) -> list[tuple[int, int, int]]:
    grid = arrays.get("image_grid_thw")
    rows = [] if grid is None else grid.tolist()
    return [(int(t), int(h), int(w)) for t, h, w in rows]


def frame_fits(model: Any, arrays: Mapping[str, Any], k: int) -> bool:
    """Whether a cache entry under the prompt's first ``k`` images is in the prompt's
    frame: the images after them move no position (each spans as many positions as it
    has tokens)."""
    merge = int(model.config.vision_config.spatial_merge_size)
    for t, h, w in _grids(arrays)[k:]:
        h, w = h // merge, w // merge
        if max(t, h, w) != t * h * w:
            return False
    return True


def positions(model: Any, tokens: Sequence[int], arrays: Mapping[str, Any], start: int) -> Any:
    """The M-RoPE positions ``(3, 1, n)`` of ``tokens[start:]``, in the frame where the
    tokens past the images sit at their index (mlx-vlm's positions less its delta)."""
    import mlx.core as mx

    grid = arrays.get("image_grid_thw")
    found, delta = model.language_model.get_rope_index(
        mx.array([list(tokens)]), None if grid is None else mx.array(grid)
    )
    if found.ndim == 2:  # no image: text positions, the same on the three axes
        found = mx.broadcast_to(found[None], (3, *found.shape))
    return found[:, :, start:] - delta.reshape(1, 1, 1).astype(found.dtype)


def run(model: Any, ids: Any, embeds: Any, cache: list[Any], at: Any) -> Any:
    """Run ``embeds`` (token ``ids``) at positions ``at`` through mlx-vlm's language model
    (the weights mlx-lm's model shares) into ``cache``: the hidden states."""
    return model.language_model.model(ids, inputs_embeds=embeds, cache=cache, position_ids=at)
