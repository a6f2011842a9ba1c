"""Vision-language models through mlx-vlm: loading, prompts with images, the image prefill.

A model folder whose ``config.json`` has a ``vision_config`` loads here (only then is
mlx-vlm imported: it costs about 1.4 s and a thousand modules, design/engine.md). mlx-vlm
loads the model and its processor; the language model's weights are then shared with
an mlx-lm model of the ``text_config`` (no copy), which the lanes run as any text
model: text rows, and an image row once its prompt is prefilled, decode plain tokens in
the continuous batch. An image row's prompt is prefilled on the MLX thread within the
lane's prefill budget (:class:`ImagePrefill`, driven by
:mod:`trio_mlx._lanes.image_prefill`): the vision encoder and projector give the
prompt's input embeddings (mlx-vlm's ``get_input_embeddings``) in one step, which the
mlx-lm model then runs through a fresh cache a chunk per step, all but the last token;
the lane inserts the row with that cache.

Families whose image tokens are plain positions to the language model batch this way
(:data:`FAMILIES`); so do gemma3, whose image tokens attend to each other both ways in the
prefill (:mod:`trio_mlx._start.vision_gemma3`), and M-RoPE ones (qwen2_vl, qwen2_5_vl),
whose prefill runs at positions from the image grid, moved so that the tokens past the
images sit at their index (:mod:`trio_mlx._start.vision_mrope`). Others are refused at
load, naming the family.
"""

from __future__ import annotations

import json
from collections.abc import Hashable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import attrs

from trio_mlx._errors import InvalidRequest
from trio_mlx._lanes.image_prefill import ImagePrefill
from trio_mlx._lanes.prompt_cache import PROMPT, PromptCache
from trio_mlx._start import vision_gemma3, vision_mrope

__all__ = ["FAMILIES", "ImagePrefill", "Vision", "VisionPrompt", "is_vision", "load"]

#: mlx-vlm families that batch after their image prefill: the language model is an
#: mlx-lm model of ``text_config`` with the same weights, image tokens take plain
#: positions; causal attention, or for gemma3 bidirectional within an image in the
#: prefill (:mod:`trio_mlx._start.vision_gemma3`); or M-RoPE ones (``vision_mrope``).
FAMILIES = frozenset({"llava", "gemma3"}) | vision_mrope.FAMILIES


def is_vision(path: str) -> bool:
    """Whether the model folder at ``path`` is a vision-language model (its config has
    a ``vision_config``); a Hub id or unreadable config is not (mlx-lm says why)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and isinstance(config.get("vision_config"), dict)


@attrs.frozen(eq=False)
class VisionPrompt:
    """An image request's model inputs beside its tokens (what the processor made)."""

    #: The image inputs the model's ``get_input_embeddings`` takes (numpy arrays):
    #: ``pixel_values`` and whatever else the processor gave (sizes, grids).
    arrays: Mapping[str, Any]
    #: The images' content hashes, in order: the prompt cache keys the prompt by them.
    digests: tuple[str, ...]
    #: Tokens up to and including the last image token: a cached prefix shorter than
    #: this does not cover the images, and the prompt is prefilled through the encoder.
    end: int


@attrs.define(eq=False)
class Vision:
    """A loaded vision-language model's image side (mlx-vlm's model and processor)."""

    model: Any
    processor: Any
    family: str
    image_token_id: int
    #: The mlx-lm model sharing the language model's weights (what the lanes run).
    text_model: Any

    def encode(
        self,
        tokenizer: Any,
        messages: Sequence[Mapping[str, Any]],
        images: Sequence[Any],
        digests: Sequence[str],
        tools: Sequence[Any] | None,
        template_kwargs: Mapping[str, Any] | None,
    ) -> tuple[list[int], VisionPrompt, str]:
        """The prompt's tokens, image tokens expanded, its image inputs and its rendered
        text (any thread).

        ``messages`` hold ``{"type": "image"}`` parts where the images go; ``images``
        are decoded PIL images.
        """
        import numpy as np

        kwargs: dict[str, Any] = dict(template_kwargs or {})
        kwargs.update(add_generation_prompt=True, tokenize=False)
        if tools:
            kwargs["tools"] = list(tools)
        try:
            text = tokenizer.apply_chat_template([dict(m) for m in messages], **kwargs)
        except Exception as exc:
            raise InvalidRequest(
                f"cannot apply the chat template: {exc}", param="messages"
            ) from None
        try:
            out = self.processor(text=[text], images=list(images))
        except Exception as exc:
            raise InvalidRequest(
                f"the model's processor cannot prepare the images: {exc}",
                param="messages",
                code="invalid_image",
            ) from None
        tokens = [int(t) for t in np.asarray(out["input_ids"])[0].tolist()]
        places = [i for i, t in enumerate(tokens) if t == self.image_token_id]
        if not places:
            raise InvalidRequest(
                "the chat template placed no image in the prompt", param="messages"
            )
        arrays = {
            key: np.asarray(value)
            for key, value in out.items()
            if key not in ("input_ids", "attention_mask") and value is not None
        }
        return tokens, VisionPrompt(arrays, tuple(digests), places[-1] + 1), str(text)

    def start(
        self,
        tokens: Sequence[int],
        prompt: VisionPrompt,
        store: PromptCache | None,
        key: Hashable,
        min_prefix: int,
    ) -> tuple[list[Any], list[int]] | ImagePrefill:
        """What the prompt cache serves an image row (MLX thread): the cache it joins the
        batch with and the tokens left to it (text past its last image); or, when its
        images are not all cached, its :class:`ImagePrefill`.

        ``key`` is the row's prompt-cache key, ``(base, "images", digests)``. An entry
        stored under the key of the first k of these images (k = all .. 0, the base key
        holding text prompts) serves what it shares with ``tokens``: any image tokens in
        that prefix are those k images at the same places. The longest such prefix is
        taken; past the last image the lane prefills the rest as text, else the images
        after the prefix go through the encoder, on top of it (the whole prompt if the
        prefix ends inside an image), and the result is kept under ``key`` (a checkpoint).
        """
        tokens = list(tokens)
        base, _, digests = cast("tuple[Hashable, str, tuple[str, ...]]", key)
        if store is not None:
            mrope = self.family in vision_mrope.FAMILIES
            probes = [
                (base, "images", digests[:k]) if k else base
                for k in range(len(digests), -1, -1)
                if not mrope or vision_mrope.frame_fits(self.model, prompt.arrays, k)
            ]
            best = max(probes, key=lambda probe: store.covered(probe, tokens))
            covered = store.covered(best, tokens)
            if covered >= prompt.end:
                cache, rest = store.fetch(best, tokens, min_prefix=min_prefix, share=True)
                if cache is not None:
                    return cache, rest
            elif covered >= max(1, min_prefix) and self._resumable(tokens, prompt, covered):
                # Written into by the prefill: a copy.
                cache, rest = store.fetch(best, tokens, min_prefix=min_prefix)
                if cache is not None:
                    return ImagePrefill(tokens, prompt, key, cache, len(tokens) - len(rest))
        return ImagePrefill(tokens, prompt, key, None, 0)

    def embed(self, job: ImagePrefill) -> int:
        """The encoder pass of ``job``: the input embeddings of its tokens past its cached
        prefix, the images among them seen (MLX thread). Returns the image tokens encoded."""
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        tokens, runs = job.tokens, self._runs(job.tokens)
        done = sum(1 for first, _ in runs if first < job.start)  # per image: ``_resumable``
        arrays = {name: mx.array(v[done:] if done else v) for name, v in job.prompt.arrays.items()}
        if job.cache is None:
            job.cache = make_prompt_cache(self.text_model)
        ids = mx.array([tokens[job.start :]])
        pixels = arrays.pop("pixel_values", None)
        embeds = self.model.get_input_embeddings(
            ids, pixels if done < len(runs) else None, mask=mx.ones(ids.shape, mx.int32), **arrays
        ).inputs_embeds
        mx.async_eval(embeds)  # type: ignore[no-untyped-call]  # queued, as the lane queues prefill
        job.ids, job.embeds = ids, embeds
        if self.family in vision_mrope.FAMILIES:
            job.positions = vision_mrope.positions(self.model, tokens, job.prompt.arrays, job.start)
        return sum(end - max(first, job.start) for first, end in runs if end > job.start)

    def advance(self, job: ImagePrefill, count: int) -> int:
        """Run the next ``count`` (at most) of ``job``'s embedded positions through the
        language model into its cache (MLX thread). Returns the positions run (gemma3:
        a chunk never ends inside an image, so it may hold more, a whole image)."""
        import mlx.core as mx

        at = job.at
        end = min(len(job.tokens) - 1 - job.start, at + count)
        assert job.cache is not None
        embeds = job.embeds[:, at:end]
        if self.family == "gemma3":
            end = vision_gemma3.advance(self.text_model, self._runs(job.tokens), job, end)
        elif job.positions is not None:
            vision_mrope.run(
                self.model, job.ids[:, at:end], embeds, job.cache, job.positions[..., at:end]
            )
        else:
            self.text_model(job.ids[:, at:end], cache=job.cache, input_embeddings=embeds)
        mx.async_eval([c.state for c in job.cache])  # type: ignore[no-untyped-call]
        job.at = end
        return end - at

    def finish(self, job: ImagePrefill, store: PromptCache | None) -> tuple[list[Any], list[int]]:
        """A prefilled ``job``'s cache and the token left to it; the cache kept under its key."""
        assert job.cache is not None
        job.ids = job.embeds = job.positions = None
        if store is not None and len(job.tokens) > 1:
            store.checkpoint(job.key, job.tokens[:-1], job.cache, PROMPT)
        return job.cache, job.tokens[-1:]

    def _runs(self, tokens: Sequence[int]) -> list[tuple[int, int]]:
        """Where each image's tokens are: (first, end) per image, in order."""
        runs: list[tuple[int, int]] = []
        for i, token in enumerate(tokens):
            if token == self.image_token_id:
                if runs and runs[-1][1] == i:
                    runs[-1] = (runs[-1][0], i + 1)
                else:
                    runs.append((i, i + 1))
        return runs

    def _resumable(self, tokens: Sequence[int], prompt: VisionPrompt, at: int) -> bool:
        """Whether a prefill can go on from a cache of ``tokens[:at]``: ``at`` is between
        images, and the image inputs of those past it can be told apart (the processor's
        arrays come one row per image) where any image is before it."""
        runs = self._runs(tokens)
        if any(first < at < end for first, end in runs):
            return False
        if not any(first < at for first, _ in runs):
            return True
        return all(v.ndim and v.shape[0] == len(runs) for v in prompt.arrays.values())


def load(path: str) -> tuple[Any, Any, dict[str, Any], Vision]:
    """Load the vision model at ``path``: (the mlx-lm text model, mlx-lm's tokenizer,
    the text config, the :class:`Vision`). MLX thread."""
    config = json.loads((Path(path) / "config.json").read_text())
    family = str(config.get("model_type"))
    try:
        from mlx_vlm.utils import load as vlm_load
    except ImportError:
        raise InvalidRequest(
            f"{path} is a vision-language model ({family}): install trio-mlx[vision] "
            "(mlx-vlm) to serve it",
            param="model",
            code="vision_not_installed",
        ) from None
    if family not in FAMILIES:
        raise InvalidRequest(
            f"vision model family {family!r} is not supported (supported: "
            f"{', '.join(sorted(FAMILIES))}): its image prompt needs positions or attention "
            "the batch does not give",
            param="model",
            code="vision_family_unsupported",
        )
    from mlx.utils import tree_flatten
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlx_lm.utils import _get_classes

    model, processor = vlm_load(path)
    if family == "gemma3":
        text_config = vision_gemma3.text_config(model, processor)
    elif family in vision_mrope.FAMILIES:
        text_config = vision_mrope.text_config(config)
    else:
        text_config = dict(config["text_config"])
    for key in ("eos_token_id", "vocab_size"):
        if key in config and key not in text_config:
            text_config[key] = config[key]
    model_class, args_class = _get_classes(text_config)
    text_model = model_class(args_class.from_dict(text_config))
    weights = dict(tree_flatten(model.language_model.parameters()))
    expected = {str(item[0]) for item in tree_flatten(text_model.parameters())}
    if set(weights) != expected:
        raise InvalidRequest(
            f"the {family} model's language model does not match mlx-lm's "
            f"{text_config.get('model_type')!r} (weights differ: "
            f"{sorted(set(weights) ^ expected)[:4]})",
            param="model",
            code="vision_family_unsupported",
        )
    text_model.load_weights(list(weights.items()))
    eos = config.get("eos_token_id", text_config.get("eos_token_id"))
    tokenizer = load_tokenizer(Path(path), eos_token_ids=[eos] if isinstance(eos, int) else eos)
    image_token = config.get("image_token_index", config.get("image_token_id"))
    if not isinstance(image_token, int):
        raise InvalidRequest(f"the {family} model's config names no image token", param="model")
    vision = Vision(model, processor, family, image_token, text_model)
    return text_model, tokenizer, text_config, vision
