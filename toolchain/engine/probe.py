"""`toolchain probe-host`'s measurements: this host's rates for the CPU engine, from the engine's own kernels.

Each figure runs the code the CPU engine runs (engine/cpu/): the float32 `linear.Linear` every float weight goes
through (weights are widened to float32 at load; `matmul` up to three rows, oneDNN on a blocked copy from four
for a weight of 1 MiB or more), the weight-only int8/int4 packed kernels and SmoothQuant's `torch._int_mm` of engine/cpu/qlinear.py on
bf16/int8 activations, attention as `Model._attend` does it (an
`index_select` of the cached keys and values out of the paged pool, then `scaled_dot_product_attention`), and the
fixed costs of a step on a model of the embedded tiny Llama's shape driven by the `InflightBatcher` itself. The
fixed costs are what the kernels' measured rates do not explain: the step's time minus the performance model's
own kernel time for it (plan/perf/host.py `host_step_time`), so the two always add up to the measured step.

The probe takes about 10-20 s on a 2-core host; its result is cached by hostprofile.py.
"""

from __future__ import annotations

import datetime as dt
import functools
import json
import multiprocessing
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.build import write_cpu_engine
from toolchain.engine.cpu import CpuEngine, InflightBatcher, KvCacheConfig, SamplingParams
from toolchain.engine.cpu.comm import Comm
from toolchain.engine.cpu.linear import Linear, matmul
from toolchain.engine.cpu.qlinear import Int4WeightOnly, Int8WeightOnly, SmoothQuantW8A8
from toolchain.hostprofile import HostProfile, current_key
from toolchain.netutil import free_port
from toolchain.plan import perf
from toolchain.plan.model import load_model
from toolchain.quant.view import Quantization

GEMM_ROWS = (1, 4, 16, 64, 256)
GEMM_SHAPE = (1024, 1024)  # (out, in): 4 MiB in float32, in the cache as a small model's linears are
TINY = {"hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 4096}
"""The embedded tiny Llama's shape (models/tiny-llama/config.json); its weights here are random."""


def _best_seconds(fn: Callable[[], object], min_total: float = 0.01, rounds: int = 6) -> float:
    """Seconds per call: the fastest of `rounds` rounds, each at least `min_total` long (after one warm call)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        n, start = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            spent = time.perf_counter() - start
            if spent >= min_total:
                break
        best = min(best, spent / n)
    return best


def last_level_cache_bytes() -> int:
    """The largest cache of cpu0 (sysfs), 0 when unknown."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * unit)
    return max(sizes, default=0)


def gemv_gb_s(nbytes: int) -> float:
    """GB/s the float32 matrix-vector product reads a weight of `nbytes` at (a decode step's linear)."""
    inp = 1024
    w = torch.randn(max(1, nbytes // (4 * inp)), inp)
    x = torch.randn(1, inp)
    return w.numel() * 4 / _best_seconds(lambda: matmul(x, w)) / 1e9


def gemm_curves() -> dict[str, dict[str, float]]:
    """GFLOP/s of each kernel the CPU engine runs a linear with, by rows per call."""
    out_f, in_f = GEMM_SHAPE
    w = torch.randn(out_f, in_f) * 0.02
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"fp32": Linear(w)}  # matmul, or oneDNN from 4 rows
    w_bf16 = w.to(torch.bfloat16)
    kernels["bf16"] = lambda x: F.linear(x.to(torch.bfloat16), w_bf16)
    kernels["int8_wo"] = Int8WeightOnly(w)
    kernels["int4_wo"] = Int4WeightOnly(w)
    q = torch.randint(-127, 128, (out_f, in_f), dtype=torch.int8)
    ones = torch.ones(out_f)
    kernels["int8"] = SmoothQuantW8A8(q, ones, torch.ones(1), torch.ones(in_f))
    curves: dict[str, dict[str, float]] = {}
    for name, kernel in kernels.items():
        curves[name] = {}
        for rows in GEMM_ROWS:
            x = torch.randn(rows, in_f)
            seconds = _best_seconds(functools.partial(kernel, x))
            curves[name][str(rows)] = round(2 * rows * out_f * in_f / seconds / 1e9, 3)
    return curves


def attention_rates() -> tuple[float, float]:
    """(GB/s of cached K/V a decode step's attention gets through, GFLOP/s of a context's causal attention), as
    Model._attend runs them: gather the keys and values of each sequence out of the pool, then SDPA."""
    batch, keys, kv_heads, heads, hd = 8, 512, 4, 8, 64
    pool_k = torch.randn(batch * keys * 2, kv_heads, hd)
    pool_v = torch.randn(batch * keys * 2, kv_heads, hd)
    slots = torch.randperm(pool_k.shape[0])[: batch * keys]
    q = torch.randn(batch, heads, 1, hd)
    mask = torch.ones(batch, 1, 1, keys, dtype=torch.bool)

    def decode():
        k = pool_k.index_select(0, slots).view(batch, keys, kv_heads, hd).transpose(1, 2)
        v = pool_v.index_select(0, slots).view(batch, keys, kv_heads, hd).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    kv_bytes = 2 * batch * keys * kv_heads * hd * 4
    gb_s = kv_bytes / _best_seconds(decode) / 1e9
    n = 256
    qc, kc, vc = torch.randn(1, heads, n, hd), torch.randn(1, kv_heads, n, hd), torch.randn(1, kv_heads, n, hd)
    flops = 4.0 * heads * hd * n * (n + 1) / 2
    gflops = flops / _best_seconds(lambda: F.scaled_dot_product_attention(qc, kc, vc, is_causal=True,
                                                                          enable_gqa=True)) / 1e9
    return gb_s, gflops


def write_tiny_hf(out: Path, seed: int = 0) -> Path:
    """A Llama of the tiny model's shape with random weights, as HF lays it out (config.json, safetensors)."""
    from safetensors.torch import save_file

    h, m, heads, kvh, hd, layers, vocab = (TINY[k] for k in ("hidden_size", "intermediate_size",
                                                               "num_attention_heads", "num_key_value_heads",
                                                               "head_dim", "num_hidden_layers", "vocab_size"))
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).contiguous()

    tensors = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.k_proj.weight": rand(kvh * hd, h),
                        p + "self_attn.v_proj.weight": rand(kvh * hd, h), p + "self_attn.o_proj.weight": rand(h, heads * hd),
                        p + "mlp.gate_proj.weight": rand(m, h), p + "mlp.up_proj.weight": rand(m, h),
                        p + "mlp.down_proj.weight": rand(h, m), p + "input_layernorm.weight": torch.ones(h),
                        p + "post_attention_layernorm.weight": torch.ones(h)})
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 1024,
              "tie_word_embeddings": True, "torch_dtype": "float32", **TINY}
    (out / "config.json").write_text(json.dumps(config))
    return out


def _tiny_engine(hf: Path, root: Path, tp: int, threads: int) -> CpuEngine:
    ckpt, eng = root / f"ckpt-tp{tp}", root / f"engine-tp{tp}"
    ckpt.mkdir()
    eng.mkdir()
    convert_checkpoint(hf, ckpt, tp=tp, pp=1, dtype="float32", target="cpu")
    write_cpu_engine(ckpt, eng, {"max_batch_size": 16, "max_input_len": 128, "max_seq_len": 256,
                                 "max_num_tokens": 2048, "max_beam_width": 1, "kv_cache_type": "PAGED",
                                 "plugin_config": {"paged_kv_cache": True, "tokens_per_block": 32}})
    return CpuEngine.load(eng, num_threads=threads, kv_cache=KvCacheConfig(max_tokens=16 * 256))


PROMPT, DECODE = 16, 48
REPEATS = 3


STEP_PERCENTILE = 25
"""The step time taken is this percentile of the gaps, as the kernels' rates are their fastest rounds: what the
host does when other work lets it, so the profile describes the host rather than the load of the moment."""


def decode_step_seconds(engine: CpuEngine, batch: int) -> float:
    """Seconds between the tokens of `batch` requests decoding together through the InflightBatcher (every step
    then runs one token of each), past the first few steps: the STEP_PERCENTILE-th percentile of the gaps."""
    times: list[list[float]] = [[] for _ in range(batch)]
    done = threading.Event()
    left = [batch]
    lock = threading.Lock()

    def callback(i):
        def on_tokens(tokens, finished, error):
            if tokens:
                times[i].append(time.perf_counter())
            if finished:
                with lock:
                    left[0] -= 1
                    if left[0] == 0:
                        done.set()
        return on_tokens

    g = torch.Generator().manual_seed(batch)
    with InflightBatcher(engine) as batcher:
        for i in range(batch):
            prompt = torch.randint(3, TINY["vocab_size"], (PROMPT,), generator=g).tolist()
            batcher.submit(i, prompt, SamplingParams(max_new_tokens=DECODE), callback(i))
        if not done.wait(120):
            raise RuntimeError("the probe's decode run did not finish in 120 s")
    # Every request gets its token from the same steps, so the first request's gaps are the steps'.
    gaps = [b - a for a, b in zip(times[0][4:], times[0][5:], strict=False)]
    return statistics.quantiles(gaps, n=100)[STEP_PERCENTILE - 1]


def predicted_kernels(profile: HostProfile, model, tp: int, batch: int) -> float:
    """The performance model's kernel time (no fixed costs) of one decode step of `batch` on the tiny model."""
    p = model.params
    cost = perf.stage_cost(p, tp=tp, pp_rank=0, pp=1, quant=Quantization(), dt_bytes=4, kv_bytes=4)
    work = perf.generation_work(batch, PROMPT + DECODE / 2)
    return perf.host_step_time(cost, perf.host_row(profile), work, math_precision="fp32", tp=tp,
                               eff=perf.Efficiency(1.0, 1.0, 1.0), shards=tp).seconds


GLOO_SIZES = (4 * 1024, 4 * 1024**2)  # bytes of one rank's part: a small one for the latency, a large one for the rate
GLOO_CALLS = 40


def _gloo_rank(rank: int, addr: str, threads: int, results) -> None:
    """One of two rank processes: time the engine's own all-reduce (Comm.tp_sum, a send to the other rank and a
    receive from it) at each size, the fastest of many, and report from rank 0."""
    import torch.distributed as dist

    torch.set_num_threads(threads)
    comm = Comm(rank, 2, 2, 1, addr)
    best = {}
    for nbytes in GLOO_SIZES:
        part = torch.ones(nbytes // 4)
        comm.tp_sum(part)  # the first exchange sets the connection up
        # A fixed count on both ranks (each call needs its peer's), the fastest kept, as _best_seconds does.
        times = []
        for _ in range(GLOO_CALLS):
            start = time.perf_counter()
            comm.tp_sum(part)
            times.append(time.perf_counter() - start)
        best[nbytes] = min(times)
    if rank == 0:
        results.put(best)
    dist.barrier()
    dist.destroy_process_group()


def gloo_exchange(threads: int, timeout_s: float = 120.0) -> dict[str, float] | None:
    """The rank exchange of `serving.launch: mpirun` as the model's link: {"latency_us", "gb_s"} from two rank
    processes on this host (the fixed cost from the small exchange, the rate from the difference between the two),
    or None when the processes could not meet."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per rank, as mpirun starts them
    results = ctx.Queue()
    addr = f"127.0.0.1:{free_port('127.0.0.1')}"
    procs = [ctx.Process(target=_gloo_rank, args=(r, addr, threads, results), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        times = results.get(timeout=timeout_s)
    except Exception:
        return None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    small, large = GLOO_SIZES
    rate = (large - small) / max(times[large] - times[small], 1e-9)
    return {"latency_us": round(max(times[small] - small / rate, 0.0) * 1e6, 2), "gb_s": round(rate / 1e9, 3)}


def measure(threads: int, log: Callable[[str], None] = lambda _: None) -> HostProfile:
    """Measure this host at `threads` torch threads (0: every core) and return its profile."""
    key = current_key(threads)
    before = torch.get_num_threads()
    torch.set_num_threads(key.threads)
    started = time.perf_counter()
    try:
        llc = last_level_cache_bytes()
        log("memory bandwidth (fp32 matrix-vector product) ...")
        stream = gemv_gb_s(256 * 1024**2)
        cached = gemv_gb_s(llc // 4) if llc else stream
        log("linear kernels per precision ...")
        curves = gemm_curves()
        log("attention ...")
        att_gb_s, att_gflops = attention_rates()
        base = HostProfile(key, "", 0.0, round(stream, 3), round(cached, 3), llc, curves, round(att_gb_s, 3),
                           round(att_gflops, 3), 0.0, 0.0, 0.0)
        log("fixed costs of a step on the tiny model (tp 1 and 2, batch 1 and 8) ...")
        with tempfile.TemporaryDirectory(prefix="probe-host-") as tmp:
            root = Path(tmp)
            hf = write_tiny_hf(root / "hf")
            model = load_model(hf)
            layers = TINY["num_hidden_layers"]
            e1 = _tiny_engine(hf, root, 1, key.threads)
            e2 = _tiny_engine(hf, root, 2, key.threads)
            # Each REPEATS times, in turn, the fastest kept: a burst of other work on the host hits one run, not both.
            t11 = t18 = t21 = float("inf")
            for _ in range(REPEATS):
                t11 = min(t11, decode_step_seconds(e1, 1))
                t18 = min(t18, decode_step_seconds(e1, 8))
                t21 = min(t21, decode_step_seconds(e2, 1))
        log("the rank exchange of serving.launch mpirun (two gloo rank processes) ...")
        gloo = gloo_exchange(key.threads)
        rest11 = t11 - predicted_kernels(base, model, 1, 1)
        rest18 = t18 - predicted_kernels(base, model, 1, 8)
        rest21 = t21 - predicted_kernels(base, model, 2, 1)
        sequence = max((rest18 - rest11) / 7, 0.0)
        rest11 -= sequence  # the one sequence of the batch-1 step
        rest21 -= sequence
        layer = max((rest21 - rest11) / layers, 0.0)
        step = max(rest11 - layer * layers, 0.0)
        notes = [f"tiny-model decode steps: tp1 batch 1 {t11 * 1e3:.2f} ms, tp1 batch 8 {t18 * 1e3:.2f} ms, "
                 f"tp2 batch 1 {t21 * 1e3:.2f} ms"]
        if gloo is None:
            notes.append("gloo exchange between rank processes could not be measured (serving.launch mpirun is not "
                         "predicted)")
        return HostProfile(key, dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                           round(time.perf_counter() - started, 2), base.stream_gb_s, base.cache_gb_s, llc, curves,
                           base.attention_gb_s, base.attention_gflops, round(step * 1e6, 2), round(layer * 1e6, 2),
                           round(sequence * 1e6, 2), gloo=gloo, notes=notes)
    finally:
        torch.set_num_threads(before)
