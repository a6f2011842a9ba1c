"""gemma3's image prefill: an image's tokens attend to each other both ways.

gemma3 was trained with causal attention over text and bidirectional attention within
each image's soft tokens (transformers' reference ORs a "same image" mask into the
causal and sliding-window masks of the prompt's pass). mlx-vlm 0.7.10 drops that mask
(its generation runs plain causal), so the lanes run the prefill themselves, on the
mlx-lm ``gemma3_text`` model that shares the weights:

* the language config comes from mlx-vlm's parsed ``TextConfig`` (its defaults, not
  mlx-lm's, filled what the folder's config leaves out; ``rope_global_base_freq`` is
  mlx-lm's ``rope_theta``); the input embeddings are scaled by sqrt(hidden) in both;
* a chunk holding image tokens runs layer by layer with each cache's own causal (and,
  for a sliding layer, windowed) mask, ORed with "same image" over the chunk's
  positions; a chunk never ends inside an image (it stops before one, or holds all of
  it when the image alone is longer than the chunk);
* an image must fit the sliding window (else refused at load): then every key an
  image token sees is in the rotating cache, and decoding after the prefill is plain
  causal text, the batch's own path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trio_mlx._errors import InvalidRequest

__all__ = ["advance", "text_config"]


def text_config(model: Any, processor: Any) -> dict[str, Any]:
    """The mlx-lm ``gemma3_text`` config of mlx-vlm's loaded gemma3 ``model``; refuses
    a model whose image does not fit its sliding window, or whose RoPE mlx-lm lacks."""
    import dataclasses

    config = dataclasses.asdict(model.language_model.config)
    if config.pop("rope_traditional", False):
        raise InvalidRequest(
            "the gemma3 model uses traditional RoPE, which mlx-lm's gemma3_text lacks",
            param="model",
            code="vision_family_unsupported",
        )
    image = max(int(config.pop("mm_tokens_per_image")), int(processor.image_seq_length))
    window = int(config["sliding_window"])
    if image > window:
        raise InvalidRequest(
            f"the gemma3 model's image of {image} tokens is longer than its sliding "
            f"window ({window}): its tokens' attention to each other cannot be kept",
            param="model",
            code="vision_family_unsupported",
        )
    config["rope_theta"] = config.pop("rope_global_base_freq")
    config["model_type"] = "gemma3_text"
    return config


def advance(text_model: Any, runs: Sequence[tuple[int, int]], job: Any, end: int) -> int:
    """Run ``job``'s embedded positions from ``job.at`` to about ``end`` (relative to
    ``job.start``) into its cache; returns the end taken: ``end`` moved back to the
    start of an image it would cut, or on to that image's end if the image starts at
    ``job.at``. ``runs`` are the prompt's images, (first, end) in prompt positions."""
    at, start = job.at, job.start
    spans = [(max(first - start, at), stop - start) for first, stop in runs if stop - start > at]
    for first, stop in spans:
        if first < end < stop:
            end = first if first > at else stop
            break
    if end > len(job.tokens) - 1 - start:
        raise InvalidRequest("the prompt ends inside an image", param="messages")
    inside = [(first - at, min(stop, end) - at) for first, stop in spans if first < end]
    ids, embeds = job.ids[:, at:end], job.embeds[:, at:end]
    if not inside:
        text_model(ids, cache=job.cache, input_embeddings=embeds)
    else:
        _run(text_model.model, embeds, job.cache, inside)
    return end


def _run(model: Any, embeds: Any, cache: list[Any], spans: list[tuple[int, int]]) -> None:
    """mlx-lm's ``Gemma3Model`` pass of ``embeds`` into ``cache`` with each image span
    bidirectional (the output is not needed: only the cache is kept)."""
    import mlx.core as mx

    length = embeds.shape[1]
    group = mx.full((length,), -1, dtype=mx.int32)
    for k, (first, stop) in enumerate(spans):
        group[first:stop] = k
    same = (group[:, None] == group[None, :]) & (group[:, None] >= 0)

    def mask(layer_cache: Any, window: int | None) -> Any:
        causal = layer_cache.make_mask(length, window_size=window, return_array=True)
        return mx.concatenate([causal[:, :-length], causal[:, -length:] | same], axis=1)

    pattern = model.sliding_window_pattern
    full = mask(cache[pattern - 1], None)
    sliding = mask(cache[0], model.window_size) if pattern > 1 else full
    h = embeds * mx.array(model.args.hidden_size**0.5, mx.bfloat16).astype(embeds.dtype)
    for i, (layer, layer_cache) in enumerate(zip(model.layers, cache, strict=True)):
        h = layer(h, full if i % pattern == pattern - 1 else sliding, layer_cache)
