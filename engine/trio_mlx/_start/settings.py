"""Every setting of an engine in one frozen, validated value: :class:`EngineSettings`.

:func:`~trio_mlx.open_engine` takes one (or builds one from its keywords), the CLI
builds one from its flags, and a distributed follower receives rank 0's. A bad value
raises :class:`~trio_mlx.InvalidRequest` naming the setting when the value is built,
so it never travels. The ``TRIO_MLX_*`` switches of the engine's device paths are
read from the environment here, once, when the settings are built
(:attr:`EngineSettings.switches`); the modules they switch take them as arguments.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import attrs

from trio_mlx._errors import InvalidRequest, NotFound
from trio_mlx._lanes.structured import COMPILE_TIMEOUT, DEFAULT_GRAMMAR_CACHE_BYTES

__all__ = [
    "DEFAULT_PROMPT_CACHE_BYTES",
    "DEFAULT_PROMPT_CACHE_DISK_BYTES",
    "PARALLEL",
    "SWITCHES",
    "EngineSettings",
    "switches",
]

#: The default byte cap of the prompt cache.
DEFAULT_PROMPT_CACHE_BYTES = 256 * 1024 * 1024
#: The default byte cap of the prompt cache's disk tier (when it has a folder).
DEFAULT_PROMPT_CACHE_DISK_BYTES = 10 * 1024**3
#: How a model is split over the ranks of a distributed group.
PARALLEL = ("auto", "tensor", "pipeline")
#: The environment switches of the engine's device paths (each module's docstring says
#: what it switches): read once, into :attr:`EngineSettings.switches`.
SWITCHES = (
    "TRIO_MLX_CUDA_POOL_GIB",
    "TRIO_MLX_CUDA_WARMUP",
    "TRIO_MLX_DECODE_KERNEL",
    "TRIO_MLX_FUSED_PROJECTIONS",
    "TRIO_MLX_SOLO_DECODE",
    "TRIO_MLX_TRACED_DECODE",
)


def switches(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The :data:`SWITCHES` set in ``environ`` (default: the process's environment)."""
    environ = os.environ if environ is None else environ
    return {name: environ[name] for name in SWITCHES if name in environ}


def _name(attribute: attrs.Attribute[Any]) -> str:
    return attribute.name


def _int_at_least(low: int, *, optional: bool = False) -> Any:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if type(value) is not int or value < low:
            raise InvalidRequest(
                f"{_name(attribute)} must be an integer >= {low}", param=_name(attribute)
            )

    return check


def _number_above(low: float, *, optional: bool = False) -> Any:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > low:
            raise InvalidRequest(
                f"{_name(attribute)} must be a number > {low:g}", param=_name(attribute)
            )

    return check


def _number_at_least(low: float, *, optional: bool = False) -> Any:
    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low:
            raise InvalidRequest(
                f"{_name(attribute)} must be a number >= {low:g}", param=_name(attribute)
            )

    return check


def _adapter_folder(_: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """A missing adapter folder is named as the adapter, before the model loads."""
    if value is not None and not os.path.isdir(value):
        raise NotFound(f"adapter {value!r} not found: no such folder", param="adapter_path")


def _cache_folder(_: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    if value is not None and os.path.exists(value) and not os.path.isdir(value):
        raise InvalidRequest(f"prompt_cache_dir {value} is not a folder", param=_name(attribute))


def _template(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not (isinstance(value, str) and value):
        raise InvalidRequest("chat_template must be a non-empty string", param="chat_template")


def _parallel(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value not in PARALLEL:
        raise InvalidRequest(f"parallel must be one of {', '.join(PARALLEL)}", param="parallel")


def _path(value: str | os.PathLike[str] | None) -> str | None:
    return None if value is None else os.fspath(value)


@attrs.frozen(kw_only=True)
class EngineSettings:
    """How an engine loads its model and shares the GPU (see :func:`~trio_mlx.open_engine`
    for what each setting does)."""

    adapter_path: str | None = attrs.field(default=None, converter=_path, validator=_adapter_folder)
    max_batch: int = attrs.field(default=8, validator=_int_at_least(1))
    max_queue: int = attrs.field(default=256, validator=_int_at_least(0))
    drain_timeout: float | None = attrs.field(
        default=1.0, validator=_number_at_least(0, optional=True)
    )
    min_batch_steps: int = attrs.field(default=8, validator=_int_at_least(0))
    prompt_cache_bytes: int = attrs.field(
        default=DEFAULT_PROMPT_CACHE_BYTES, validator=_int_at_least(0)
    )
    #: The prompt cache's disk tier: its folder (None: off) and byte cap.
    prompt_cache_dir: str | None = attrs.field(
        default=None, converter=_path, validator=_cache_folder
    )
    prompt_cache_disk_bytes: int = attrs.field(
        default=DEFAULT_PROMPT_CACHE_DISK_BYTES, validator=_int_at_least(0)
    )
    grace_period: float = attrs.field(default=5.0, validator=_number_at_least(0))
    prefill_step_size: int = attrs.field(default=2048, validator=_int_at_least(1))
    prefill_batch_size: int = attrs.field(default=16, validator=_int_at_least(1))
    prefill_budget: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    long_prompt_chunk: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    prefill_stall: float | None = attrs.field(
        default=None, validator=_number_above(1, optional=True)
    )
    parallel: str = attrs.field(default="auto", validator=_parallel)
    chat_template: str | None = attrs.field(default=None, validator=_template)
    grammar_timeout: float = attrs.field(default=COMPILE_TIMEOUT, validator=_number_above(0))
    grammar_cache_bytes: int = attrs.field(
        default=DEFAULT_GRAMMAR_CACHE_BYTES, validator=_int_at_least(0)
    )
    max_unread_tokens: int | None = attrs.field(
        default=1024, validator=_int_at_least(1, optional=True)
    )
    max_loras: int | None = attrs.field(default=8, validator=_int_at_least(1, optional=True))
    kv_memory_bytes: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    #: The ``TRIO_MLX_*`` device-path switches (:data:`SWITCHES`), read from the
    #: environment when the settings are built unless given.
    switches: Mapping[str, str] = attrs.field(factory=switches, converter=dict)
