"""trio-mlx: an LLM generation engine for MLX, built as a Trio actor.

Public names live here; the implementation sits in private ``_modules``.
The engine never imports the web stack (quart, hypercorn, trio_mlx_http).
"""

from trio_mlx._errors import (
    EngineClosed,
    EngineOverloaded,
    GenerationFailed,
    InvalidRequest,
    NotFound,
    TrioMLXError,
)
from trio_mlx._params import Completion, Delta, GenerationResult, SamplingParams, TokenLogprob
from trio_mlx._version import __version__

__all__ = [
    "Completion",
    "Delta",
    "EngineClosed",
    "EngineOverloaded",
    "GenerationFailed",
    "GenerationResult",
    "InvalidRequest",
    "NotFound",
    "SamplingParams",
    "TokenLogprob",
    "TrioMLXError",
    "__version__",
]
