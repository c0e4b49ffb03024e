"""Disaggregated serving: P prefill workers hand each prompt's KV cache to D decode workers (NVIDIA Dynamo with
TensorRT-LLM; docs/planning.md "Disaggregated candidates").

Each role is a `Deployment` of its own (its tp, its limits, its KV pool), costed only through
`Deployment.iteration`, so whatever a step costs there applies here unchanged:

- a prefill worker runs context-only iterations: as many whole prompts as its max_num_tokens (and max_batch_size)
  takes, or one prompt's chunks one after another when a prompt is longer and chunked prefill is on (a longer
  prompt without it is refused, as the worker would refuse it). Its rate is prompts per iteration / iteration.
- the KV cache of the prompt then moves to a decode worker: ISL x the KV bytes per token of one rank (the larger
  of a prefill rank's shard and a decode rank's: each rank sends or receives its own in parallel) over the link,
  NVLink (gpu.link) when both roles fit one node of gpu.per_node GPUs, else the NIC (`NIC`, assumed), plus a fixed
  handshake (`HANDSHAKE_S`, assumed). For TensorRT-LLM the decode waits for it: it is on the TTFT path
  (ai-dynamo/dynamo docs/design-docs/disagg-serving.md: "Prefill runs synchronously; decode waits for prefill to
  complete before proceeding").
- a decode worker runs generation-only iterations at its batch, up to max_batch_size and what its KV pool holds of
  full sequences (no prompt chunks beside them: the point of disaggregation). TPOT is that iteration.
- the system serves min(P x prefill seq/s, D x decode seq/s) requests per second, x OSL output tokens, over
  P x tp_p x pp + D x tp_d x pp GPUs; the smaller side is the bottleneck.
- TTFT = the wait for the prefill worker (an M/D/1 queue at the offered rate, `arrival_wait`), the prompt's own
  compute, the KV transfer and the fixed per-request cost (Efficiency.ttft_ms), and with more requests than the
  decode slots hold the wait for a slot (Little's law, as `queued` has it).

AIConfigurator 0.12.0 models the same split (aiconfigurator/sdk/inference_session.py run_disagg, picking.py
_build_disagg_summary_dict) with no transfer term, prefill TTFT x 1.8 for queueing whatever the load, and the
throughput derated by 0.9 (prefill) / 0.92 (decode); benchmarks/disagg_crosscheck.py sets the two side by side.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from toolchain.errors import ToolchainError
from toolchain.gpus import Link
from toolchain.plan.perf.schedule import Deployment, Workload, arrival_wait, batch_candidates
from toolchain.plan.perf.step import context_work, generation_work

NIC = Link("nic", 50.0, 5.0)
"""ASSUMED inter-node path of the KV transfer: one 400 Gb/s RDMA NIC per GPU (ConnectX-7 class, as DGX H100/H200
nodes have) = 50 GB/s one way, a few microseconds per message. No measured figure was found for Dynamo's NIXL/UCX
transfer between nodes."""
HANDSHAKE_S = 1e-3
"""ASSUMED fixed cost per request of the hand-over (the prefill response's disaggregated_params through the router,
the decode worker's request and NIXL's transfer set-up): no published figure was found."""


@dataclass(frozen=True)
class Role:
    """One role's worker (prefill or decode) and how many of them run."""

    dep: Deployment
    workers: int
    max_batch_size: int
    max_num_tokens: int
    kv_tokens: int
    """KV tokens one rank's pool holds (the role's memory plan, kv_tokens_capacity)."""
    kv_bytes_per_token: int
    """KV bytes one rank holds per token (plan/memory.kv_bytes_per_token at the role's tp and stage layers)."""

    @property
    def gpus(self) -> int:
        return self.workers * self.dep.gpus


@dataclass(frozen=True)
class Split:
    prefill: Role
    decode: Role
    isl: int
    osl: int
    chunked: bool
    tokens_per_block: int
    same_node: bool
    """Both roles' workers fit one node: the KV cache moves over NVLink (gpu.link), else over the NIC."""

    @property
    def gpus(self) -> int:
        return self.prefill.gpus + self.decode.gpus

    @property
    def link(self) -> Link:
        link = self.prefill.dep.gpu.link
        return link if self.same_node and link is not None else NIC

    @property
    def context(self) -> float:
        """The mean cache of a generating sequence."""
        return self.isl + self.osl / 2


def kv_transfer_seconds(split: Split) -> float:
    """One prompt's KV cache from its prefill worker to its decode worker: every rank moves its own shard at once,
    so the larger shard per rank sets the time; plus the link's latency and the assumed handshake."""
    per_rank = split.isl * max(split.prefill.kv_bytes_per_token, split.decode.kv_bytes_per_token)
    link = split.link
    return link.latency_us * 1e-6 + per_rank / (link.gb_s * 1e9 * split.prefill.dep.eff.link) + HANDSHAKE_S


@dataclass(frozen=True)
class Prefill:
    prompts: int
    """Prompts one iteration (or one prompt's chunks) runs."""
    iteration_s: float
    """Seconds those prompts take (all their chunks)."""
    alone_s: float
    """Seconds one prompt takes alone."""
    bound: str

    def seq_per_s(self) -> float:
        return self.prompts / self.iteration_s if self.iteration_s > 0 else 0.0


def prefill_worker(split: Split) -> Prefill:
    """A prefill worker's context-only iterations (module docstring); refused in one line where it cannot run the
    workload's prompt."""
    role, isl = split.prefill, split.isl
    if isl > role.max_num_tokens and not split.chunked:
        raise ToolchainError(f"input_tokens {isl} > the prefill workers' max_num_tokens {role.max_num_tokens} without "
                             "chunked prefill: they would refuse the prompt",
                             "raise dynamo.prefill.max_num_tokens or set build.chunked_context: true")
    seq = math.ceil(isl / split.tokens_per_block) * split.tokens_per_block
    if role.kv_tokens < seq:
        raise ToolchainError(f"the prefill workers' KV cache holds {role.kv_tokens} tokens per rank, less than one "
                             f"{isl}-token prompt", "raise dynamo.prefill.kv_cache_free_gpu_mem_fraction or its tp")
    w = Workload(isl, split.osl, role.max_num_tokens, split.chunked)
    if isl > role.max_num_tokens:  # one prompt's chunks, each after the ones before it
        steps = [role.dep.iteration(context_work(min(w.chunk, isl - j * w.chunk), j * w.chunk), 1)
                 for j in range(w.context_steps)]
        total = sum(t for t, _ in steps)
        return Prefill(1, total, total, steps[0][1].bound)
    prompts = max(1, min(role.max_batch_size, role.max_num_tokens // isl, role.kv_tokens // seq))
    full, step = role.dep.iteration(context_work(isl).scaled(prompts), prompts)
    alone = role.dep.iteration(context_work(isl), 1)[0] if prompts > 1 else full
    return Prefill(prompts, full, alone, step.bound)


def decode_limit(split: Split) -> tuple[int, str]:
    """(Sequences one decode worker runs at most, what limits it): max_batch_size, or the full sequences its KV
    pool holds (the prompt's cache arrives whole, then grows to isl + osl)."""
    role, tpb = split.decode, split.tokens_per_block
    seq = math.ceil((split.isl + split.osl + role.dep.draft_len) / tpb) * tpb
    limits = {"max_batch_size": role.max_batch_size, "kv_cache": role.kv_tokens // seq}
    by = min(limits, key=lambda k: limits[k])
    if limits[by] < 1:
        raise ToolchainError(f"the decode workers' KV cache holds {role.kv_tokens} tokens per rank, less than one "
                             f"{seq}-token sequence", "raise dynamo.decode.kv_cache_free_gpu_mem_fraction or its tp")
    return limits[by], by


def decode_step(split: Split, batch: int) -> tuple[float, str]:
    """(Seconds of a generation-only iteration of `batch` sequences on a decode worker, its bound)."""
    dep = split.decode.dep
    seconds, step = dep.iteration(generation_work(batch, split.context, 1 + dep.draft_len), batch, batch,
                                  split.context)
    return seconds, step.bound


def decode_seq_per_s(split: Split, batch: int) -> float:
    """Requests one decode worker finishes per second at `batch`: each runs (osl - 1) / tokens_per_step iterations
    (the first token came from the prefill)."""
    step, _ = decode_step(split, batch)
    steps = max(split.osl - 1, 1) / split.decode.dep.tokens_per_step
    return batch / (steps * step) if step > 0 else 0.0


@dataclass(frozen=True)
class DisaggPoint:
    concurrency: int
    output_tokens_per_s: float
    ttft_s: float
    tpot_s: float
    queue_s: float
    decode_batch: int
    prefill_bound: str
    decode_bound: str


def point(split: Split, concurrency: int, pre: Prefill | None = None) -> DisaggPoint:
    """The split in steady state with `concurrency` requests in the system (a closed loop): each decode worker
    runs its share (at most its limit); the request rate is what the cycle of TTFT + (osl - 1) x TPOT allows,
    capped by the smaller side; TTFT carries the prefill queue at that rate and any wait for a decode slot."""
    pre = pre or prefill_worker(split)
    limit, _ = decode_limit(split)
    d = split.decode
    batch = max(1, min(math.ceil(concurrency / d.workers), limit))
    step, decode_bound = decode_step(split, batch)
    tpot = step / d.dep.tokens_per_step
    generating = max(split.osl - 1, 0) * tpot
    capacity = min(split.prefill.workers * pre.seq_per_s(), d.workers * decode_seq_per_s(split, batch))
    fixed = kv_transfer_seconds(split) + split.prefill.dep.eff.ttft_ms * 1e-3
    # At the prefill worker a prompt runs with the others that arrived during the iteration before it, up to a
    # full iteration's worth; alone when the load is light.
    ttft, rate, queue = pre.alone_s + fixed, 0.0, 0.0
    for _ in range(6):  # the rate depends on TTFT and TTFT on the rate's queue
        rate = min(concurrency / (ttft + generating), capacity) if ttft + generating > 0 else capacity
        per_worker = rate / split.prefill.workers
        work = pre.iteration_s / pre.prompts  # the prefill room one prompt holds
        # a closed loop of one request never finds another ahead of it (steady_state's `c > 1` too)
        busy = min(per_worker * work, 1.0) if concurrency > 1 else 0.0
        compute = pre.alone_s + busy * (pre.iteration_s - pre.alone_s)
        queue = arrival_wait(0.0, per_worker, work) if concurrency > 1 else 0.0
        ttft = queue + compute + fixed
    if rate > 0:  # more requests than the slots serve: the rest wait for one (Little's law over the cycle)
        ttft += max(concurrency / rate - (ttft + generating), 0.0)
    return DisaggPoint(concurrency, rate * split.osl, ttft, tpot, queue, batch, pre.bound, decode_bound)


def best(split: Split, pre: Prefill | None = None) -> tuple[int, float]:
    """(Sequences per decode worker, output tokens/s) at the maximum: the decode batch up to its limit where
    min(P x prefill rate, D x decode rate) x osl is highest (the smallest such batch on a tie: past the prefill's
    rate a larger batch only slows each token)."""
    pre = pre or prefill_worker(split)
    limit, _ = decode_limit(split)
    prefill_rate = split.prefill.workers * pre.seq_per_s()
    top: tuple[int, float] | None = None
    for b in batch_candidates(limit):
        tokens = min(prefill_rate, split.decode.workers * decode_seq_per_s(split, b)) * split.osl
        if top is None or tokens > top[1] * (1 + 1e-9):
            top = (b, tokens)
    assert top is not None
    return top


def predict_disagg(split: Split, concurrency: int, hourly_usd: float | None = None, basis: str = "",
                   notes: list[str] | None = None) -> dict:
    """The `performance` object of the split (the keys of Performance.as_dict) at `concurrency`, with
    `disaggregated`: each role's figures, the KV transfer and the bottleneck."""
    pre = prefill_worker(split)
    limit, limited_by = decode_limit(split)
    b, tokens = best(split, pre)
    at = point(split, concurrency, pre)
    d, p = split.decode, split.prefill
    prefill_rate, decode_rate = p.workers * pre.seq_per_s(), d.workers * decode_seq_per_s(split, b)
    usd = hourly_usd * split.gpus / (tokens * 3600) * 1e6 if hourly_usd is not None and tokens > 0 else None
    link = split.link
    where = f"{link.kind} {link.gb_s:g} GB/s" + ("" if split.same_node else " (assumed NIC: both roles span nodes)")
    return {
        "predicted": True,
        "max_output_tokens_per_s": round(tokens, 1),
        "per_gpu_output_tokens_per_s": round(tokens / split.gpus, 1),
        "batch_size_at_max": b * d.workers,
        "batch_limit": limit * d.workers, "batch_limited_by": limited_by,
        "concurrency": concurrency, "ttft_ms": round(at.ttft_s * 1e3, 2), "tpot_ms": round(at.tpot_s * 1e3, 3),
        "bound": {"context": at.prefill_bound, "generation": at.decode_bound},
        "usd_per_million_output_tokens": None if usd is None else round(usd, 4),
        "output_tokens_per_s": round(at.output_tokens_per_s, 1),
        "basis": basis, "workload": {"input_tokens": split.isl, "output_tokens": split.osl, "concurrency": concurrency},
        "tokens_per_step": round(d.dep.tokens_per_step, 3),
        "notes": list(notes or []),
        "disaggregated": {
            "prefill": {"workers": p.workers, "tp": p.dep.tp, "gpus": p.gpus, "prompts_per_iteration": pre.prompts,
                        "iteration_ms": round(pre.iteration_s * 1e3, 3), "seq_per_s": round(prefill_rate, 3),
                        "compute_ms": round(pre.alone_s * 1e3, 3), "queue_ms": round(at.queue_s * 1e3, 3)},
            "decode": {"workers": d.workers, "tp": d.dep.tp, "gpus": d.gpus, "batch_limit": limit,
                       "batch_at_max": b, "tpot_ms_at_max": round(decode_step(split, b)[0] / d.dep.tokens_per_step
                                                                   * 1e3, 3),
                       "seq_per_s": round(decode_rate, 3)},
            "kv_transfer_ms": round(kv_transfer_seconds(split) * 1e3, 3), "link": where,
            "bottleneck": "prefill" if prefill_rate < decode_rate else "decode",
        },
    }
