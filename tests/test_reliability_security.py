"""Security (fast subset of ``nox -s soak``): API key, adapter folder, body limit, bind."""

from __future__ import annotations

from pathlib import Path

import pytest
from soak import security
from soak._server import serve

import trio_mlx

pytestmark = pytest.mark.model


def test_with_an_api_key_only_health_answers_without_it() -> None:
    with serve("--api-key", "s3cret") as server:
        report = security.check_api_key(server.url, "s3cret")
    assert report["leaks"] == []
    assert report["hung"] == []
    assert report["health_without_key"] == 200
    assert report["with_key"] == 200


def test_adapter_paths_cannot_leave_the_adapter_dir_and_big_bodies_get_413_early(
    tmp_path: Path,
) -> None:
    inside, outside = security.prepare_adapter_dir(tmp_path, trio_mlx.default_adapter_path("shout"))
    with serve("--adapter-dir", str(inside), "--max-body-bytes", "100000") as server:
        paths = security.check_adapter_paths(server.url, outside)
        body = security.check_body_limit(server.url, 100_000)
    assert paths["escaped"] == []
    assert all(400 <= status < 500 for status in paths["statuses"].values()), paths
    assert paths["legit_mount"] == 201
    assert body["status"] == 413
    assert not body["read_whole"]
    assert body["sent_before_answer"] <= 4 * 100_000
    assert body["content_length_only"] == 413


def test_the_default_bind_is_loopback() -> None:
    assert security.default_bind() == {"default_host": "127.0.0.1"}
    with serve() as server:
        assert server.url.startswith("http://127.0.0.1:")
