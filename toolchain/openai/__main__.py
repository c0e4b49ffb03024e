"""`python -m toolchain.openai`: serve an engine directory over the OpenAI API with uvicorn.

The scheduler and KV-cache options are the Triton CPU model's parameters under
their trtllm-serve-style names; --max-batch-size and --max-num-tokens may only
lower what the engine was built with (the runtime limits of the executor).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.stopsignals import Stopped, stop_on_signals
from toolchain.llmapi.cpu_llm import LlmArgsError, load_engine, shared_engine_dir
from toolchain.openai.tools import parsers_problem
import yaml


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m toolchain.openai", description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", type=Path,
                   help="LLM-API path, as trtllm-serve takes it: a Hugging Face checkpoint directory (with --config)")
    p.add_argument("--config", type=Path, help="YAML of LLM() arguments (what trtllm-serve takes as --extra_llm_api_options), with MODEL")
    p.add_argument("--engine-dir", type=Path, help="engine path: engine directory (config.json + rank files)")
    p.add_argument("--tokenizer", type=Path, help="Hugging Face tokenizer directory (with --engine-dir)")
    p.add_argument("--served-model-name", required=True, help="the model name clients send and /v1/models lists")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--chat-template", type=Path, help="a Jinja chat template file replacing the tokenizer's")
    p.add_argument("--max-batch-size", type=int, help="runtime batch limit (at most the engine's)")
    p.add_argument("--max-num-tokens", type=int, help="runtime tokens-per-step limit (at most the engine's)")
    p.add_argument("--batch-scheduler-policy", default="guaranteed_no_evict",
                   choices=("guaranteed_no_evict", "max_utilization"))
    p.add_argument("--enable-chunked-context", action="store_true")
    p.add_argument("--max-queue-size", type=int, default=0, help="requests waiting for admission; 0 = unbounded")
    p.add_argument("--kv-cache-free-gpu-mem-fraction", type=float, help="share of free host memory for the KV pool")
    p.add_argument("--max-tokens-in-paged-kv-cache", type=int, help="cap on the KV pool in tokens")
    p.add_argument("--disable-kv-cache-reuse", action="store_true")
    p.add_argument("--engine-threads", type=int, help="torch intra-op threads (0 = every core)")
    p.add_argument("--guided-decoding-backend", choices=("xgrammar",),
                   help="engine path: serve response_format with XGrammar (off: refused, as trtllm-serve refuses it "
                        "without guided_decoding_backend); the LLM-API path takes guided_decoding_backend from --config")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="engine path: let the tokenizer directory's own Python code run (off: such a tokenizer is "
                        "refused); the LLM-API path takes trust_remote_code from --config")
    # trtllm-serve's own option names (tensorrt_llm/commands/serve.py), so a launch line reads the same for both.
    p.add_argument("--tool_parser", help="parse tool calls out of chat answers in this format (trtllm-serve's names; "
                                         "implemented: qwen3, deepseekv3)")
    p.add_argument("--reasoning_parser", help="split reasoning into reasoning_content: deepseek-r1 or qwen3")
    p.add_argument("--lora-adapter", action="append", default=[], metavar="NAME=DIR",
                   help="serve the PEFT adapter in DIR as model NAME (repeatable; task ids 1, 2, ... in order); the "
                        "engine must carry LoRA (LLM-API path: lora_config in --config)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    return p.parse_args(argv)


def _limits(engine, args) -> None:
    """Apply runtime limits no larger than the built ones."""
    changes = {}
    for flag, key in (("max_batch_size", "max_batch_size"), ("max_num_tokens", "max_num_tokens")):
        value = getattr(args, flag)
        if value is None:
            continue
        built = getattr(engine.limits, key)
        if not 1 <= value <= built:
            raise ToolchainError(f"--{flag.replace('_', '-')} {value} must be between 1 and the engine's {key} {built}",
                                 "rebuild the engine for a larger limit")
        changes[key] = value
    if changes:
        engine.limits = dataclasses.replace(engine.limits, **changes)


def _parsers(args) -> dict:
    """--tool_parser / --reasoning_parser, refused here by name before any engine loads."""
    problem = parsers_problem(args.tool_parser, args.reasoning_parser, None)
    if problem:
        raise ToolchainError(problem)
    return {"tool_parser": args.tool_parser, "reasoning_parser": args.reasoning_parser}


def _adapters(args) -> dict[str, Path]:
    """--lora-adapter NAME=DIR, in the order given (the order fixes each adapter's lora_int_id)."""
    out: dict[str, Path] = {}
    for item in args.lora_adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path or name in out:
            raise ToolchainError(f"--lora-adapter {item!r} must be NAME=DIR with a name not given before",
                                 "e.g. --lora-adapter sql=/adapters/sql")
        out[name] = Path(path)
    return out


def _llm_app(args, parsers):
    """MODEL --config FILE: the CPU engine LLM() would run for those arguments (toolchain.llmapi)."""
    import tempfile

    from toolchain.openai.app import create_app

    try:
        data = yaml.safe_load(args.config.read_text()) if args.config else {}
    except (OSError, yaml.YAMLError) as err:
        raise ToolchainError(f"cannot read --config {args.config}: {err}") from None
    if not isinstance(data, dict):
        raise ToolchainError(f"--config {args.config} must hold a mapping of LLM() arguments")
    shared = shared_engine_dir()  # the deployment's, prepared by convert: loaded, never removed here
    work = None if shared else tempfile.TemporaryDirectory(prefix="openai-cpu-llm-")
    try:
        where = shared if work is None else Path(work.name)
        engine, scheduler, spec = load_engine({**data, "model": str(args.model)}, where, args.engine_threads)
    except LlmArgsError as err:
        if work is not None:
            work.cleanup()
        raise ToolchainError(str(err)) from None
    template = args.chat_template.read_text() if args.chat_template else None
    try:
        app = create_app(engine, spec.model.tokenizer_dir, args.served_model_name, scheduler=scheduler,
                         chat_template=template, trust_remote_code=spec.model.trust_remote_code,
                         guided_decoding_backend=spec.serving.guided_decoding_backend,
                         lora_adapters=_adapters(args), **parsers)
    except ToolchainError:
        if work is not None:
            work.cleanup()
        raise
    app.state.work_dir = work  # the engine's rank files live as long as the app
    return app


def build_app(args):
    from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SchedulerConfig
    from toolchain.openai.app import create_app

    if (args.model is None) == (args.engine_dir is None):
        raise ToolchainError("give either MODEL (with --config) or --engine-dir (with --tokenizer)",
                             "MODEL --config FILE serves the LLM-API path; --engine-dir serves a built engine")
    parsers = _parsers(args)
    if args.model is not None:
        if args.guided_decoding_backend is not None:
            raise ToolchainError("--guided-decoding-backend is an engine-path option (with --engine-dir)",
                                 "with MODEL, set guided_decoding_backend: xgrammar in the --config file")
        return _llm_app(args, parsers)
    if args.tokenizer is None:
        raise ToolchainError("--engine-dir needs --tokenizer", "pass the Hugging Face tokenizer directory")
    if not (args.engine_dir / "config.json").is_file():
        raise ToolchainError(f"no engine at {args.engine_dir} (config.json missing)", "run `toolchain build-engine`")
    kv = KvCacheConfig(max_tokens=args.max_tokens_in_paged_kv_cache, enable_block_reuse=not args.disable_kv_cache_reuse,
                       **({} if args.kv_cache_free_gpu_mem_fraction is None
                          else {"free_memory_fraction": args.kv_cache_free_gpu_mem_fraction}))
    scheduler = SchedulerConfig(policy=args.batch_scheduler_policy, enable_chunked_context=args.enable_chunked_context,
                                max_queue_size=args.max_queue_size)
    for problem in (kv.problem(), scheduler.problem()):
        if problem:
            raise ToolchainError(problem)
    template = args.chat_template.read_text() if args.chat_template else None
    adapters = _adapters(args)
    engine = CpuEngine.load(args.engine_dir, num_threads=args.engine_threads, kv_cache=kv)
    _limits(engine, args)
    return create_app(engine, args.tokenizer, args.served_model_name, scheduler=scheduler, chat_template=template,
                      trust_remote_code=args.trust_remote_code, guided_decoding_backend=args.guided_decoding_backend,
                      lora_adapters=adapters, **parsers)


def main(argv=None) -> int:
    import uvicorn

    args = _args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        with stop_on_signals():  # loading: a stop signal ends it here (the work directory goes at exit)
            app = build_app(args)
    except (ToolchainError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Stopped as err:
        return err.exit_code
    # timeout_keep_alive 5 s as trtllm-serve sets it.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                           timeout_keep_alive=5))
    work = getattr(app.state, "work_dir", None)
    try:
        # uvicorn shuts down gracefully on SIGINT and SIGTERM, then re-raises the signal, which would end the
        # process before the engine's work directory is removed; SIGHUP it does not handle at all.
        with stop_on_signals(on_signal=lambda signum: server.handle_exit(signum, None)):
            server.run()
    except Stopped as err:
        return err.exit_code
    finally:
        if work is not None:
            work.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
