"""A tiny random qwen2_vl or qwen2_5_vl for tests and benchmarks
(``trio_mlx.testing.make_random_vlm`` with that ``family``): mlx-vlm's own classes, a
Qwen-VL image processor config.

Its language model uses M-RoPE (``rope_scaling`` of type ``mrope``), so an image's
tokens take positions from the image's grid and every token after them one per token
less than its index (see :mod:`trio_mlx._start.vision_mrope`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["QWEN2_VL_CHAT_TEMPLATE", "make_random_qwen2_vl"]

#: The tokens a Qwen-VL tokenizer adds for images (and videos, which the engine refuses).
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

#: ChatML whose image part renders as Qwen-VL's ``<|vision_start|><|image_pad|><|vision_end|>``
#: (its processor expands the pad to the image's tokens).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_random_qwen2_vl(
    directory: Path,
    tokenizer: Any,
    write_tokenizer: Callable[[Any, Path], None],
    *,
    seed: int,
    weight_scale: float,
    hidden_size: int,
    num_hidden_layers: int,
    patch_size: int = 4,
    family: str = "qwen2_vl",
) -> Path:
    """Write the model into ``directory`` around ``tokenizer`` (the tiny llama's, untouched
    here; ``write_tokenizer`` writes its files, as ``trio_mlx.testing``'s does): a qwen2 language model of ``hidden_size`` with M-RoPE sections over its 4 heads,
    a two-layer Qwen2-VL vision tower over ``patch_size`` patches merged 2 x 2 (a 32 x 32
    image: 16 tokens on a 4 x 4 grid), and a processor that keeps small images' sizes.
    ``family="qwen2_5_vl"``: the same language model, Qwen2.5-VL's windowed vision tower."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import qwen2_5_vl, qwen2_vl
    from tokenizers import AddedToken

    from trio_mlx._testing_vlm import random_vlm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = type(tokenizer).from_str(tokenizer.to_str())
    write_tokenizer(tokenizer, directory)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in VISION_TOKENS]
    )
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    for token, token_id in ids.items():
        tokenizer_config["added_tokens_decoder"][str(token_id)] = {
            **tokenizer_config["added_tokens_decoder"]["0"],
            "content": token,
        }
    tokenizer_config["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    vocab = tokenizer.get_vocab_size()
    heads = 4
    half = hidden_size // heads // 2
    sections = [half - 2 * (half * 3 // 8), half * 3 // 8, half * 3 // 8]
    text = {
        "model_type": "qwen2",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": heads,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": sections},
        "tie_word_embeddings": False,
    }
    vision: dict[str, Any] = {
        "model_type": family,
        "depth": 2,
        "num_heads": 2,
        "patch_size": patch_size,
        "spatial_patch_size": patch_size,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "in_channels": 3,
    }
    if family == "qwen2_vl":
        vision.update(embed_dim=32, hidden_size=hidden_size, mlp_ratio=2)
    else:  # windows of 2 x 2 merged patches, the last block attending the whole image
        vision.update(hidden_size=32, intermediate_size=64, out_hidden_size=hidden_size)
        vision.update(window_size=4 * patch_size, fullatt_block_indexes=[1], tokens_per_second=2)
    classes = qwen2_vl if family == "qwen2_vl" else qwen2_5_vl
    processor = "Qwen2VLProcessor" if family == "qwen2_vl" else "Qwen2_5_VLProcessor"
    # Flat, as Qwen2-VL checkpoints are: mlx-vlm reads the text model's fields off the top.
    config = {
        **text,
        "model_type": family,
        "architectures": [
            "Qwen2VLForConditionalGeneration"
            if family == "qwen2_vl"
            else "Qwen2_5_VLForConditionalGeneration"
        ],
        "vision_config": vision,
        "image_token_id": ids["<|image_pad|>"],
        "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"],
        "vision_end_token_id": ids["<|vision_end|>"],
        "vocab_size": vocab,
        "eos_token_id": [0, 2],
        "torch_dtype": "float32",
    }
    model = random_vlm(classes, dict(config), None, vision, seed, weight_scale)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    factor = patch_size * 2
    preprocessor = {
        "image_processor_type": "Qwen2VLImageProcessor",  # Qwen2.5-VL's too
        "patch_size": patch_size,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "min_pixels": factor * factor,
        "max_pixels": 64 * 64,
        "image_mean": [0.4815, 0.4578, 0.4082],
        "image_std": [0.2686, 0.2613, 0.2758],
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "do_convert_rgb": True,
    }
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):
        (directory / name).write_text(json.dumps(preprocessor, indent=2))
    (directory / "processor_config.json").write_text(json.dumps({"processor_class": processor}))
    return directory
