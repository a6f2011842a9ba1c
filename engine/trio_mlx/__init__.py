"""trio-mlx: an LLM generation engine for MLX, built as a Trio actor.

Public names live here; the implementation sits in private ``_modules``.
The engine never imports the web stack (quart, hypercorn, trio_mlx_http).
"""

from trio_mlx._core.arbiter import ArbiterPolicy, ArbiterStatistics
from trio_mlx._core.engine import Engine
from trio_mlx._core.images import ImageInput
from trio_mlx._core.opening import open_engine
from trio_mlx._core.prompts import PreparedPrompt
from trio_mlx._core.request import EngineStatistics
from trio_mlx._core.stream import GenerationStream
from trio_mlx._errors import (
    AdapterConflict,
    EngineClosed,
    EngineOverloaded,
    GenerationFailed,
    InvalidAdapter,
    InvalidGrammar,
    InvalidRequest,
    ModelUnavailable,
    NotFound,
    ReaderStalled,
    TrioMLXError,
)
from trio_mlx._host.host import ModelHost, ModelInfo, ModelState, open_host
from trio_mlx._lanes.prompt_cache import PromptCacheStatistics
from trio_mlx._params import (
    Completion,
    Delta,
    Embeddings,
    GenerationResult,
    SamplingParams,
    TokenLogprob,
)
from trio_mlx._start.blas import BackendInfo, backend_info
from trio_mlx._start.settings import EngineSettings
from trio_mlx._version import __version__
from trio_mlx.default_model import default_adapter_path, default_model_path

__all__ = [
    "AdapterConflict",
    "ArbiterPolicy",
    "ArbiterStatistics",
    "BackendInfo",
    "Completion",
    "Delta",
    "Embeddings",
    "Engine",
    "EngineClosed",
    "EngineOverloaded",
    "EngineSettings",
    "EngineStatistics",
    "GenerationFailed",
    "GenerationResult",
    "GenerationStream",
    "ImageInput",
    "InvalidAdapter",
    "InvalidGrammar",
    "InvalidRequest",
    "ModelHost",
    "ModelInfo",
    "ModelState",
    "ModelUnavailable",
    "NotFound",
    "PreparedPrompt",
    "PromptCacheStatistics",
    "ReaderStalled",
    "SamplingParams",
    "TokenLogprob",
    "TrioMLXError",
    "__version__",
    "backend_info",
    "default_adapter_path",
    "default_model_path",
    "open_engine",
    "open_host",
]
