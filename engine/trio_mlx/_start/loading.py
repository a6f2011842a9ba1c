"""Loading a model for the engine: resolve the name, load (or shard), adjust, warm up.

What :func:`open_engine` and a distributed follower both need before any request:
:func:`resolve_model` turns the ``model`` argument into a folder or a Hugging Face
repo id (``None``: the bundled model), :func:`load` runs on the MLX thread and
returns a :class:`Loaded` (the model, its tokenizer and config, the batch lane,
the prompt cache), with a LoRA adapter fused and the chat template replaced
when asked, and :func:`load_error` names what could not be found or fetched.
Under ``mlx.launch`` :func:`load` takes rank 0's :class:`~trio_mlx.EngineSettings` and this
rank's shard instead (:mod:`trio_mlx._dist.leader`).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import attrs

from trio_mlx._accel import install as _accel
from trio_mlx._dist import leader as _distributed
from trio_mlx._errors import InvalidRequest, NotFound
from trio_mlx._lanes.batch import BatchLane
from trio_mlx._lanes.prompt_cache import PromptCache
from trio_mlx._lanes.prompt_disk import DiskTier, model_identity
from trio_mlx._lanes.records import RowSpec, StepPlan
from trio_mlx._lanes.speculative import Speculation
from trio_mlx._memory import (
    MIN_PROMPT_CACHE_BYTES,
    KVProfile,
    default_limit,
    default_prompt_cache,
)
from trio_mlx._params import SamplingParams
from trio_mlx._start import kv_measure
from trio_mlx._start import model_fixes as _model_fixes
from trio_mlx._start import vision as _vision
from trio_mlx._start import warmup as _cuda_warmup
from trio_mlx._start.settings import EngineSettings

logger = logging.getLogger("trio_mlx")

__all__ = [
    "Loaded",
    "load",
    "load_error",
    "resolve_model",
    "set_chat_template",
]


@attrs.define(eq=False)
class Loaded:
    """What the worker thread built at start-up."""

    model: Any
    tokenizer: Any
    config: dict[str, Any]
    caches_merge: bool
    lane: BatchLane
    prompt_cache: PromptCache | None
    #: The channel over the ``mx.distributed`` group the model is sharded over
    #: (None: one process).
    channel: _distributed.Channel | None = None
    #: Rank 0's end of the distributed command stream (None: one process, or a
    #: follower): the engine attaches it to its actor and mirrors serial work through it.
    leader: _distributed.Leader | None = None
    #: The step planner's grouping (admission in groups, removal in bulk, prompt-cache
    #: entries only for long prefixes): on a GPU the host-side cost of each admission,
    #: removal and fetch dominates and grouping pays; on the CPU the compute dominates,
    #: and a held arrival, a dead row or a prefilled token only wastes it.
    grouping: bool = True
    #: What a row's KV cache costs (measured on the model's caches), and the default
    #: KV memory budget of the rows (``EngineSettings.kv_memory_bytes`` None).
    kv_profile: KVProfile = attrs.field(factory=KVProfile)
    kv_default: int = 0
    #: A vision model's image side (None: a text model).
    vision: _vision.Vision | None = None


def resolve_model(model: str | os.PathLike[str] | None) -> str:
    """The folder or Hugging Face repo id ``model`` names (``None``: the bundled model)."""
    if model is None:
        try:
            from trio_mlx.default_model import default_model_path
        except ImportError:  # pragma: no cover - the bundled model ships with the package
            raise NotFound("no model given and trio_mlx has no bundled default model") from None
        path = default_model_path()
        if not (path / "config.json").is_file():
            raise NotFound(f"no model given and the bundled default model is missing ({path})")
        return str(path)
    text = os.fspath(model)
    if Path(text).exists():
        if not (Path(text) / "config.json").is_file():
            raise NotFound(f"{text} is not a model folder: it has no config.json", param="model")
        return text
    if is_repo_id(text):
        return text
    raise NotFound(f"model {text!r} not found: no such folder", param="model")


def is_repo_id(text: str) -> bool:
    """Whether ``text`` names a Hugging Face repository (``owner/name``), not a path."""
    return text.count("/") == 1 and not text.startswith(("/", ".", "~"))


def _hub_reason(error: Exception) -> str:
    """Why huggingface_hub could not fetch a model, in a few words."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - mlx-lm depends on it
        offline = False
    else:
        offline = bool(constants.HF_HUB_OFFLINE)
    if offline:
        return "HF_HUB_OFFLINE is set"
    lines = str(error).strip().splitlines()
    first = lines[0].removeprefix("Got: ").split(". ")[0] if lines else type(error).__name__
    return first if len(first) <= 120 else first[:117] + "..."


def load_error(path: str, error: Exception) -> NotFound | None:
    """The typed error for a model that could not be found or fetched (None: not one)."""
    hub = type(error).__module__.split(".")[0] == "huggingface_hub"
    if is_repo_id(path) and not Path(path).exists() and (hub or isinstance(error, OSError)):
        reason = _hub_reason(error)
        found = NotFound(
            f"cannot fetch model {path} from Hugging Face, and it is not in the local cache "
            f"({reason})",
            param="model",
            code="model_not_downloadable",
        )
    elif isinstance(error, FileNotFoundError):
        found = NotFound(f"cannot load the model at {path}: {error}", param="model")
    else:
        return None
    found.__cause__ = error
    return found


def fuse_lora(model: Any) -> None:
    """Fuse the LoRA layers an adapter put on ``model`` into its weights."""
    from mlx.utils import tree_unflatten

    fused = [(name, m.fuse()) for name, m in model.named_modules() if hasattr(m, "fuse")]
    if fused:
        model.update_modules(tree_unflatten(fused))


#: Prompt tokens (padded) prefilled per decode step on a GPU (``BatchLane.prefill_budget``):
#: a group of 16 chat arrivals of ~90 tokens fits in one pass. On the H200, 63 streams while
#: 2,197-word prompts arrived: 256 and 512 did not
#: lower the streams' gap p99 (106 and 96 ms against 75-125 at 1,536) and cost 42% of the
#: throughput and 2-4x the long prompts' TTFT.
GPU_PREFILL_BUDGET = 1536
#: The same on the CPU, where prefill costs its compute whatever the chunk: with the bundled
#: model, C=4 streams and ~1,000-token prompts arriving, the streams' ITL p99 while one was
#: prefilled was 141 ms (17.7x their median) unbounded, 67 ms (8.0x) at 512, 33 ms (4.1x)
#: at 256; but at 256 arrivals of 155 tokens that come together are prefilled apart (4-9%
#: more forward passes at C=16), at 512 not (+0.7%).
CPU_PREFILL_BUDGET = 512
# No long-prompt chunk by default (``BatchLane.long_prompt_chunk``, ``serve
# --long-prompt-chunk``), on any device. On the H200 (llama-1b; design/performance.md)
# a 768-token chunk lowered the streams' gap p99 while a 4,000-token
# prompt arrived among 63 chat streams (a median 2.9x their ITL median over five rounds
# against 3.6x without), but with prompts of 20-2,000 words arriving (the open loop) it
# cost a half-loaded server 10-66% on TTFT p50 and 12-25% on ITL p50 (four runs; ITL p99
# worse in three): about a third of those prompts are longer than the chunk, and each was
# prefilled alone.
# It is for chat servers with rare long prompts whose streams must stay smooth.


def _disk_tier(path: str, settings: EngineSettings, model: Any) -> DiskTier | None:
    """The prompt cache's disk tier for the loaded model (None: off, or the model's
    files cannot be found to tell it from another model)."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    if settings.prompt_cache_dir is None or settings.prompt_cache_disk_bytes <= 0:
        return None
    folder = Path(path)
    if not folder.is_dir():
        try:
            from huggingface_hub import snapshot_download

            folder = Path(snapshot_download(path, local_files_only=True))
        except Exception as exc:
            logger.warning("prompt cache: no disk tier, the model's files are not found: %s", exc)
            return None
    extra = [f"mlx-lm {mlx_lm.__version__}"]
    extra += [type(c).__name__ for c in make_prompt_cache(model)]
    if settings.adapter_path is not None:
        extra.append(model_identity(settings.adapter_path))
    tier = DiskTier(
        Path(settings.prompt_cache_dir),
        model_identity(folder, *extra),
        settings.prompt_cache_disk_bytes,
    )
    tier.open()
    return tier


def load(
    path: str,
    settings: EngineSettings,
    *,
    distributed: bool | None = None,
) -> Loaded:
    """Load, check and warm the model (on the worker thread).

    The lane is built in one call from ``settings`` and what the device says;
    only distributed rank 0 attaches its leader afterwards, once the warm-up
    step (which each rank runs alone) is done. ``distributed`` (default: whether ``mlx.launch`` started this process as one
    of several ranks) loads this rank's shard with rank 0's ``settings``.
    """
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    _accel.prepare(settings)
    lane_type: type[BatchLane] = BatchLane
    channel = None
    vision: _vision.Vision | None = None
    result: Any  # (model, tokenizer, config)
    if _distributed.launched() if distributed is None else distributed:
        group = _distributed.group()
        if group is None:
            raise InvalidRequest("launched for distributed mode, but the group has one rank")
        channel = _distributed.Channel(group)
        # Every rank takes rank 0's settings: they shape the collectives (and a
        # refusal below must end every rank, not leave the followers waiting).
        # (The decision hook is rank 0's own: a callable does not travel.)
        settings = channel.share(
            attrs.evolve(settings, decision_hook=None), limit=_distributed.start_timeout()
        )
        if settings.adapter_path is not None or settings.prompt_lookup:
            adapter = settings.adapter_path is not None
            raise InvalidRequest(
                "distributed mode does not support "
                + ("LoRA adapters" if adapter else "speculative decoding"),
                param="adapter_path" if adapter else "prompt_lookup",
                code="unsupported_in_distributed_mode",
            )
        result = _distributed.load_shard(path, group, settings.parallel)
        # Every rank has its shard: a barrier before the first step.
        channel.share(None, limit=_distributed.start_timeout())
        lane_type = _distributed.MirroredLane
    elif _vision.is_vision(path):
        if settings.adapter_path is not None:
            raise InvalidRequest("a vision model takes no adapter_path", param="adapter_path")
        model, tokenizer, config, vision = _vision.load(path)
        result = (model, tokenizer, config)
    else:
        result = mlx_lm.load(path, adapter_path=settings.adapter_path, return_config=True)
    model, tokenizer, config = result
    draft = None
    if settings.draft_model is not None:
        draft = load_draft(settings.draft_model, tokenizer, config)
    prompt_cache_bytes = settings.prompt_cache_bytes
    if getattr(getattr(model, "model", None), "pipeline_size", 1) > 1:
        # Pipeline stages hold different layers, so byte-capped caches would
        # evict differently on each rank: the ranks' prompts would diverge.
        prompt_cache_bytes = 0
    if settings.chat_template is not None:
        set_chat_template(tokenizer, settings.chat_template)
    if settings.adapter_path is not None:
        fuse_lora(model)
    _model_fixes.install(model)  # before any batched call
    device = _accel.install(model, settings, distributed=channel is not None)
    caches_merge = all(hasattr(c, "merge") for c in make_prompt_cache(model))
    warm = list(tokenizer.encode("Hello", add_special_tokens=False))[:1] or [0]
    kv_profile = kv_measure.measure(model, warm[0])
    memory = int(kv_measure.memory_limit() * settings.memory_share)
    weights = kv_measure.weight_bytes(model)
    if prompt_cache_bytes is None:
        # Every rank must evict alike, and their memory may differ: one fixed cap there.
        distributed = channel is not None
        prompt_cache_bytes = (
            MIN_PROMPT_CACHE_BYTES if distributed else default_prompt_cache(memory, weights)
        )
    kv_default = default_limit(memory, weights, prompt_cache_bytes, kv_profile)
    # On a GPU the host-side cost of each admission, removal and fetch dominates and
    # grouping pays; on the CPU the compute does (see ``Loaded.grouping``).
    grouping = mx.default_device() != mx.cpu
    prompt_cache = PromptCache(prompt_cache_bytes) if prompt_cache_bytes > 0 else None
    # A long prompt is prefilled a chunk per decode step: it never stalls the batch ...
    budget = settings.prefill_budget or (GPU_PREFILL_BUDGET if grouping else CPU_PREFILL_BUDGET)
    lane = lane_type(
        model,
        tokenizer,
        settings.max_batch,
        prompt_cache=prompt_cache,
        prefill_step_size=settings.prefill_step_size,
        prefill_batch_size=settings.prefill_batch_size,
        prefill_budget=budget,
        # ... and alone, a shorter chunk a step, where asked (see the note by CPU_PREFILL_BUDGET).
        long_prompt_chunk=settings.long_prompt_chunk,
        # On the CPU every dead row leaves at the end of its step, and any cached
        # prefix is reused: a prefilled token costs real compute there.
        removal_delay=(16 if grouping else 0)
        if settings.removal_delay is None
        else settings.removal_delay,
        removal_fraction=settings.removal_fraction,
        cache_min_prefix=64 if grouping else 1,
        prefill_width_multiple=settings.prefill_width_multiple,
        solo_decode=device.solo_decode,
        traced_decode=device.traced_decode,
        speculation=Speculation(
            method="prompt_lookup" if draft is None else "draft_model",
            draft=draft,
            num_draft_tokens=settings.num_draft_tokens,
            max_batch=settings.speculation_max_batch,
            governed=settings.speculation_governor,
        )
        if settings.prompt_lookup or draft is not None
        else None,
        vision=vision,
    )
    if caches_merge:
        lane.step(StepPlan([RowSpec(0, (warm[0], warm[0]), SamplingParams(max_tokens=2))]))
        while lane.rows:
            lane.step()
    else:
        mx.eval(model(mx.array([warm]), cache=make_prompt_cache(model)))
    if prompt_cache is not None:
        prompt_cache.clear()  # the warm-up row's
    leader = None
    if channel is not None and channel.rank == 0:  # distributed: the lane is a MirroredLane
        assert isinstance(lane, _distributed.MirroredLane)
        leader = lane.leader = _distributed.Leader(channel)
    if channel is None:  # ranks would have to agree on every pass: not worth it there
        _cuda_warmup.warm_up(model, settings.max_batch, budget, settings.switches, lane=lane)
        if prompt_cache is not None:
            # After the warm-up's rows: they are no one's prompts. Not in
            # distributed mode: every rank must find the same entries.
            prompt_cache.disk = _disk_tier(path, settings, model)
            if prompt_cache.disk is not None:
                lane.prompt_checkpoints = True  # what the disk tier keeps
    return Loaded(
        model,
        tokenizer,
        dict(config),
        caches_merge,
        lane,
        prompt_cache,
        channel,
        leader,
        grouping,
        kv_profile,
        kv_default,
        vision,
    )


def load_draft(path: str, tokenizer: Any, config: dict[str, Any]) -> Any:
    """The draft model in folder ``path``, refused unless it shares the model's vocabulary
    and its caches can be cut back (plain ``KVCache`` layers)."""
    import json

    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from trio_mlx._lanes.speculative import cache_reason

    with open(os.path.join(path, "config.json")) as f:
        draft_config = json.load(f)
    ours, theirs = config.get("vocab_size"), draft_config.get("vocab_size")
    why = f"vocab_size {theirs} where the model has {ours}" if ours != theirs else None
    if why is None and load_tokenizer(Path(path)).vocab != tokenizer.vocab:
        why = "a tokenizer with another vocabulary"
    if why is not None:
        raise InvalidRequest(
            f"draft model {path} cannot draft for this model: it has {why} (a draft model "
            "must share the model's tokenizer)",
            param="draft_model",
            code="draft_vocabulary_mismatch",
        )
    draft = mlx_lm.load(path)[0]
    reason = cache_reason(make_prompt_cache(draft))
    if reason is not None:
        raise InvalidRequest(
            f"draft model {path} cannot draft: {reason}",
            param="draft_model",
            code="draft_model_unsupported",
        )
    return draft


def set_chat_template(tokenizer: Any, template: str) -> None:
    """Use ``template`` (Jinja text) for chat prompts; a template that cannot render is refused."""
    tokenizer.chat_template = template
    tokenizer.has_chat_template = True
    try:
        tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hello"}], add_generation_prompt=True, tokenize=False
        )
    except Exception as exc:
        raise InvalidRequest(
            f"the chat template cannot render a message: {exc}", param="chat_template"
        ) from None
