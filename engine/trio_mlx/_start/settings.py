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
from collections.abc import Callable, Mapping
from typing import Any

import attrs

from trio_mlx._errors import InvalidRequest, NotFound
from trio_mlx._lanes.embed import POOLINGS
from trio_mlx._lanes.structured import COMPILE_TIMEOUT, DEFAULT_GRAMMAR_CACHE_BYTES

__all__ = [
    "DEFAULT_MAX_IMAGE_PIXELS",
    "DEFAULT_PROMPT_CACHE_DISK_BYTES",
    "PARALLEL",
    "SWITCHES",
    "EngineSettings",
    "switches",
]

#: The default bound on an input image's pixels: 8192 x 8192 (PIL's own bomb
#: check starts at about 89 million).
DEFAULT_MAX_IMAGE_PIXELS = 8192 * 8192
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


def _number(low: float, *, above: bool = False, optional: bool = False) -> Any:
    """A number > ``low`` (``above``) or >= ``low``; None too when ``optional``."""
    relation = ">" if above else ">="

    def check(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
        if value is None and optional:
            return
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not (value > low if above else value >= low)
        ):
            raise InvalidRequest(
                f"{_name(attribute)} must be a number {relation} {low:g}", param=_name(attribute)
            )

    return check


def _flag(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise InvalidRequest(f"{_name(attribute)} must be true or false", param=_name(attribute))


def _pooling(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and value not in POOLINGS:
        raise InvalidRequest(
            f"{_name(attribute)} must be one of {', '.join(POOLINGS)}", param=_name(attribute)
        )


def _share(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise InvalidRequest(
            f"{_name(attribute)} must be a number in (0, 1]", param=_name(attribute)
        )


def _hook(_: Any, attribute: attrs.Attribute[Any], value: Any) -> None:
    if value is not None and not callable(value):
        raise InvalidRequest(f"{_name(attribute)} must be callable", param=_name(attribute))


def _adapter_folder(_: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """A missing adapter folder is named as the adapter, before the model loads."""
    if value is not None and not os.path.isdir(value):
        raise NotFound(f"adapter {value!r} not found: no such folder", param="adapter_path")


def _draft_folder(settings: Any, attribute: attrs.Attribute[Any], value: str | None) -> None:
    """A draft model is a local folder (the bundled models' kind), checked before any load,
    and one way of drafting at a time."""
    if value is not None and settings.prompt_lookup:
        raise InvalidRequest(
            "draft_model and prompt_lookup cannot both be set: choose one way of drafting",
            param="draft_model",
        )
    if value is not None and not os.path.isfile(os.path.join(value, "config.json")):
        raise NotFound(
            f"draft model {value!r} not found: no folder with a config.json", param="draft_model"
        )


def _draft_path(value: str | os.PathLike[str] | None) -> str | None:
    """A draft model's folder; the bundled draft's name (``pydoc-llama-draft``) where no
    such folder exists names the bundled one."""
    path = _path(value)
    if path is not None and not os.path.exists(path):
        from trio_mlx.default_model import DRAFT, default_draft_path

        if path == DRAFT:
            return os.fspath(default_draft_path())
    return path


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
    """How an engine loads its model and shares the GPU.

    :func:`~trio_mlx.open_engine` says what the first settings do, from
    ``adapter_path`` to ``kv_memory_bytes``. The rest tune the scheduler's inner
    bounds; their defaults are the measured ones (``design/engine.md``,
    ``design/performance.md``), and tests and the bench set them to force a case:

    - ``burst_steps``, ``burst_seconds``: the most decode steps one step call
      may run in plain decoding, and its time budget in seconds.
    - ``admit_group``, ``admit_fraction``, ``admit_wait_steps``,
      ``admit_wait_seconds`` (grouped admission): while rows decode, admitted
      rows wait until there are ``admit_group`` of them (at most the prefill
      batch, nor ``1/admit_fraction`` of the decoding rows), or the first has
      waited that many decode steps or seconds. ``admit_group`` ``None``: 16 on
      a GPU, 1 on the CPU (arrivals admitted at once).
    - ``prefill_floor``: the smallest chunk ``prefill_stall`` may set, in tokens.
    - ``timing_lag``: steps after one that prefilled that may still pay for it
      (a GPU runs prefill queued), so do not count as decode-only in the timings.
    - ``removal_delay``, ``removal_fraction``: finished and cancelled rows leave
      the batch once the oldest has been dead ``removal_delay`` decode steps, or
      once there are ``live / removal_fraction`` of them (0: never by count).
      ``removal_delay`` ``None``: 16 on a GPU, 0 on the CPU.
    - ``prefill_width_multiple``: experimental, off (1): every prefill pass is
      right-padded to a multiple of this width, so that passes repeat a few
      shapes; it did not lower a long prompt's worst step on the H200.
    - ``traced_decode``: decode steps traced once per batch shape
      (``trio_mlx._accel.traced_decode``); ``None``: the
      ``TRIO_MLX_TRACED_DECODE`` switch, on by default on CUDA only. Never in
      distributed mode.
    - ``embedding_pooling`` (``last``, ``mean``, ``cls``; None: what the model's
      sentence-transformers files say, else the model serves no embeddings),
      ``embedding_matryoshka`` (``dimensions`` truncation allowed),
      ``embedding_share`` (the most of the steps embedding passes take while
      rows decode), ``max_embedding_inputs`` (inputs per request) and
      ``embedding_batch_tokens`` (padded tokens of one pass; None: a quarter
      of the prefill budget, which a pass then stalls the streams less than): see
      ``Engine.embed``.
    - ``prompt_lookup``, ``draft_model``, ``num_draft_tokens``,
      ``speculation_max_batch``: speculative decoding in the batch (``prompt_lookup``:
      drafts from each row's own prompt and output; at most ``num_draft_tokens`` a
      row and step; none while the batch holds more than ``speculation_max_batch``
      rows; ``design/engine.md``). ``draft_model`` (a folder, or
      ``"pydoc-llama-draft"``: the bundled model's draft; it must share the
      model's tokenizer, checked at load) drafts instead of the lookup, greedily,
      each row over its own KV cache. ``speculation_governor`` (on): a batch size
      where speculative steps measured fewer tokens a second than plain ones runs
      plain steps (tests that count drafts turn it off: it reads the clock).
    - ``memory_share``: the part of MLX's memory limit this engine plans its KV
      budget and prompt cache in (the defaults of ``kv_memory_bytes`` and
      ``prompt_cache_bytes``); a :class:`~trio_mlx.ModelHost` gives each of its
      ``max_models`` engines an equal part.
    - ``decision_hook``: called on the Trio thread with each arbiter decision
      and the arbiter's statistics after it (tests record them); not sent to
      the other ranks of a distributed group.
    """

    adapter_path: str | None = attrs.field(default=None, converter=_path, validator=_adapter_folder)
    max_batch: int = attrs.field(default=8, validator=_int_at_least(1))
    max_queue: int = attrs.field(default=256, validator=_int_at_least(0))
    drain_timeout: float | None = attrs.field(default=1.0, validator=_number(0, optional=True))
    min_batch_steps: int = attrs.field(default=8, validator=_int_at_least(0))
    #: None: a share of the memory the weights leave (``_memory.default_prompt_cache``).
    prompt_cache_bytes: int | None = attrs.field(
        default=None, validator=_int_at_least(0, optional=True)
    )
    #: Most pixels (width x height) an input image may decode to (a vision model's).
    max_image_pixels: int = attrs.field(
        default=DEFAULT_MAX_IMAGE_PIXELS, validator=_int_at_least(1)
    )
    #: The prompt cache's disk tier: its folder (None: off) and byte cap.
    prompt_cache_dir: str | None = attrs.field(
        default=None, converter=_path, validator=_cache_folder
    )
    prompt_cache_disk_bytes: int = attrs.field(
        default=DEFAULT_PROMPT_CACHE_DISK_BYTES, validator=_int_at_least(0)
    )
    grace_period: float = attrs.field(default=5.0, validator=_number(0))
    prefill_step_size: int = attrs.field(default=2048, validator=_int_at_least(1))
    prefill_batch_size: int = attrs.field(default=16, validator=_int_at_least(1))
    prefill_budget: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    long_prompt_chunk: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    prefill_stall: float | None = attrs.field(
        default=None, validator=_number(1, above=True, optional=True)
    )
    parallel: str = attrs.field(default="auto", validator=_parallel)
    chat_template: str | None = attrs.field(default=None, validator=_template)
    grammar_timeout: float = attrs.field(default=COMPILE_TIMEOUT, validator=_number(0, above=True))
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
    embedding_pooling: str | None = attrs.field(default=None, validator=_pooling)
    embedding_matryoshka: bool = attrs.field(default=False, validator=_flag)
    embedding_share: float = attrs.field(default=0.1, validator=_share)
    memory_share: float = attrs.field(default=1.0, validator=_share)
    max_embedding_inputs: int = attrs.field(default=2048, validator=_int_at_least(1))
    embedding_batch_tokens: int | None = attrs.field(
        default=None, validator=_int_at_least(1, optional=True)
    )
    burst_steps: int = attrs.field(default=16, validator=_int_at_least(1))
    burst_seconds: float = attrs.field(default=0.02, validator=_number(0))
    admit_group: int | None = attrs.field(default=None, validator=_int_at_least(1, optional=True))
    admit_fraction: int = attrs.field(default=8, validator=_int_at_least(1))
    admit_wait_steps: int = attrs.field(default=32, validator=_int_at_least(0))
    admit_wait_seconds: float = attrs.field(default=0.25, validator=_number(0))
    prefill_floor: int = attrs.field(default=32, validator=_int_at_least(1))
    timing_lag: int = attrs.field(default=2, validator=_int_at_least(0))
    removal_delay: int | None = attrs.field(default=None, validator=_int_at_least(0, optional=True))
    removal_fraction: int = attrs.field(default=8, validator=_int_at_least(0))
    prefill_width_multiple: int = attrs.field(default=1, validator=_int_at_least(1))
    traced_decode: bool | None = attrs.field(default=None, validator=_flag)
    prompt_lookup: bool = attrs.field(default=False, validator=_flag)
    draft_model: str | None = attrs.field(
        default=None, converter=_draft_path, validator=_draft_folder
    )
    num_draft_tokens: int = attrs.field(default=4, validator=_int_at_least(1))
    speculation_max_batch: int = attrs.field(default=8, validator=_int_at_least(1))
    speculation_governor: bool = attrs.field(default=True, validator=_flag)
    decision_hook: Callable[[Any, Any], None] | None = attrs.field(
        default=None, validator=_hook, eq=False, repr=False
    )
    #: The ``TRIO_MLX_*`` device-path switches (:data:`SWITCHES`), read from the
    #: environment when the settings are built unless given.
    switches: Mapping[str, str] = attrs.field(factory=switches, converter=dict)
