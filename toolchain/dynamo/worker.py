"""`python -m toolchain.dynamo.worker MODEL --config FILE`: the CPU engine as a Dynamo worker.

Takes what `python3 -m dynamo.trtllm` takes on a GPU host, the checkpoint and the LLM-API YAML
(trtllm-serve.yaml), and loads the CPU engine those LLM() arguments ask for (toolchain.llmapi.cpu_llm, the
same stand-in the OpenAI server runs). It then registers with Dynamo's runtime as dynamo.trtllm does
(dynamo/trtllm/workers/llm_worker.py): `register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions,
...)` with the engine's block size and capacity, and `serve_endpoint` on `<namespace>.backend.generate`. The
frontend tokenizes and applies the chat template; the worker gets token ids with Dynamo's stop conditions and
sampling options, and streams token ids back with the finish reason and usage, as the trtllm worker's handler
does (dynamo/trtllm/request_handlers/handler_base.py).

KV-block events: the engine's block registrations go to Dynamo's KvEventPublisher (kv_events.py), so the
frontend's KV router routes by what this worker's cache really holds.

The planes come from the environment the launcher sets (DYN_DISCOVERY_BACKEND, DYN_REQUEST_PLANE,
DYN_EVENT_PLANE and the DYN_*_HOST addresses). GET /engine/stats on the worker's system port (DYN_SYSTEM_PORT)
returns what it served: requests, prompt and cached tokens, blocks reused, KV events published.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from toolchain.errors import ToolchainError
from toolchain.dynamo.kv_events import KvEventRelay
from toolchain.llmapi.cpu_llm import LlmArgsError, load_engine
import yaml

log = logging.getLogger("toolchain.dynamo.worker")
COMPONENT = "backend"  # dynamo.trtllm's default component for aggregated workers (args.py DEFAULT_ENDPOINT_COMPONENT)
ENDPOINT = "generate"  # and its endpoint name (DEFAULT_ENDPOINT_NAME)


def _args(argv):
    p = argparse.ArgumentParser(prog="python -m toolchain.dynamo.worker", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="Hugging Face checkpoint directory (LLM() `model`)")
    p.add_argument("--config", type=Path, required=True, help="YAML of LLM() arguments (trtllm-serve.yaml)")
    p.add_argument("--served-model-name", required=True)
    p.add_argument("--namespace", default="dynamo")
    p.add_argument("--engine-threads", type=int, default=1, help="torch threads of the engine (0: every core)")
    p.add_argument("--work-dir", type=Path, help="where the checkpoint is converted and sharded (shared: reused)")
    p.add_argument("--kv-events", action=argparse.BooleanOptionalAction, default=True,
                   help="publish KV-block events to the router")
    p.add_argument("--log-level", default="info", choices=("error", "warning", "info", "debug"))
    return p.parse_args(argv)


class Handler:
    """One request at a time from Dynamo's request plane onto the engine's inflight batcher."""

    def __init__(self, service, engine, relay=None):
        self.service, self.engine, self.relay = service, engine, relay
        self.tpb = engine.kv.tokens_per_block
        self._lock = threading.Lock()
        self.counts = {"requests": 0, "finished": 0, "cancelled": 0, "refused": 0, "prompt_tokens": 0,
                       "cached_tokens": 0, "completion_tokens": 0, "reused_blocks": 0, "context_blocks": 0}

    def _count(self, **delta: int) -> None:
        with self._lock:
            for key, value in delta.items():
                self.counts[key] += value

    def params(self, request: dict, prompt_len: int):
        from toolchain.engine.cpu import SamplingParams

        stop = request.get("stop_conditions") or {}
        samp = request.get("sampling_options") or {}
        eos = [int(t) for t in request.get("eos_token_ids") or ()]
        ignore_eos = bool(stop.get("ignore_eos"))
        end_id = -1 if ignore_eos or not eos else eos[0]
        # Hidden stop ids are the model's end tokens the frontend adds; visible ones are the client's.
        stop_ids = {int(t) for key in ("stop_token_ids_hidden", "stop_token_ids") for t in stop.get(key) or ()}
        stop_ids |= set(eos[1:])
        if ignore_eos:
            stop_ids -= set(eos) | {int(t) for t in stop.get("stop_token_ids_hidden") or ()}
        stop_ids.discard(end_id)
        max_tokens = stop.get("max_tokens") or max(self.engine.limits.max_seq_len - prompt_len, 1)
        temperature = samp.get("temperature")
        return SamplingParams(max_new_tokens=int(max_tokens),
                              temperature=1.0 if temperature is None else float(temperature),
                              top_k=max(int(samp.get("top_k") or 0), 0), top_p=float(samp.get("top_p") or 0.0),
                              seed=samp.get("seed"), end_id=end_id, min_tokens=int(stop.get("min_tokens") or 0),
                              stop_words=[[t] for t in sorted(stop_ids)])

    async def generate(self, request: dict, context: Any = None):
        from toolchain.engine.cpu import QueueFull

        ids = [int(t) for t in request.get("token_ids") or ()]
        self._count(requests=1)
        gen = None
        try:
            params = self.params(request, len(ids))
            problem = self.engine.request_problem(ids, params)
            gen = None if problem else self.service.submit(ids, params)
        except (QueueFull, ValueError, TypeError, RuntimeError) as err:
            problem = str(err)
        if problem or gen is None:
            self._count(refused=1)
            # The trtllm handler's shape for a request the engine refuses: the frontend answers with the error.
            yield {"finish_reason": {"error": problem}, "token_ids": []}
            return
        try:
            async for tokens, finished in gen.events():
                out: dict[str, Any] = {"token_ids": tokens}
                if finished:
                    out.update(self._final(gen, len(ids)))
                yield out
                if context is not None and not finished and context.is_stopped():
                    self._count(cancelled=1)
                    yield {"token_ids": [], "finish_reason": "cancelled"}
                    return
        except RuntimeError as err:  # the engine failed this request
            yield {"finish_reason": {"error": str(err)}, "token_ids": []}
        finally:
            self.service.release(gen)  # cancels it in the batcher if the client went away

    def _final(self, gen, prompt_len: int) -> dict:
        st = gen.stats
        cached = min(st.kv_cache_reused_blocks * self.tpb, prompt_len)
        self._count(finished=1, prompt_tokens=prompt_len, cached_tokens=cached, completion_tokens=len(gen.output),
                    reused_blocks=st.kv_cache_reused_blocks,
                    context_blocks=st.kv_cache_reused_blocks + st.kv_cache_alloc_total_blocks)
        return {"finish_reason": gen.finish_reason([]),
                "completion_usage": {"prompt_tokens": prompt_len, "completion_tokens": len(gen.output),
                                     "total_tokens": prompt_len + len(gen.output),
                                     "prompt_tokens_details": {"cached_tokens": cached}}}

    async def stats(self, body: dict) -> dict:
        with self._lock:
            out: dict[str, Any] = dict(self.counts)
        if self.relay is not None:
            out.update(kv_stored_events=self.relay.stored_blocks, kv_removed_events=self.relay.removed_blocks)
        kv = self.engine.kv
        out.update(pid=os.getpid(), tokens_per_block=self.tpb, total_kv_blocks=kv.num_blocks,
                   used_kv_blocks=kv.used_blocks)
        return out


async def serve(args) -> int:
    from dynamo.llm import KvEventPublisher, ModelInput, ModelRuntimeConfig, ModelType, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    from toolchain.openai.service import EngineService

    try:
        data = yaml.safe_load(args.config.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ToolchainError(f"cannot read --config {args.config}: {err}") from None
    work = None if args.work_dir else tempfile.TemporaryDirectory(prefix="dynamo-worker-")
    work_dir = args.work_dir or Path(work.name if work else ".")
    try:
        engine, scheduler, spec = load_engine({**data, "model": str(args.model)}, work_dir, args.engine_threads)
    except LlmArgsError as err:
        raise ToolchainError(str(err)) from None
    service = EngineService(engine, scheduler)
    loop = asyncio.get_running_loop()
    env = os.environ.get
    runtime = DistributedRuntime(loop, env("DYN_DISCOVERY_BACKEND", "file"), env("DYN_REQUEST_PLANE", "tcp"),
                                 event_plane=env("DYN_EVENT_PLANE", "zmq"))
    endpoint = runtime.endpoint(f"{args.namespace}.{COMPONENT}.{ENDPOINT}")
    tpb = engine.kv.tokens_per_block
    publisher = relay = None
    if args.kv_events:
        publisher = KvEventPublisher(endpoint, kv_block_size=tpb)
        relay = KvEventRelay(publisher, tpb)
        engine.kv.events = relay
    handler = Handler(service, engine, relay)
    service.start()
    stopping = asyncio.Event()

    def _stop() -> None:
        if not stopping.is_set():
            stopping.set()
            runtime.shutdown()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _stop)
    try:
        rc = ModelRuntimeConfig()
        lim = engine.limits
        rc.context_length, rc.total_kv_blocks = lim.max_seq_len, engine.kv.num_blocks
        rc.max_num_seqs, rc.max_num_batched_tokens = lim.max_batch_size, lim.max_num_tokens
        rc.kv_event_publishing_enabled = bool(args.kv_events)
        await register_model(ModelInput.Tokens, ModelType.Chat | ModelType.Completions, endpoint,
                             str(spec.model.tokenizer_dir), args.served_model_name,
                             worker_type=WorkerType.Aggregated, kv_cache_block_size=tpb, runtime_config=rc)
        runtime.register_engine_route("stats", handler.stats)
        log.info("serving %s as %s.%s.%s (block size %d, %d blocks, KV events %s)", args.served_model_name,
                 args.namespace, COMPONENT, ENDPOINT, tpb, engine.kv.num_blocks, "on" if relay else "off")
        await endpoint.serve_endpoint(handler.generate, graceful_shutdown=False)
    finally:
        engine.kv.events = None
        service.stop()
        if publisher is not None:
            publisher.shutdown()
        if work is not None:
            work.cleanup()
    return 0


def main(argv=None) -> int:
    import uvloop

    args = _args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return uvloop.run(serve(args))
    except ToolchainError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
