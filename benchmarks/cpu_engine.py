"""The CPU engine as a serving engine, side by side with Hugging Face transformers.

Everything runs in this one process on a generated Llama (random weights, made
here, never committed), fp32 everywhere, the same torch threads for every
contender, greedy decoding with fixed output lengths:

(a) output tokens/s of 16 requests at 1, 4 and 16 concurrent streams through the
    inflight batcher, against HF `generate` one request at a time, HF `generate`
    on one static batch of 16, and transformers' own continuous batching
    (`generate_batch`); greedy agreement with HF is reported too;
(b) TTFT of short user turns after a shared 512-token system prompt, KV-cache
    block reuse on vs off;
(c) decode tokens/s at batch 1 and 16 for int4 (W4A16_AWQ layout) and int8
    weight-only engines against fp32;
(d) KV bytes per token and pool capacity: what the planner states for the spec
    against what the engine allocates (resident memory after touching the pool);
(e) inter-token latency p99 of running decodes while two 2048-token prompts
    arrive, chunked context on vs off (same compute per token);
(f) how many 512-token requests run at once in a fixed KV budget: paged blocks
    (shared system prompt stored once) vs a contiguous reservation of prompt +
    max_tokens per request (guaranteed_no_evict without reuse); also without a
    shared prefix (max_utilization vs the same reservation);
(g) a decode step (`CpuEngine.step` over b decoding requests) against its own GEMM
    floor: every weight of the engine (fused QKV, output projection, gate and up,
    down, LM head) through the kernel the engine runs it with, bare, at b rows in
    the layout the step hands it (columns for a float32 output projection, MLP and
    LM head), timed interleaved with the steps in the same process; for fp32, int8
    and int4 weight-only at b = 1 and 16.

    python benchmarks/cpu_engine.py [--json PATH] [--quick] [--only a,b,...]

`--quick` shrinks the model and the token counts (a smoke run, not figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from functools import partial
from pathlib import Path

# transformers' continuous batching runs its model in a thread of its own; with OpenMP's default
# spin-waiting, two thread teams on a 2-core host make steps 50-100x slower at random. Every
# contender runs under the same setting.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import print_and_write  # noqa: E402
from toolchain.engine.cpu import (CpuEngine, InflightBatcher, KvCacheConfig, RequestStats,  # noqa: E402
                                  SamplingParams, SchedulerConfig)
from toolchain.engine.cpu.linear import as_columns, gemm_columns, on_columns  # noqa: E402

THREADS = 2
TPB = 32  # tokens_per_block, TensorRT-LLM 1.2's default

SIZES = {  # ~124M parameters: large enough that the matmuls, not Python, set the pace
    "base": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, vocab_size=32000),
    "small": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=4096),
}


# -- models and engines -------------------------------------------------------------

def make_model(out: Path, size: str, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(out, safe_serialization=True)
    return out


def params_of(hf_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        for name in f.keys():
            count = 1
            for dim in f.get_slice(name).get_shape():
                count *= dim
            total += count
    return total


def build_engine(hf_dir: Path, out: Path, *, method: str = "none", **limits) -> Path:
    """Convert and lay out an engine directory as `toolchain build-engine` does for target cpu."""
    from toolchain.checkpoint.convert import convert_checkpoint
    from toolchain.engine.build import write_cpu_engine
    from toolchain.quant.view import Quantization

    ckpt, eng = out / "checkpoint", out / "engine"
    ckpt.mkdir(parents=True)
    eng.mkdir()
    recipe = Quantization(method=method, search=False) if method != "none" else None
    calibration = None
    if recipe is not None and recipe.needs_calibration:
        g = torch.Generator().manual_seed(1)
        calibration = [torch.randint(3, 1000, (64,), generator=g) for _ in range(4)]
    convert_checkpoint(hf_dir, ckpt, tp=1, pp=1, dtype="float32", target="cpu", quantization=recipe,
                                    calibration=calibration)
    build = {"max_batch_size": 32, "max_input_len": 2048, "max_seq_len": 2304, "max_num_tokens": 4096,
             "max_beam_width": 1, "kv_cache_type": "PAGED",
             "plugin_config": {"paged_kv_cache": True, "use_paged_context_fmha": True, "tokens_per_block": TPB},
             **limits}
    write_cpu_engine(ckpt, eng, build)
    return eng


def load(eng: Path, *, reuse: bool = False, max_tokens: int | None = 65536) -> CpuEngine:
    return CpuEngine.load(eng, num_threads=THREADS,
                          kv_cache=KvCacheConfig(tokens_per_block=TPB, max_tokens=max_tokens, enable_block_reuse=reuse))


def prompts_of(n: int, length: int, seed: int, vocab: int = 4000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(n)]


class Run:
    """Requests through an InflightBatcher with a client-side concurrency cap; records token times."""

    def __init__(self, engine: CpuEngine, scheduler: SchedulerConfig | None = None):
        self.batcher = InflightBatcher(engine, scheduler)
        self.lock = threading.Lock()
        self.times: dict[object, list[float]] = {}
        self.tokens: dict[object, list[int]] = {}
        self.sent: dict[object, float] = {}
        self.stats: dict[object, RequestStats] = {}

    def _callback(self, rid, done: threading.Semaphore):
        def cb(tokens, finished, error):
            now = time.perf_counter()
            if error:
                raise RuntimeError(f"request {rid}: {error}")
            with self.lock:
                self.tokens[rid].extend(tokens)
                self.times[rid].extend([now] * len(tokens))
            if finished:
                done.release()
        return cb

    def submit(self, rid, prompt, params, done):
        self.tokens[rid], self.times[rid], self.stats[rid] = [], [], RequestStats()
        self.sent[rid] = time.perf_counter()
        self.batcher.submit(rid, prompt, params, self._callback(rid, done), stats=self.stats[rid])

    def run(self, requests: list[tuple[list[int], SamplingParams]], concurrency: int) -> float:
        """Run all requests, at most `concurrency` in flight; returns wall seconds."""
        slots = threading.Semaphore(0)
        start = time.perf_counter()
        with self.batcher:
            for i, (prompt, params) in enumerate(requests):
                if i >= concurrency:
                    slots.acquire()
                self.submit(i, prompt, params, slots)
            for _ in range(min(concurrency, len(requests))):
                slots.acquire()
        return time.perf_counter() - start


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n)


# -- (a) throughput -------------------------------------------------------------------

def bench_throughput(hf_dir: Path, eng: Path, quick: bool) -> dict:
    """One stream and 4 against HF one at a time; 16 streams against HF's static batch and
    transformers' continuous batching in interleaved rounds (best of 3 each), so drift in a
    shared host's speed hits every contender alike."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    n_req, plen, new = (8, 16, 8) if quick else (16, 32, 48)
    prompts = prompts_of(n_req, plen, seed=2)
    engine = load(eng)
    engine.generate(prompts[0][:4], greedy(2))  # warm-up
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    cfg = GenerationConfig(do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                           pad_token_id=0)
    out: dict = {"requests": n_req, "prompt_tokens": plen, "output_tokens": new}
    total = n_req * new

    def engine_round(concurrency):
        run = Run(engine)
        wall = run.run([(p, greedy(new)) for p in prompts], concurrency)
        return wall, [run.tokens[i] for i in range(n_req)]

    with torch.no_grad():
        hf.generate(torch.tensor([prompts[0][:4]]), generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=2, eos_token_id=None, pad_token_id=0))
        start = time.perf_counter()
        hf_tokens = [hf.generate(torch.tensor([p]), generation_config=cfg)[0, plen:].tolist() for p in prompts]
        out["hf_sequential_tok_s"] = round(total / (time.perf_counter() - start), 2)
        for c in (1, 4):
            out[f"engine_{c}_streams_tok_s"] = round(total / engine_round(c)[0], 2)
        cb = ContinuousBatching(hf, prompts, new)
        walls: dict[str, list[float]] = {"engine": [], "static": [], "cb": []}
        try:
            cb.round()  # warm-up
            for _ in range(3):
                wall, got = engine_round(16)
                walls["engine"].append(wall)
                start = time.perf_counter()
                hf.generate(torch.tensor(prompts), generation_config=cfg)
                walls["static"].append(time.perf_counter() - start)
                if cb.error is None:
                    walls["cb"].append(cb.round())
        finally:
            cb.stop()
    out["engine_16_streams_tok_s"] = round(total / min(walls["engine"]), 2)
    out["hf_static_batch_16_tok_s"] = round(total / min(walls["static"]), 2)
    out["hf_continuous_batching_tok_s"] = round(total / min(walls["cb"]), 2) if walls["cb"] else None
    if cb.error is not None:
        out["hf_continuous_batching_error"] = cb.error
    else:
        out["transformers_cb_matches_hf_sequential"] = cb.tokens == hf_tokens
    out["rounds_s"] = {k: [round(w, 2) for w in v] for k, v in walls.items()}
    agree = sum(a == b for g, h in zip(got, hf_tokens, strict=False) for a, b in zip(g, h, strict=False))
    out["greedy_token_agreement_with_hf"] = round(agree / total, 4)
    out["speedup_16_streams_vs_hf_sequential"] = round(out["engine_16_streams_tok_s"] / out["hf_sequential_tok_s"], 2)
    out["speedup_16_streams_vs_hf_static_batch"] = round(
        out["engine_16_streams_tok_s"] / out["hf_static_batch_16_tok_s"], 2)
    cb_rate = out["hf_continuous_batching_tok_s"]
    out["ratio_16_streams_vs_transformers_cb"] = round(out["engine_16_streams_tok_s"] / cb_rate, 2) if cb_rate else None
    return out


class ContinuousBatching:
    """transformers' continuous batching manager, started once; a round adds every request at
    once and waits for the last result (its thread start and stop are not timed). Prefix sharing
    is off: the requests share nothing, and a repeated round must not be served from cache."""

    def __init__(self, hf, prompts, new: int):
        self.prompts, self.new, self.tokens, self.error, self.manager = prompts, new, None, None, None
        try:
            from transformers import GenerationConfig
            from transformers.generation.configuration_utils import ContinuousBatchingConfig

            gen = GenerationConfig(do_sample=False, max_new_tokens=new, eos_token_id=-1, pad_token_id=0)
            # Sized explicitly: by default it budgets 0.6 x host RAM and an attention mask to match.
            cb = ContinuousBatchingConfig(page_size=TPB, num_blocks=4 * len(prompts),
                                          max_requests_per_batch=len(prompts),
                                          max_batch_tokens=max(1024, sum(len(p) for p in prompts)),
                                          allow_block_sharing=False, auto_switch_to_flash=False,
                                          use_cuda_graph=False, use_async_batching=False)
            self.manager = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
            self.manager.start()
        except Exception as err:  # the API moves between transformers releases
            self.error = f"{type(err).__name__}: {err}"[:300]

    def round(self) -> float:
        start = time.perf_counter()
        ids = self.manager.add_requests(inputs=self.prompts, max_new_tokens=self.new)
        results = {}
        while len(results) < len(ids):
            res = self.manager.get_result(timeout=1)
            if res is None:
                if not self.manager.is_running():
                    raise RuntimeError("the continuous batching thread died")
                continue
            if res.is_finished():
                results[res.request_id] = res
        wall = time.perf_counter() - start
        self.tokens = [list(results[i].generated_tokens) for i in ids]
        return wall

    def stop(self) -> None:
        if self.manager is not None:
            self.manager.stop(block=True, timeout=10)
            self.manager.destroy()


# -- (b) prefix reuse -----------------------------------------------------------------

def bench_reuse(eng: Path, quick: bool) -> dict:
    system = prompts_of(1, 128 if quick else 512, seed=3)[0]
    turns = [system + u for u in prompts_of(5, 16, seed=4)]
    out = {"system_prompt_tokens": len(system), "user_turn_tokens": 16}
    for reuse in (False, True):
        engine = load(eng, reuse=reuse)
        run = Run(engine)
        ttft = []
        with run.batcher:
            for i, p in enumerate(turns):  # one after another: each turn finds the blocks of the ones before
                done = threading.Semaphore(0)
                run.submit(i, p, greedy(4), done)
                done.acquire()
                ttft.append(run.times[i][0] - run.sent[i])
        key = "on" if reuse else "off"
        out[f"ttft_ms_reuse_{key}"] = round(statistics.mean(ttft[1:]) * 1000, 1)  # the first turn is cold in both
        out[f"reused_blocks_reuse_{key}"] = [run.stats[i].kv_cache_reused_blocks for i in range(len(turns))]
    out["ttft_ratio_reuse_on_vs_off"] = round(out["ttft_ms_reuse_on"] / out["ttft_ms_reuse_off"], 3)
    return out


# -- (c) quantized decode ---------------------------------------------------------------

def decode_rate(engine: CpuEngine, batch: int, new: int) -> float:
    """Tokens/s of the decode phase: tokens after each request's first, over the time from the
    last first token to the end."""
    prompts = prompts_of(batch, 16, seed=5)
    run = Run(engine)
    run.run([(p, greedy(new)) for p in prompts], batch)
    first = max(t[0] for t in run.times.values())
    last = max(t[-1] for t in run.times.values())
    after = sum(1 for t in run.times.values() for x in t if x > first)
    return after / (last - first)


QUANT_METHODS = {"int8": "int8_wo", "int4": "awq"}


def quantized_engines(hf_dir: Path, root: Path, fp_engine: Path) -> dict[str, Path]:
    """fp32, int8 and int4 engine directories, each quantized one built once per run."""
    engines = {"fp32": fp_engine}
    for name, method in QUANT_METHODS.items():
        out = root / name
        engines[name] = out / "engine" if out.exists() else build_engine(hf_dir, out, method=method)
    return engines


def bench_quantized(hf_dir: Path, root: Path, fp_engine: Path, quick: bool) -> dict:
    """Decode tokens/s of fp32, int8 and int4 at 1 and 16 requests. The three engines stay loaded and take turns,
    `rounds` times: each speedup is the median of the rounds' own ratios, so the host's speed drifting between one
    engine's run and the next (a fifth within minutes here) does not land in one format's figure."""
    new, rounds = (16, 1) if quick else (48, 5)
    engines = {name: load(eng) for name, eng in quantized_engines(hf_dir, root, fp_engine).items()}
    for engine in engines.values():
        engine.generate([5, 6, 7], greedy(2))
    rates: dict[tuple[str, int], list[float]] = {}
    for _ in range(rounds):
        for name, engine in engines.items():
            for b in (1, 16):
                rates.setdefault((name, b), []).append(decode_rate(engine, b, new))
    del engines
    out: dict = {"rounds": rounds}
    out.update({f"{n}_decode_tok_s_b{b}": round(statistics.median(r), 2) for (n, b), r in rates.items()})
    for q in ("int4", "int8"):
        for b in (1, 16):
            ratios = [x / y for x, y in zip(rates[(q, b)], rates[("fp32", b)], strict=True)]
            out[f"{q}_decode_speedup_vs_fp32_b{b}"] = round(statistics.median(ratios), 2)
    out["int4_layout"] = "W4A16_AWQ (group 128; round-to-nearest scales: the decode kernel is the same for any)"
    return out


# -- (g) the decode step against its GEMM floor --------------------------------------------

def floor_kernels(engine: CpuEngine, rows: int) -> list[tuple]:
    """Every weight matmul a decode step of `rows` runs, in order, as (kernel, input) with the input in the layout
    the step hands it: per layer QKV, output projection, gate and up (one fused fc where the engine holds one), down;
    then the LM head. A float32 output projection, MLP and LM head run on columns (linear.columns, on the step's own
    conditions), the rest through their module's kernel on rows."""
    out: list[tuple] = []
    one_shard = [len(shards) for shards in engine.model.stages] == [1] and engine.model.comm is None
    for shards in engine.model.stages:
        for shard in shards:
            for layer in shard.layers:
                if layer.qkv is not None:
                    out.append((layer.qkv.kernel, layer.qkv.kernel_input(rows)))
                if layer.dense is not None:
                    out.append((partial(layer.dense.columns, add_bias=False),
                                as_columns(torch.randn(rows, layer.dense.in_features))) if on_columns(rows, layer.dense)
                               else (layer.dense.kernel, layer.dense.kernel_input(rows)))
                mlp = [m for m in (layer.fc, layer.gate, layer.proj) if m is not None]
                if layer.gate is None or not on_columns(rows, *mlp):
                    out += [(m.kernel, m.kernel_input(rows)) for m in mlp]
                    continue
                cols = as_columns(torch.randn(rows, layer.fc.in_features))
                inner = gemm_columns(torch.randn(layer.proj.in_features, cols.shape[1]))
                out += [(partial(m.columns, add_bias=False), cols) for m in (layer.fc, layer.gate)]
                out.append((partial(layer.proj.columns, add_bias=False), inner))
            head = shard.lm_head
            if head is not None:
                columns = one_shard and on_columns(rows, head)
                out.append((partial(head.columns, add_bias=False), as_columns(torch.randn(rows, head.in_features))) if columns
                           else (head.kernel, head.kernel_input(rows)))
    return out


def step_vs_floor(engine: CpuEngine, batch: int, rounds: int) -> dict:
    """Median step and floor times of `rounds` interleaved pairs, and the median of their ratios.
    The step is `engine.step` over `batch` requests decoding one token each (16-token prompts,
    contexts run first); the floor is the same weights' bare kernels at `batch` rows."""
    kernels = floor_kernels(engine, batch)
    seqs = [engine.start(p, greedy(rounds + 8)) for p in prompts_of(batch, 16, seed=11)]
    for seq in seqs:
        engine.add(seq)
    try:
        engine.step([(s, s.pending) for s in seqs])
        steps, floors = [], []
        with torch.no_grad():
            for i in range(rounds + 2):
                start = time.perf_counter()
                engine.step([(s, 1) for s in seqs])
                mid = time.perf_counter()
                for kernel, x in kernels:
                    kernel(x)
                end = time.perf_counter()
                if i >= 2:  # warm-up
                    steps.append(mid - start)
                    floors.append(end - mid)
    finally:
        for seq in seqs:
            engine.release(seq)
    return {"step_ms": round(statistics.median(steps) * 1000, 2), "floor_ms": round(statistics.median(floors) * 1000, 2),
            "ratio": round(statistics.median(s / f for s, f in zip(steps, floors, strict=True)), 3)}


def bench_floor(hf_dir: Path, root: Path, fp_engine: Path, quick: bool) -> dict:
    rounds = 8 if quick else 40
    out: dict = {"rounds": rounds, "what": "CpuEngine.step (b decoding requests) / the bare kernels of its weights"}
    for name, eng in quantized_engines(hf_dir, root, fp_engine).items():
        engine = load(eng)
        for b in (1, 16):
            got = step_vs_floor(engine, b, rounds)
            prefix = "" if name == "fp32" else f"{name}_"
            out[f"{prefix}decode_step_vs_gemm_floor_b{b}"] = got["ratio"]
            out[f"{name}_b{b}_ms"] = {"step": got["step_ms"], "floor": got["floor_ms"]}
        del engine
    return out


# -- (d) planner vs engine -------------------------------------------------------------

def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_kv_accounting(hf_dir: Path, eng: Path, root: Path) -> dict:
    import yaml

    from toolchain.checks.preflight import build_context
    from toolchain.spec import load_spec

    max_tokens = 16384
    spec_path = root / "plan.yaml"
    spec_path.write_text(yaml.safe_dump({
        "name": "bench", "target": "cpu", "model": {"checkpoint": str(hf_dir), "dtype": "float32"},
        "limits": {"max_batch_size": 32, "max_input_len": 2048, "max_seq_len": 2304, "max_num_tokens": 4096},
        "build": {"tokens_per_block": TPB}, "serving": {"max_tokens_in_paged_kv_cache": max_tokens}}))
    memory = build_context(load_spec(spec_path), "plan").memory
    rank = memory.ranks[0]
    engine = load(eng, max_tokens=max_tokens)
    kv = engine.kv
    before = rss_bytes()
    kv.k.fill_(0)  # touch every page of the pool: torch.empty commits memory only when written
    kv.v.fill_(0)
    measured = (rss_bytes() - before) / kv.capacity_tokens
    return {"planned_kv_bytes_per_token": rank.kv_bytes_per_token,
            "measured_kv_bytes_per_token": round(measured, 1),
            "kv_bytes_per_token_ratio_measured_vs_planned": round(measured / rank.kv_bytes_per_token, 4),
            "planned_capacity_tokens": rank.kv_tokens_capacity, "engine_capacity_tokens": kv.capacity_tokens,
            "capacity_ratio_engine_vs_planned": round(kv.capacity_tokens / rank.kv_tokens_capacity, 4)}


# -- (e) chunked context ---------------------------------------------------------------

def bench_chunked(hf_dir: Path, root: Path, quick: bool) -> dict:
    long_len = 512 if quick else 2048
    decodes, new = 4, (40 if quick else 160)
    out = {"long_prompt_tokens": long_len, "running_decodes": decodes}
    for chunked in (False, True):
        # Same engine weights; chunked runs contexts in 256-token pieces, unchunked needs max_num_tokens >= prompt.
        eng = build_engine(hf_dir, root / f"chunked-{chunked}", max_num_tokens=256 if chunked else 4096)
        engine = load(eng)
        engine.generate([5, 6, 7], greedy(2))
        run = Run(engine, SchedulerConfig(enable_chunked_context=chunked))
        done = threading.Semaphore(0)
        with run.batcher:
            for i, p in enumerate(prompts_of(decodes, 16, seed=6)):
                run.submit(i, p, greedy(new), done)
            while min(len(run.times[i]) for i in range(decodes)) < 4:  # decodes are running
                time.sleep(0.01)
            for j, p in enumerate(prompts_of(2, long_len, seed=7)):
                run.submit(f"long{j}", p, greedy(2), done)
            for _ in range(decodes + 2):
                done.acquire()
        start = min(run.sent["long0"], run.sent["long1"])
        end = max(run.times[f"long{j}"][0] for j in range(2))
        itl = [b - a for i in range(decodes) for a, b in zip(run.times[i], run.times[i][1:], strict=False) if start <= b <= end]
        itl.sort()
        key = "on" if chunked else "off"
        out[f"itl_p99_ms_chunked_{key}"] = round(itl[min(len(itl) - 1, int(0.99 * len(itl)))] * 1000, 1)
        out[f"itl_samples_chunked_{key}"] = len(itl)
        out[f"long_prompt_ttft_s_chunked_{key}"] = round(end - start, 2)
    out["itl_p99_ratio_chunked_on_vs_off"] = round(out["itl_p99_ms_chunked_on"] / out["itl_p99_ms_chunked_off"], 3)
    return out


# -- (f) concurrency in a fixed budget ----------------------------------------------------

def bench_concurrency(small_hf: Path, root: Path) -> dict:
    budget, n, new = 4096, 24, 64
    eng = build_engine(small_hf, root / "concurrency", max_batch_size=32)
    shared = prompts_of(1, 448, seed=8)[0]
    with_prefix = [shared + u for u in prompts_of(n, 64, seed=9)]
    unique = prompts_of(n, 512, seed=10)

    def peak(prompts, policy, reuse) -> int:
        engine = load(eng, reuse=reuse, max_tokens=budget)
        if reuse:  # the system prompt is cached once, as a deployment's first request would leave it
            engine.generate(shared + [5], greedy(1))
        run = Run(engine, SchedulerConfig(policy=policy))
        run.run([(p, greedy(new)) for p in prompts], len(prompts))
        return run.batcher.stats.max_running

    contiguous = peak(with_prefix, "guaranteed_no_evict", reuse=False)  # prompt + max_tokens reserved per request
    paged = peak(with_prefix, "guaranteed_no_evict", reuse=True)
    contiguous_unique = peak(unique, "guaranteed_no_evict", reuse=False)
    paged_unique = peak(unique, "max_utilization", reuse=False)
    return {"kv_budget_tokens": budget, "requests": n, "prompt_tokens": 512, "output_tokens": new,
            "shared_prefix_tokens": len(shared),
            "concurrent_contiguous": contiguous, "concurrent_paged": paged,
            "concurrency_ratio_paged_vs_contiguous": round(paged / contiguous, 2),
            "no_shared_prefix": {"concurrent_contiguous": contiguous_unique,
                                 "concurrent_paged_max_utilization": paged_unique,
                                 "ratio": round(paged_unique / contiguous_unique, 2)}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="small model and counts: a smoke run")
    ap.add_argument("--only", default="a,b,c,d,e,f,g", help="comma-separated parts to run")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    torch.set_num_threads(THREADS)
    results: dict = {"threads": THREADS, "tokens_per_block": TPB, "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="cpu-engine-bench-") as tmp:
        root = Path(tmp)
        size = "small" if args.quick else "base"
        hf_dir = make_model(root / "hf", size)
        small = hf_dir if args.quick else make_model(root / "hf-small", "small")
        results["model"] = {"size": size, **SIZES[size], "parameters": params_of(hf_dir)}
        eng = build_engine(hf_dir, root / "fp32")
        steps = [("a", "throughput", lambda: bench_throughput(hf_dir, eng, args.quick)),
                 ("b", "prefix_reuse", lambda: bench_reuse(eng, args.quick)),
                 ("c", "quantized_decode", lambda: bench_quantized(hf_dir, root, eng, args.quick)),
                 ("d", "kv_accounting", lambda: bench_kv_accounting(hf_dir, eng, root)),
                 ("e", "chunked_context", lambda: bench_chunked(hf_dir, root, args.quick)),
                 ("f", "concurrency", lambda: bench_concurrency(small, root)),
                 ("g", "decode_floor", lambda: bench_floor(hf_dir, root, eng, args.quick))]
        for key, name, fn in steps:
            if key not in parts:
                continue
            start = time.perf_counter()
            results[name] = fn()
            results[name]["seconds"] = round(time.perf_counter() - start, 1)
            print(json.dumps({name: results[name]}, indent=1), flush=True)
    summary = {k: v for part in results.values() if isinstance(part, dict) for k, v in part.items()
               if k in TARGETS}
    results["targets"] = {k: {"value": summary.get(k), "target": t} for k, t in TARGETS.items()}
    print_and_write(results, args.json, indent=1, printed=results["targets"])
    return 0


TARGETS = {
    "speedup_16_streams_vs_hf_sequential": ">= 5",
    "ratio_16_streams_vs_transformers_cb": ">= 1.5",
    "ttft_ratio_reuse_on_vs_off": "<= 0.4",
    "int4_decode_speedup_vs_fp32_b1": ">= 1.5",
    "int4_decode_speedup_vs_fp32_b16": ">= 1.0",
    "int8_decode_speedup_vs_fp32_b1": "",
    "int8_decode_speedup_vs_fp32_b16": ">= 1.0",
    "kv_bytes_per_token_ratio_measured_vs_planned": "0.95 .. 1.05",
    "itl_p99_ratio_chunked_on_vs_off": "<= 0.5",
    "concurrency_ratio_paged_vs_contiguous": ">= 2",
    "decode_step_vs_gemm_floor_b1": "<= 1.3",
    "decode_step_vs_gemm_floor_b16": "<= 1.15",
    "int8_decode_step_vs_gemm_floor_b1": "",
    "int8_decode_step_vs_gemm_floor_b16": "",
    "int4_decode_step_vs_gemm_floor_b1": "",
    "int4_decode_step_vs_gemm_floor_b16": "",
}

if __name__ == "__main__":
    sys.exit(main())
