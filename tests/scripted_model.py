"""Tiny models whose greedy output is a fixed script, and the tool-call formats of mlx-lm.

``make_scripted_model(dir, script)`` writes a real llama (mlx-lm loads, batches
and caches it like any other) whose next token depends only on the current
one: embeddings are one-hot, attention and MLP add nothing, and the output
head maps each token to its successor. Every piece of ``script`` becomes an
added token of its own, so the model answers ANY prompt with exactly the
script and then ``<|im_end|>``. A piece that repeats is cut into two new
pieces (``<tool_`` + ``call>``): the extractors work on text, so the output
text is still the script's.

``FORMATS`` holds, for each tool parser the installed mlx-lm ships, the text
of one call in its format (written from the parser's own patterns).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trio_mlx.testing import train_tokenizer, write_tokenizer

__all__ = ["FORMATS", "WEATHER_TOOLS", "call_text", "make_scripted_model"]

#: The id the scripted model ends with (``<|im_end|>``, an EOS id of trio-mlx's tokenizers).
_END = 2
#: The text the tokenizer is trained on: small, so building a model takes a fraction of a second.
_TEXT = "The quick brown fox jumps over the lazy dog. " * 40 + "assistant user system\n" * 20


def _unique_pieces(script: Sequence[str], vocab: Mapping[str, int]) -> list[str]:
    """The script as pieces that occur once each and are not in the base vocabulary."""
    used: set[str] = set()
    out: list[str] = []

    def free(piece: str) -> bool:
        return bool(piece) and piece not in used and piece not in vocab

    def place(piece: str) -> None:
        if free(piece):
            used.add(piece)
            out.append(piece)
            return
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if free(left) and left != right and free(right):
                used.update((left, right))
                out.extend((left, right))
                return
        for cut in range(1, len(piece)):  # a longer piece may need three
            left = piece[:cut]
            if free(left):
                used.add(left)
                out.append(left)
                place(piece[cut:])
                return
        raise ValueError(f"cannot place {piece!r} in the script")

    for piece in script:
        place(piece)
    return out


def make_scripted_model(
    directory: Path,
    script: Sequence[str],
    *,
    tokenizer_config: Mapping[str, Any] | None = None,
    extra_tokens: Sequence[str] = (),
) -> Path:
    """Write a model that greedily generates ``"".join(script)`` for any prompt."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama
    from tokenizers import AddedToken

    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(_TEXT, 300)
    pieces = _unique_pieces(script, tokenizer.get_vocab())
    tokenizer.add_tokens([AddedToken(p, normalized=False) for p in pieces])
    extra = [t for t in extra_tokens if t not in tokenizer.get_vocab()]
    tokenizer.add_special_tokens([AddedToken(t, normalized=False) for t in extra])
    write_tokenizer(tokenizer, directory)
    if tokenizer_config:
        path = directory / "tokenizer_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **tokenizer_config}))
    vocab = tokenizer.get_vocab()
    size = tokenizer.get_vocab_size()
    hidden = -(-size // 8) * 8
    config = {
        "model_type": "llama",
        "vocab_size": size,
        "hidden_size": hidden,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "intermediate_size": 8,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "eos_token_id": [0, _END],
        "bos_token_id": None,
        "torch_dtype": "float32",
    }
    model = llama.Model(llama.ModelArgs.from_dict(config))
    ids = [vocab[p] for p in pieces]
    successor = dict.fromkeys(range(size), ids[0])
    successor.update(zip(ids, [*ids[1:], _END], strict=True))
    head = [[0.0] * hidden for _ in range(size)]
    for token, after in successor.items():
        head[after][token] = 10.0
    weights = {name: mx.zeros_like(value) for name, value in tree_flatten(model.parameters())}
    weights["model.embed_tokens.weight"] = mx.eye(size, hidden)
    weights["lm_head.weight"] = mx.array(head)
    for name in weights:
        if name.endswith("norm.weight"):
            weights[name] = mx.ones_like(weights[name])
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    (directory / "config.json").write_text(json.dumps(config))
    return directory


#: Two tools the format tests call.
WEATHER_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
    for name in ("get_weather", "get_time")
]


def _json_call(name: str, city: str) -> str:
    return json.dumps({"name": name, "arguments": {"city": city}})


#: Parser name -> the text between its markers for one call of ``name(city=...)``.
FORMATS: dict[str, Callable[[str, str], str]] = {
    "function_gemma": lambda n, c: f"call:{n}{{city:<escape>{c}<escape>}}",
    "gemma4": lambda n, c: f'call:{n}{{city:<|"|>{c}<|"|>}}',
    "glm47": lambda n, c: f"{n}<arg_key>city</arg_key><arg_value>{c}</arg_value>",
    "laguna": lambda n, c: f"{n}<arg_key>city</arg_key><arg_value>{c}</arg_value>",
    "json_tools": _json_call,
    "kimi_k2": lambda n, c: (
        f'<|tool_call_begin|>functions.{n}:0<|tool_call_argument_begin|>{{"city": "{c}"}}'
        "<|tool_call_end|>"
    ),
    "kimi_k3": lambda n, c: (
        f'<|open|>call tool="{n}" index="1"<|sep|><|open|>argument key="city" type="string"'
        f"<|sep|>{c}<|close|>argument<|sep|><|close|>call<|sep|>"
    ),
    "longcat": lambda n, c: (
        f"{n}<longcat_arg_key>city</longcat_arg_key><longcat_arg_value>{c}</longcat_arg_value>"
    ),
    "minicpm5": lambda n, c: f'"{n}"><param name="city">{c}</param>',
    "minimax_m2": lambda n, c: (
        f'<invoke name="{n}"><parameter name="city">{c}</parameter></invoke>'
    ),
    "mistral": lambda n, c: f'{n}[ARGS]{{"city": "{c}"}}',
    "muse_spark": lambda n, c: (
        f'<atem:invoke name="{n}"><atem:parameter name="city">{c}</atem:parameter></atem:invoke>'
    ),
    "pythonic": lambda n, c: f'[{n}(city="{c}")]',
    "qwen3_coder": lambda n, c: f"<function={n}><parameter=city>{c}</parameter></function>",
}


def call_text(parser: str, name: str, city: str) -> list[str]:
    """One call in ``parser``'s format with its markers, as script pieces."""
    import importlib

    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    pieces = [module.tool_call_start, FORMATS[parser](name, city), module.tool_call_end]
    return [p for p in pieces if p]
