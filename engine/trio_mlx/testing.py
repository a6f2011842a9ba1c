"""Builders for small model directories that ``mlx_lm.load`` loads like any
mlx-community model: for tests, benchmarks and the default-model trainer; the
looks inside a running engine that tests need (:func:`dead_rows`,
:func:`batch_lane`, :func:`step_planner`, :func:`adapter_registry`); and the
batch lane's own types (:class:`BatchLane`, :class:`RowSpec`, :class:`StepPlan`,
:class:`PromptCache`), for tests that drive a lane without an engine.

Everything here is seeded and deterministic. The tokenizer is a byte-level BPE
trained with the ``tokenizers`` library (a dependency of mlx-lm through
transformers) on ``pydoc_data.topics``, which every CPython ships.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trio_mlx._accel.quantized_attention import dequantized_attention
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.prompt_cache import PromptCache
from trio_mlx._lanes.records import RowSpec, StepPlan

if TYPE_CHECKING:
    from trio_mlx import Engine

__all__ = [
    "CHAT_TEMPLATE",
    "FAMILIES",
    "SPECIAL_TOKENS",
    "VLM_CHAT_TEMPLATE",
    "VLM_FAMILIES",
    "BatchLane",
    "PromptCache",
    "RowSpec",
    "StepPlan",
    "adapter_registry",
    "batch_lane",
    "corpus_text",
    "dead_rows",
    "dequantized_attention",
    "make_random_llama",
    "make_random_model",
    "make_random_vlm",
    "step_planner",
    "train_tokenizer",
    "with_context",
    "write_tokenizer",
]

#: Special tokens every trio-mlx tokenizer carries, in id order (ids 0..2).
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: A ChatML template; generation stops at ``<|im_end|>`` (an EOS id).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def dead_rows(engine: Engine) -> int:
    """Finished or cancelled rows whose KV slots the engine's batch lane still holds.

    Read on the caller's thread: call it only when no step is in flight (the
    engine idle, ``statistics().batch_rows == 0``), as the planner tests do.
    """
    return engine._loaded.lane.dead_rows


def batch_lane(engine: Engine) -> BatchLane:
    """The engine's batch lane, for tests that read or set its knobs: only while no
    step is in flight (the engine idle)."""
    return engine._loaded.lane


def step_planner(engine: Engine) -> Any:
    """The engine's step planner (``trio_mlx._core.planner.StepPlanner``), for tests
    that read or set its knobs between steps."""
    return engine._actor.planner


def adapter_registry(engine: Engine) -> Any:
    """The engine's adapter registry (``trio_mlx._adapters.registry.AdapterRegistry``),
    for tests that pick its stacking method or ask why an adapter runs serially."""
    return engine._registry


def with_context(source: Path, target: Path, context: int) -> Path:
    """``source``'s model at ``target`` with its context set to ``context`` tokens.

    The files are linked, not copied; only ``config.json`` is rewritten. A long
    request on such a model can end only by its ``max_tokens`` or by being cut,
    never at the context's end, however fast the machine decodes: what a test
    of a deadline needs.
    """
    source, target = Path(source), Path(target)
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.name == "config.json":
            config = json.loads(item.read_text())
            config["max_position_embeddings"] = context
            (target / item.name).write_text(json.dumps(config))
        elif item.is_file() and not (target / item.name).exists():
            (target / item.name).symlink_to(item.resolve())
    return target


def corpus_text() -> str:
    """Return the Python documentation text bundled with CPython (~470k chars)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def _chunks(text: str, size: int = 4096) -> Iterator[str]:
    for start in range(0, len(text), size):
        yield text[start : start + size]


def train_tokenizer(text: str, vocab_size: int) -> Any:
    """Train a byte-level BPE ``tokenizers.Tokenizer`` on ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_chunks(text), trainer=trainer)
    return tokenizer


def write_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Save ``tokenizer.json`` and a ``tokenizer_config.json`` with EOS and a chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2)
    )


def llama_config(
    *,
    vocab_size: int,
    hidden_size: int,
    num_hidden_layers: int,
    num_attention_heads: int,
    num_key_value_heads: int,
    intermediate_size: int,
    max_position_embeddings: int = 2048,
    tie_word_embeddings: bool = True,
) -> dict[str, Any]:
    """Return a Hugging Face style ``config.json`` dict for a llama model."""
    return {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_hidden_layers,
        "num_attention_heads": num_attention_heads,
        "num_key_value_heads": num_key_value_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie_word_embeddings,
        # Both ids end a generation: plain text ends with <|endoftext|>, a chat turn with <|im_end|>.
        "eos_token_id": [0, 2],
        "bos_token_id": None,
        "torch_dtype": "float32",
    }


def make_random_llama(
    directory: Path,
    *,
    vocab_size: int = 512,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 256,
    max_position_embeddings: int = 2048,
    seed: int = 0,
    weight_scale: float = 4.0,
    dtype: str = "float32",
    tokenizer_text: str | None = None,
    model_type: str = "llama",
) -> Path:
    """Write a random-weight llama model directory that ``mlx_lm.load`` loads.

    ``weight_scale`` multiplies the initial weights: a random llama at the
    default scale tends to repeat one token forever under greedy decoding,
    and tests need varied tokens. ``model_type="qwen2"`` writes the same shape
    as a Qwen2, which mlx-lm can also split into pipeline stages (a llama
    only by tensor). The weights come with a ``model.safetensors.index.json``,
    which mlx-lm's pipeline loading needs.
    """
    directory = Path(directory)
    tokenizer = _tokenizer(vocab_size, tokenizer_text)
    write_tokenizer(tokenizer, directory)
    config = llama_config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
    )
    config["torch_dtype"] = dtype
    if model_type != "llama":
        config["model_type"] = model_type
        config["architectures"] = [f"{model_type.capitalize()}ForCausalLM"]
    _write_weights(directory, config, seed=seed, weight_scale=weight_scale, dtype=dtype)
    return directory


def _tokenizer(vocab_size: int, text: str | None) -> Any:
    """The trained tokenizer; the default corpus's is trained once per process."""
    if text is not None:
        return train_tokenizer(text, vocab_size)
    if vocab_size not in _TRAINED:
        _TRAINED[vocab_size] = train_tokenizer(corpus_text()[:200_000], vocab_size)
    return _TRAINED[vocab_size]


_TRAINED: dict[int, Any] = {}


def _write_weights(
    directory: Path,
    config: dict[str, Any],
    *,
    seed: int,
    weight_scale: float,
    dtype: str,
    embed_scale: float | None = None,
) -> None:
    """Build ``config``'s mlx-lm model with seeded random weights and save it with its config.

    Matrices are scaled by ``weight_scale``, the token embedding by
    ``embed_scale`` when given.
    """
    import importlib

    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map_with_path

    def scaled(path: str, p: Any) -> Any:
        if p.ndim < 2:
            return p.astype(target)
        scale = embed_scale if embed_scale is not None and "embed_tokens" in path else weight_scale
        return (p * scale).astype(target)

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    target = getattr(mx, dtype)
    model.update(tree_map_with_path(scaled, model.parameters()))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (directory / "config.json").write_text(json.dumps(config, indent=2))


#: The mlx-lm architectures :func:`make_random_model` builds: dense, mixture of
#: experts, sliding window or logit softcap, and hybrid (linear attention or
#: convolution layers beside full attention).
FAMILIES = (
    "llama",
    "qwen2",
    "qwen3",
    "phi3",
    "granite",
    "olmo2",
    "smollm3",
    "glm4",
    "cohere",
    "starcoder2",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "qwen3_next",
    "lfm2",
)

# Tiny shapes: hidden 64, four query heads of 16 over two KV heads, two layers.
_HEAD = 16
_MOE = {"num_experts_per_tok": 2, "norm_topk_prob": True}
# Gemma scales its (tied) embedding by sqrt(hidden): at the matrices' scale,
# every token predicts itself.
_EMBED_SCALE = {"gemma2": 1.0}
# What each family adds to the shared config (FAMILIES' order). The sliding
# windows are 32 tokens, so a longer prompt wraps a RotatingKVCache; each
# mixed family has both kinds of layer in its two.
_FAMILY_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "phi3": {"tie_word_embeddings": False},
    "granite": {
        "logits_scaling": 1.0,
        "attention_multiplier": _HEAD**-0.5,
        "embedding_multiplier": 1.0,
        "residual_multiplier": 1.0,
        "attention_bias": False,
        "mlp_bias": False,
    },
    # Post-norm layers leave the residual close to the token's own embedding:
    # tied, every token would predict itself.
    "olmo2": {"tie_word_embeddings": False},
    "smollm3": {"no_rope_layer_interval": 2},
    "glm4": {"attention_bias": False, "partial_rotary_factor": 0.5},
    "cohere": {"layer_norm_eps": 1e-5, "logit_scale": 0.25},
    "starcoder2": {"norm_epsilon": 1e-5},
    "qwen3_moe": {
        **_MOE,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
    },
    "mixtral": {**_MOE, "num_local_experts": 4},
    "gpt_oss": {
        **_MOE,
        "num_local_experts": 4,
        "sliding_window": 32,
        "layer_types": ["sliding_attention", "full_attention"],
    },
    "gemma2": {"query_pre_attn_scalar": _HEAD},
    "gemma3_text": {
        "query_pre_attn_scalar": _HEAD,
        "sliding_window": 32,
        "sliding_window_pattern": 2,
        "rope_local_base_freq": 10000.0,
    },
    "qwen3_next": {
        **_MOE,
        "linear_num_value_heads": 4,
        "linear_num_key_heads": 2,
        "linear_key_head_dim": _HEAD,
        "linear_value_head_dim": _HEAD,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "decoder_sparse_step": 1,
        "shared_expert_intermediate_size": 64,
        "mlp_only_layers": [],
        "moe_intermediate_size": 64,
        "partial_rotary_factor": 0.5,
        "full_attention_interval": 2,
    },
    "lfm2": {
        "norm_eps": 1e-5,
        "conv_bias": False,
        "conv_L_cache": 3,
        "block_dim": 64,
        "block_ff_dim": 128,
        "block_multiple_of": 16,
        "block_ffn_dim_multiplier": 1.0,
        "block_auto_adjust_ff_dim": False,
        "layer_types": ["conv", "full_attention"],
    },
}


def make_random_model(
    directory: Path,
    model_type: str,
    *,
    seed: int = 0,
    weight_scale: float = 4.0,
    **config_overrides: Any,
) -> Path:
    """Write a tiny random-weight model of mlx-lm's ``model_type`` that ``mlx_lm.load`` loads.

    ``model_type`` is one of :data:`FAMILIES`. The model is float32, hidden size
    64, two layers, with :func:`make_random_llama`'s tokenizer and chat template;
    ``config_overrides`` replace or add ``config.json`` fields (say
    ``num_hidden_layers=4``). ``weight_scale`` as in :func:`make_random_llama`.
    """
    if model_type not in _FAMILY_CONFIG:
        raise ValueError(f"unknown model family {model_type!r}; known: {', '.join(FAMILIES)}")
    directory = Path(directory)
    tokenizer = _tokenizer(512, None)
    write_tokenizer(tokenizer, directory)
    config = llama_config(
        vocab_size=tokenizer.get_vocab_size(),
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    )
    config.update(
        model_type=model_type,
        architectures=[f"{model_type}ForCausalLM"],
        head_dim=_HEAD,
        max_position_embeddings=4096,
        # Each family's transformers default names an id past this vocabulary.
        pad_token_id=0,
    )
    config.update(_FAMILY_CONFIG[model_type])
    config.update(config_overrides)
    _write_weights(
        directory,
        config,
        seed=seed,
        weight_scale=weight_scale,
        dtype="float32",
        embed_scale=_EMBED_SCALE.get(model_type),
    )
    return directory


#: The vision-language families :func:`make_random_vlm` builds (mlx-vlm's classes).
VLM_FAMILIES = ("llava", "gemma3", "qwen2_vl", "qwen2_5_vl")

#: A ChatML template whose content may be a list of parts: an image part renders as
#: the model's image token, which its processor expands to the image's tokens.
VLM_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}{% if part['type'] == 'image' %}{{ '<image>' }}"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_random_vlm(
    directory: Path,
    *,
    family: str = "llava",
    seed: int = 0,
    weight_scale: float | None = None,
    hidden_size: int = 128,
    num_hidden_layers: int = 2,
    image_size: int = 32,
) -> Path:
    """Write a tiny random vision-language model that ``mlx_vlm.load`` (and the engine)
    loads offline: mlx-vlm's own classes of ``family`` (:data:`VLM_FAMILIES`).

    The language model is :func:`make_random_llama`'s shape and tokenizer plus an
    ``<image>`` token; the vision tower a two-layer CLIP over 32 x 32 images in 8 x 8
    patches (16 image tokens an image), with a CLIP image processor config (the bench
    asks for a larger ``hidden_size``, ``num_hidden_layers`` and ``image_size``). Needs
    mlx-vlm (the ``vision`` extra). ``weight_scale`` (4; gemma3: 1) multiplies the
    language model's and the projector's matrices, so greedy answers vary with the image.
    gemma3's model (``trio_mlx._testing_gemma3``) has 16 tokens an image, sliding-window
    layers of 24 beside global ones, and answers by the image best with text before it.
    qwen2_vl and qwen2_5_vl: ``trio_mlx._testing_qwen2_vl`` (Qwen-VL tokens, processor and
    M-RoPE).
    """
    if family not in VLM_FAMILIES:
        raise ValueError(f"unknown vision family {family!r}; known: {', '.join(VLM_FAMILIES)}")
    if family in ("qwen2_vl", "qwen2_5_vl"):  # M-RoPE: its own module
        from trio_mlx._testing_qwen2_vl import make_random_qwen2_vl

        return make_random_qwen2_vl(
            directory,
            _tokenizer(512, None),
            write_tokenizer,
            seed=seed,
            weight_scale=4.0 if weight_scale is None else weight_scale,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            family=family,
        )
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.models import llava
    from tokenizers import AddedToken

    from trio_mlx._testing_vlm import random_vlm

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = type(_tokenizer(512, None)).from_str(_tokenizer(512, None).to_str())
    if family == "gemma3":
        from trio_mlx._testing_gemma3 import write_gemma3

        scale = 1.0 if weight_scale is None else weight_scale
        return write_gemma3(
            directory,
            tokenizer,
            write_tokenizer,
            seed=seed,
            weight_scale=scale,
            hidden_size=hidden_size,
            num_hidden_layers=num_hidden_layers,
            image_size=image_size,
        )
    write_tokenizer(tokenizer, directory)
    tokenizer.add_special_tokens([AddedToken("<image>", special=True, normalized=False)])
    image_id = tokenizer.token_to_id("<image>")
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["added_tokens_decoder"][str(image_id)] = {
        **tokenizer_config["added_tokens_decoder"]["0"],
        "content": "<image>",
    }
    tokenizer_config["chat_template"] = VLM_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    vocab = tokenizer.get_vocab_size()
    text = llama_config(
        vocab_size=vocab,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden_size,
    )
    vision = {
        "model_type": "clip_vision_model",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "image_size": image_size,
        "patch_size": 8,
        "projection_dim": 32,
        "num_channels": 3,
        "layer_norm_eps": 1e-5,
    }
    config = {
        "model_type": family,
        "architectures": ["LlavaForConditionalGeneration"],
        "text_config": text,
        "vision_config": vision,
        "image_token_index": image_id,
        "vision_feature_select_strategy": "default",
        "vision_feature_layer": -2,
        "vocab_size": vocab,
        "eos_token_id": [0, 2],
        "torch_dtype": "float32",
    }
    scale = 4.0 if weight_scale is None else weight_scale
    model = random_vlm(llava, config, text, vision, seed, scale)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    clip_mean, clip_std = [0.4815, 0.4578, 0.4082], [0.2686, 0.2613, 0.2758]
    preprocessor = {
        "image_processor_type": "CLIPImageProcessor",
        "do_resize": True,
        "size": {"shortest_edge": image_size},
        "do_center_crop": True,
        "crop_size": {"height": image_size, "width": image_size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": clip_mean,
        "image_std": clip_std,
        "do_convert_rgb": True,
        "resample": 3,
    }
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2))
    processor = {
        "processor_class": "LlavaProcessor",
        "patch_size": 8,
        "vision_feature_select_strategy": "default",
        "image_token": "<image>",
        "num_additional_image_tokens": 1,
    }
    (directory / "processor_config.json").write_text(json.dumps(processor, indent=2))
    return directory
