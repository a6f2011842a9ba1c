"""The random vision-language models' shared step: mlx-vlm's classes built from configs
with seeded random weights, the language model's and the projector's matrices scaled."""

from __future__ import annotations

from typing import Any

__all__ = ["random_vlm"]


def random_vlm(
    classes: Any, config: dict[str, Any], text: Any, vision: Any, seed: int, weight_scale: float
) -> Any:
    """``classes.Model`` of ``config`` with its ``text`` and ``vision`` configs (dicts; text
    None: what ``ModelConfig`` made of ``config``), seeded; every matrix outside the
    vision tower times ``weight_scale``."""
    import mlx.core as mx
    from mlx.utils import tree_map_with_path

    model_config = classes.ModelConfig.from_dict(config)
    model_config.text_config = classes.TextConfig.from_dict(
        model_config.text_config if text is None else text
    )
    model_config.vision_config = classes.VisionConfig.from_dict(vision)
    mx.random.seed(seed)
    model = classes.Model(model_config)

    def scaled(path: str, p: Any) -> Any:
        if p.ndim < 2 or path.startswith("vision_tower"):
            return p
        return p * weight_scale

    model.update(tree_map_with_path(scaled, model.parameters()))
    return model
