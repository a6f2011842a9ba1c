"""The KV memory budget over HTTP: refusals in each API's shape, the gauges, the flag."""

from __future__ import annotations

import re
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from http_helpers import live_server
from trio_mlx_http._cli import build_parser

pytestmark = pytest.mark.model

#: One row of 512 tokens of the tiny model (1,024 bytes a token).
LIMIT = 512 * 1024
TOO_LARGE = re.compile(
    r"the request needs a KV cache of 610 tokens \(600 prompt \+ 10 max_tokens\), "
    rf"\d+ bytes; the engine's KV memory budget is {LIMIT} bytes, which holds at most "
    r"512 tokens for one request"
)


async def test_a_prompt_that_can_never_fit_is_a_400_naming_its_tokens_and_the_limit(
    tiny_model_path: Path,
) -> None:
    async with (
        live_server(tiny_model_path, kv_memory_bytes=LIMIT) as server,
        openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client,
        anthropic.AsyncAnthropic(base_url=server.url, api_key="unused", max_retries=0) as claude,
        httpx.AsyncClient(base_url=server.url, timeout=60) as http,
    ):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(
                model=server.engine.model_id, prompt=[5] * 600, max_tokens=10
            )
        error = refused.value.body
        assert isinstance(error, dict)
        assert error["code"] == "kv_memory_exceeded"
        assert TOO_LARGE.fullmatch(error["message"]), error["message"]
        words = " ".join(["memory"] * 200)
        with pytest.raises(anthropic.BadRequestError) as too_long:
            await claude.messages.create(
                model=server.engine.model_id,
                max_tokens=10,
                messages=[{"role": "user", "content": words}],
            )
        assert too_long.value.status_code == 400
        assert "KV memory budget is" in str(too_long.value)
        metrics = (await http.get("/metrics")).text
        assert f"trio_mlx_kv_memory_budget_bytes {float(LIMIT)}" in metrics
        assert "trio_mlx_kv_memory_reserved_bytes 0.0" in metrics


def test_the_kv_memory_flag_takes_a_size_with_its_unit() -> None:
    args = build_parser().parse_args(["serve", "--kv-memory", "8GiB"])
    assert args.kv_memory_bytes == 8 << 30
    assert build_parser().parse_args(["serve"]).kv_memory_bytes is None
