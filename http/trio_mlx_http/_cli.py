"""The ``trio-mlx`` command line: ``serve`` and ``generate``.

Only argparse is imported until the arguments are parsed: ``--help`` answers
at once and never imports MLX, Trio or the web stack. A start-up failure is
told in a line or two (:mod:`trio_mlx_http._server.startup`); ``--debug`` adds the
traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any, NoReturn


class _HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with every option's default (unless the help states it)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            "default:" in text
            or default is None
            or default is False
            or default is argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse's parser, telling a mistake in two lines instead of the whole usage."""

    def error(self, message: str) -> NoReturn:
        """Print what is wrong and where the options are; exit 2 (argparse's status)."""
        self.exit(2, f"{self.prog}: error: {message}\nRun '{self.prog} --help' for the options.\n")


class _VersionAction(argparse.Action):
    """``--version``: imports the package only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "show the version and exit")
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from trio_mlx._version import __version__

        print(f"trio-mlx {__version__}")
        parser.exit()


class _ModelAction(argparse.Action):
    """``--model``, repeatable: ``models`` holds every one given, ``model`` the first."""

    def __call__(
        self, parser: argparse.ArgumentParser, namespace: Any, value: Any, *_: Any
    ) -> None:
        models = [*getattr(namespace, "models", ()), value]
        namespace.models, namespace.model = models, models[0]


def _add_model_flags(parser: argparse.ArgumentParser) -> None:
    parser.set_defaults(models=[])
    parser.add_argument(
        "--model",
        action=_ModelAction,
        default=None,
        help="a local model folder or a Hugging Face repo id (mlx-community/...); "
        "default: the bundled model. serve: repeat it to serve several (loaded on demand)",
    )
    parser.add_argument("--adapter-path", default=None, help="a LoRA adapter folder to load")
    parser.add_argument(
        "--max-tokens", type=int, default=512, help="default max tokens per completion"
    )
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k (0 disables)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p (0 disables)")
    parser.add_argument(
        "--chat-template", default=None, help="a chat template (Jinja text, or a file holding it)"
    )
    parser.add_argument(
        "--parallel",
        default="auto",
        choices=["auto", "tensor", "pipeline"],
        help="under mlx.launch with several ranks: how the model is split "
        "(auto: tensor where the architecture supports it, else pipeline)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="logging level",
    )
    parser.add_argument(
        "--no-fast-blas",
        action="store_true",
        help="on Linux, do not re-run with an optimized BLAS preloaded (also TRIO_MLX_FAST_BLAS=0)",
    )


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (0: any)")
    parser.add_argument(
        "--decode-concurrency",
        "--max-batch",
        dest="max_batch",
        type=int,
        default=8,
        help="rows decoded together in the continuous batch",
    )
    parser.add_argument(
        "--prompt-concurrency",
        type=int,
        default=None,
        help="prompts prefilled together (default: the engine's, 16)",
    )
    parser.add_argument(
        "--prefill-budget",
        type=int,
        default=None,
        metavar="TOKENS",
        help="prompt tokens prefilled between two decode steps; a longer prompt is "
        "prefilled in chunks (default: 1536 on a GPU, 512 on the CPU)",
    )
    parser.add_argument(
        "--long-prompt-chunk",
        type=int,
        default=None,
        metavar="TOKENS",
        help="a prompt longer than this is prefilled alone, this many tokens between two "
        "decode steps, and while it waits no pass is longer, unless the other prompts "
        "waiting hold more than --prefill-budget; smoother streams around rare long "
        "prompts, for TTFT when many are long (default: off)",
    )
    parser.add_argument(
        "--prefill-stall",
        type=float,
        default=None,
        metavar="X",
        help="while streams decode, cut prompts into chunks as small as the measured "
        "step times need, so that a step that prefills one prompt's chunk takes about X "
        "times one that does not (> 1; default: off, chunks of --prefill-budget); smoother "
        "streams for less prefill throughput: for a server with headroom",
    )
    parser.add_argument("--max-queue", type=int, default=256, help="requests that may wait")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=1.0,
        help="seconds a serial or exclusive job waits before the batch drains for it",
    )
    parser.add_argument(
        "--grammar-timeout",
        type=float,
        default=None,
        help="seconds a response_format schema may take to compile before a 400 (default 10)",
    )
    parser.add_argument(
        "--grammar-cache-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="bound of the compiled grammars kept for reuse, by their estimated size, "
        "e.g. 64M; 0 keeps none (default: 256M)",
    )
    parser.add_argument(
        "--adapter-dir", default=None, help="POST /v1/adapters mounts only adapters in here"
    )
    parser.add_argument(
        "--max-loras",
        type=int,
        default=None,
        metavar="N",
        help="most adapters mounted at once; one more is refused with 409 (default: 8)",
    )
    parser.add_argument(
        "--embedding-pooling",
        choices=["last", "mean", "cls"],
        default=None,
        help="serve /v1/embeddings pooling the final hidden states so (default: what the "
        "model's sentence-transformers files say; a model without them serves none)",
    )
    parser.add_argument(
        "--embedding-matryoshka",
        action="store_true",
        default=None,
        help="the model's embeddings may be truncated: /v1/embeddings accepts dimensions",
    )
    parser.add_argument(
        "--embedding-share",
        type=float,
        default=None,
        metavar="X",
        help="the most of the steps embedding passes take while chat decodes, in (0, 1] "
        "(default: 0.1)",
    )
    parser.add_argument(
        "--max-embedding-inputs",
        type=int,
        default=None,
        metavar="N",
        help="most inputs one /v1/embeddings request may carry (default: 2048)",
    )
    parser.add_argument(
        "--prompt-lookup",
        action="store_true",
        default=None,
        help="speculative decoding: each row drafts tokens from its own prompt and output, "
        "verified in the batch's forward pass (greedy outputs unchanged)",
    )
    parser.add_argument(
        "--draft-model",
        default=None,
        metavar="FOLDER",
        help="speculative decoding with a draft model (a folder, or pydoc-llama-draft: the "
        "bundled model's) that shares the model's tokenizer (checked at load); not with "
        "--prompt-lookup",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help="most draft tokens a row verifies per step (default: 4)",
    )
    parser.add_argument(
        "--speculation-max-batch",
        type=int,
        default=None,
        metavar="N",
        help="no speculation while the batch holds more rows than this (default: 8)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("TRIO_MLX_API_KEY"),
        help="require 'Authorization: Bearer KEY' (default: env TRIO_MLX_API_KEY)",
    )
    parser.add_argument("--cors-origin", default=None, help="Access-Control-Allow-Origin value")
    parser.add_argument(
        "--max-body-bytes", type=int, default=4 * 1024 * 1024, help="larger bodies get 413"
    )
    parser.add_argument(
        "--allow-image-urls",
        action="store_true",
        help="fetch http(s) image URLs in requests (default: data: URLs and base64 only)",
    )
    parser.add_argument(
        "--max-images", type=int, default=8, help="most images one request may hold"
    )
    parser.add_argument(
        "--max-image-bytes",
        type=_size,
        default=20 * 1024 * 1024,
        metavar="BYTES",
        help="most bytes of one image, encoded (default: 20M)",
    )
    parser.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        metavar="N",
        help="most pixels (width x height) of one image (default: 8192 x 8192)",
    )
    parser.add_argument(
        "--image-fetch-timeout",
        type=float,
        default=10.0,
        help="seconds one image URL may take to fetch",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="connections held at once; past it a new one gets 503 and is closed",
    )
    parser.add_argument(
        "--write-timeout",
        type=float,
        default=30.0,
        help="seconds a client may stop reading before its connection is closed",
    )
    parser.add_argument(
        "--served-model-name",
        action="append",
        default=None,
        metavar="NAME",
        help="a name the model answers to, listed in /v1/models (repeatable; the first is "
        "the name answers carry). A name with *, ? or [ is a pattern, e.g. 'claude-*' for "
        "every name Claude Code sends. The --model id and its last path component are "
        "always accepted",
    )
    parser.add_argument(
        "--sse-keepalive",
        type=float,
        default=15.0,
        metavar="SECONDS",
        help="a stream silent this long (queued, or in a long prefill) sends a keep-alive: "
        "an SSE comment, or a ping event on /v1/messages (0: never)",
    )
    parser.add_argument(
        "--chat-template-args",
        type=_json_object,
        default={},
        metavar="JSON",
        help="default chat template arguments, e.g. '{\"enable_thinking\": false}'; "
        "a request's chat_template_kwargs override them",
    )
    parser.add_argument(
        "--reasoning-markers",
        type=_markers,
        default=None,
        metavar="START,END",
        help="the markers around a model's reasoning, split out into reasoning_content "
        "(default: the tokenizer's, e.g. <think>,</think>; 'off' keeps reasoning in content)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        choices=[2, 3, 4, 6, 8],
        help="quantize every request's KV cache to this many bits "
        "(requests then run one at a time, in the serial lane)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        choices=[32, 64, 128],
        help="group size of the KV-cache quantization",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="cap of the prompt (KV) cache, e.g. 512M or 2G; 0 disables it "
        "(default: a fifth of the memory MLX may use, less the weights; at least 256M)",
    )
    parser.add_argument(
        "--kv-memory",
        dest="kv_memory_bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="what the running requests' KV caches may hold at worst, e.g. 8GiB; a request "
        "waits until it fits, one that never could is refused (default: half of MLX's "
        "memory limit less the weights)",
    )
    parser.add_argument(
        "--model-dir",
        default=None,
        metavar="DIR",
        help="serve every model folder in DIR by its name, each loaded when a request names "
        "it (the first --model, else DIR's first, is the default and loaded at start)",
    )
    parser.add_argument(
        "--max-models", type=int, default=None, metavar="N", help="most models loaded at once"
    )
    parser.add_argument(
        "--max-model-memory",
        type=_size,
        default=None,
        metavar="BYTES",
        help="most bytes of weights loaded at once, e.g. 40G (least recently used idle "
        "models are unloaded to make room)",
    )
    parser.add_argument(
        "--idle-unload",
        type=float,
        default=None,
        metavar="SECONDS",
        help="unload a model no request has used for this long (default: never)",
    )
    parser.add_argument(
        "--load-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="longest a request waits for its model to load, then 503 with Retry-After",
    )
    parser.add_argument(
        "--prompt-cache-dir",
        default=None,
        metavar="DIR",
        help="keep checkpoints of long prompts (1,024 tokens or more) in this folder, "
        "across restarts (off by default; servers may share the folder)",
    )
    parser.add_argument(
        "--prompt-cache-disk-bytes",
        type=_size,
        default=None,
        metavar="BYTES",
        help="cap of --prompt-cache-dir's files, least recently used evicted first "
        "(default: the engine's, 10G)",
    )
    parser.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="on SIGINT/SIGTERM, seconds in-flight requests get to finish",
    )


def _json_object(text: str) -> dict[str, object]:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def _markers(text: str) -> str:
    start, sep, end = text.partition(",")
    if text.strip().lower() != "off" and not (sep and start and end):
        raise argparse.ArgumentTypeError("must be START,END (e.g. '<think>,</think>') or off")
    return text


_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _size(text: str) -> int:
    """``1234``, ``512M``, ``2GB``, ``1.5G`` -> bytes."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = raw[-1:] if raw[-1:] in _SIZE_UNITS and raw[-1:] else ""
    try:
        value = float(raw[: len(raw) - len(unit)] if unit else raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512M, 2G)") from None
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return int(value * _SIZE_UNITS[unit])


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``trio-mlx`` command."""
    parser = _Parser(
        prog="trio-mlx",
        description="An LLM generation engine for MLX with an OpenAI-compatible server.",
        epilog="`trio-mlx serve --help` lists the server's flags and their defaults.",
        formatter_class=_HelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument(
        "--no-fast-blas",
        action="store_true",
        help="on Linux, do not re-run with an optimized BLAS preloaded (also TRIO_MLX_FAST_BLAS=0)",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve = commands.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server", formatter_class=_HelpFormatter
    )
    _add_model_flags(serve)
    _add_serve_flags(serve)
    _add_debug_flag(serve)
    generate = commands.add_parser(
        "generate", help="generate once, streaming to the terminal", formatter_class=_HelpFormatter
    )
    _add_debug_flag(generate)
    generate.add_argument("prompt", help="the prompt (a user message when the model chats)")
    generate.add_argument(
        "--raw", action="store_true", help="send the prompt as text, without the chat template"
    )
    generate.add_argument("--system", default=None, help="a system message")
    _add_model_flags(generate)
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """``parser.parse_args``, with an unknown flag told by the command it was given to."""
    args, extra = parser.parse_known_args(argv)
    if extra:
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        where = commands.choices.get(args.command, parser) if args.command else parser
        where.error(f"unrecognized arguments: {' '.join(extra)}")
    return args


#: Seconds between the interpreter's GIL hand-overs while ``trio-mlx`` runs (default 0.005).
SWITCH_INTERVAL = 0.001


def _add_debug_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--debug",
        "-v",
        action="store_true",
        help="on a start-up failure, print the traceback too (not only what is wrong)",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the process exit status."""
    parser = build_parser()
    args = _parse(parser, argv)  # --help and --version end here, before any import
    if args.command is None:
        parser.print_help()
        return 0
    key = getattr(args, "api_key", None)
    if key is not None and not key.strip():
        # An empty key used to mean no authentication at all: a typo away from an open server.
        parser.error(
            "the API key (--api-key or TRIO_MLX_API_KEY) is set but empty; set a key, or "
            "unset TRIO_MLX_API_KEY and leave --api-key out to serve without authentication"
        )
    if args.command == "generate" and len(args.models) > 1:
        parser.error("generate takes one --model")
    blas_hint = _fast_blas(argv)
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    import trio

    from trio_mlx import distributed
    from trio_mlx_http._server import run as _run
    from trio_mlx_http._server import startup as _startup

    runner = _run.serve if args.command == "serve" else _run.generate
    # The MLX worker thread and the Trio thread (HTTP, streaming) share the GIL.
    # At Python's default 5 ms switch interval the worker waited for it behind
    # the HTTP work. At 64 streams on the H200 one A/B read 4,116 vs 2,322 tok/s
    # for 1 ms, a later run 3,152: within those runs' noise (design/engine.md).
    sys.setswitchinterval(SWITCH_INTERVAL)
    try:
        if args.command == "serve" and distributed.follower_rank() is not None:
            status = distributed.follow(args.model)  # a rank > 0 under mlx.launch
        else:
            status = trio.run(functools.partial(runner, args, blas_hint=blas_hint))
    except KeyboardInterrupt:
        status = 130
    except Exception as error:
        status = _startup.report(error, debug=args.debug)
    if argv is None:
        _exit_now(status)
    return status


def _exit_now(status: int) -> NoReturn:
    """End a real command line without interpreter finalization.

    The engine's MLX thread is joined, but its C++ thread-local destructors run
    after ``Thread.join`` returns and take the GIL; if the interpreter is
    finalizing by then, CPython ends that thread mid-destructor and the C++
    runtime aborts (exit 134 instead of 0, seen in about a third of
    ``serve`` shutdowns). Everything is flushed first; nothing else is pending.
    A rank that gave its distributed group up exits non-zero whatever ``status``.
    """
    from trio_mlx import distributed

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(distributed.exit_status(status))


def _fast_blas(argv: Sequence[str] | None) -> bool:
    """Re-run this command with an optimized BLAS preloaded when one helps (Linux).

    Only for a real command line (``argv`` None): called in-process with explicit
    arguments, re-executing would re-run the host program instead. This runs
    before MLX is imported; the flag may sit before or after the command, so the scan is by hand.
    Returns whether the install hint is due: the command prints it once the
    model has loaded, so that a start-up error is told in its own lines alone.
    """
    if argv is None:
        from trio_mlx_http._fast_blas import maybe_reexec_with_fast_blas

        return maybe_reexec_with_fast_blas(opt_out="--no-fast-blas" in sys.argv[1:], hint=False)
    return False
