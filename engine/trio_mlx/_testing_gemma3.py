"""A tiny random gemma3 vision-language model (mlx-vlm's own classes), for
``trio_mlx.testing.make_random_vlm(family="gemma3")``.

Kept apart from :mod:`trio_mlx.testing`, which passes in its tokenizer and the
function that writes it (this module imports nothing of the package).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["GEMMA3_CHAT_TEMPLATE", "write_gemma3"]

#: A ChatML template whose image part renders as gemma3's ``<start_of_image>``, which
#: its processor expands to the image's soft tokens between begin and end tokens.
GEMMA3_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}"
    "{{ '<start_of_image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_IMAGE_TOKENS = {
    "boi_token": "<start_of_image>",
    "image_token": "<image_soft_token>",
    "eoi_token": "<end_of_image>",
}


def write_gemma3(
    directory: Path,
    tokenizer: Any,
    write_tokenizer: Callable[[Any, Path], None],
    *,
    seed: int,
    weight_scale: float,
    hidden_size: int,
    num_hidden_layers: int,
    image_size: int,
    sliding_window: int = 24,
) -> Path:
    """Write the model: ``tokenizer`` (a ``tokenizers.Tokenizer``) plus gemma3's image
    tokens, a gemma3 language model of ``num_hidden_layers`` alternating sliding
    (``sliding_window``) and global layers, a two-layer SigLIP over ``image_size``
    pixels in 8 x 8 patches, pooled to 16 soft tokens an image, and the processor's
    configuration (``Gemma3Processor``, ``Gemma3ImageProcessor``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import gemma3
    from tokenizers import AddedToken

    from trio_mlx._testing_vlm import random_vlm

    write_tokenizer(tokenizer, directory)
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in _IMAGE_TOKENS.values()]
    )
    ids = {name: tokenizer.token_to_id(token) for name, token in _IMAGE_TOKENS.items()}
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    for token, id_ in zip(_IMAGE_TOKENS.values(), ids.values(), strict=True):
        tokenizer_config["added_tokens_decoder"][str(id_)] = {
            **tokenizer_config["added_tokens_decoder"]["0"],
            "content": token,
        }
    tokenizer_config["extra_special_tokens"] = dict(_IMAGE_TOKENS)
    tokenizer_config["chat_template"] = GEMMA3_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    vocab = tokenizer.get_vocab_size()
    text = {
        "model_type": "gemma3_text",
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "intermediate_size": 2 * hidden_size,
        # No head counts: mlx-vlm's defaults (8 and 4) apply, as to a folder that
        # leaves them out (mlx-lm's differ).
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "rms_norm_eps": 1e-6,
        "vocab_size": vocab,
        "sliding_window": sliding_window,
        "sliding_window_pattern": 2,
        "rope_global_base_freq": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "mm_tokens_per_image": 16,
        "max_position_embeddings": 4096,
    }
    vision = {
        "model_type": "siglip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "patch_size": 8,
        "image_size": image_size,
        "num_channels": 3,
        "layer_norm_eps": 1e-6,
    }
    config = {
        "model_type": "gemma3",
        "architectures": ["Gemma3ForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_index": ids["image_token"],
        "boi_token_index": ids["boi_token"],
        "eoi_token_index": ids["eoi_token"],
        "mm_tokens_per_image": 16,
        "vocab_size": vocab,
        "pad_token_id": 0,
        "eos_token_id": [0, 2],
        "torch_dtype": "float32",
    }
    model = random_vlm(gemma3, config, text, vision, seed, weight_scale)
    # mlx-vlm starts the projector at ones: every image token would be one direction.
    projector = model.multi_modal_projector
    shape = projector.mm_input_projection_weight.shape
    projector.mm_input_projection_weight = mx.random.normal(shape) * weight_scale
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    preprocessor = {
        "image_processor_type": "Gemma3ImageProcessor",
        "do_resize": True,
        "size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
        "do_convert_rgb": True,
        "do_pan_and_scan": False,
        "resample": 2,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = {"processor_class": "Gemma3Processor", "image_seq_length": 16}
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return directory
