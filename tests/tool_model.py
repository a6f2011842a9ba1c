"""A tiny model that always answers with one tool call, for the tool-calling endpoint tests.

Built from the tiny random llama: its tokenizer gains one added token whose text
is a whole ``json_tools`` call (``<tool_call>{...}</tool_call>``) and its config
names mlx-lm's ``json_tools`` parser. The weights are rewired so that greedy
decoding is fixed: every layer's output projections are zero (the last
hidden state is then the last token's embedding), and an untied output head
maps the generation prompt's last token to the call token and the call token
to ``<|im_end|>``. So every chat answers ``CALL`` then stops with EOS,
whatever the prompt; the chat template renders tools, tool calls and tool
results, so a test can check the prompt the server built by its token count.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

__all__ = ["CALL_ARGUMENTS", "CALL_NAME", "CALL_TEXT", "TOOL_TEMPLATE", "make_tool_model"]

CALL_NAME = "get_weather"
CALL_ARGUMENTS = {"city": "Paris"}
#: The text of the added token: one complete call in the json_tools format (no spaces:
#: a byte-level BPE vocabulary spells a space differently).
CALL_TEXT = (
    "<tool_call>"
    + json.dumps({"name": CALL_NAME, "arguments": CALL_ARGUMENTS}, separators=(",", ":"))
    + "</tool_call>"
)

#: ChatML with tools (a system turn listing them), assistant tool calls and tool results.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['tool_call_id'] is defined %}[{{ m['tool_call_id'] }}] {% endif %}"
    "{{ m['content'] or '' }}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['id'] or '' }} {{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

#: Logit margin of the wired answers over anything the random weights produce.
_MARGIN = 100.0


def _add_token(directory: Path, token_id: int) -> tuple[int, int]:
    """Add ``CALL_TEXT`` to the tokenizer; return the ids of the prompt's last token and of "a"."""
    from tokenizers import Tokenizer

    path = directory / "tokenizer.json"
    data = json.loads(path.read_text())
    data["added_tokens"].append(
        {
            "id": token_id,
            "content": CALL_TEXT,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": False,
        }
    )
    path.write_text(json.dumps(data))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["added_tokens_decoder"][str(token_id)] = {
        "content": CALL_TEXT,
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": False,
    }
    config["tool_parser_type"] = "json_tools"
    config["chat_template"] = TOOL_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2))
    tokenizer = Tokenizer.from_file(str(path))
    ids: list[int] = tokenizer.encode("<|im_start|>assistant\n").ids
    return ids[-1], tokenizer.encode("a").ids[0]


def make_tool_model(base: Path, out: Path, *, answer: str = "call") -> Path:
    """Copy the tiny model at ``base`` to ``out`` and rewire it as described above.

    ``answer`` picks what every chat gets: ``"call"`` the call then EOS;
    ``"text-call"`` the text ``a``, the call, then EOS (text before a call);
    ``"endless"`` ``a`` forever, never EOS, for tests that need a row to keep
    running whatever the API lets a client ask.
    """
    import mlx.core as mx

    shutil.copytree(base, out)
    config = json.loads((out / "config.json").read_text())
    call_id = config["vocab_size"]
    last_prompt_token, letter = _add_token(out, call_id)
    weights = dict(mx.load(str(out / "model.safetensors")).items())  # type: ignore[union-attr]
    for name, value in list(weights.items()):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = mx.zeros_like(value)
    embed = weights["model.embed_tokens.weight"]
    mx.random.seed(7)
    embed = mx.concatenate([embed, mx.random.normal((1, embed.shape[1])) * 0.5])

    def unit(row: mx.array) -> mx.array:
        return row / mx.linalg.norm(row)

    head = embed * 1.0

    def wire(after: int, emit: int) -> None:
        # The final norm keeps the embedding's direction: this row scores highest after ``after``.
        head[emit] = unit(embed[after]) * _MARGIN

    eos = 2  # <|im_end|>
    if answer == "endless":
        # One row that wins after the prompt and after itself: "a" forever.
        head[letter] = (unit(embed[last_prompt_token]) + unit(embed[letter])) * _MARGIN
    elif answer == "text-call":
        wire(last_prompt_token, letter)
        wire(letter, call_id)
        wire(call_id, eos)
    elif answer == "call":
        wire(last_prompt_token, call_id)
        wire(call_id, eos)
    else:
        raise ValueError(f"answer must be 'call', 'text-call' or 'endless', not {answer!r}")
    weights["model.embed_tokens.weight"] = embed
    weights["lm_head.weight"] = head
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    index = {"metadata": {}, "weight_map": dict.fromkeys(sorted(weights), "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["vocab_size"] = call_id + 1
    config["tie_word_embeddings"] = False
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
