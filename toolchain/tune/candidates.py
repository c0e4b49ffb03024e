"""The search space of `toolchain tune`: deployment specs derived from the user's by replacing fields.

A candidate is a whole `DeploymentSpec` (validated by its pydantic class like a file would be) plus the number of
replicas it runs as, so what the search plans, predicts, writes and deploys is one object. The space has two
parts, searched in two passes so it stays at a few hundred specs:

- structure: every tp x pp whose product divides the GPU count (the rest of the GPUs run replicas of it; on this
  host's CPU one server, so replicas 1 and tp x pp up to the count, and a single rank also at every core's
  engine thread where this host has a profile for that count: `engine_threads`), every weight format of the formats table the
  device builds (`Format.refused_on` for a GPU's SM; a CPU kernel for the CPU engine), every KV-cache format the
  device builds, speculative decoding on and off where the spec has a draft or heads (and multi-token prediction on
  and off for a model with MTP layers on a target that runs it: `speculative_modes`), attention data parallelism on
  and off for a mixture-of-experts model on the LLM-API path at tp > 1 (`attention_dp_modes`), and a mixture of
  experts' expert parallelism at every moe_ep dividing tp (`moe_ep_sizes`);
- runtime knobs, for the best structures only: `limits.max_batch_size` on powers of two (the performance model's
  best_point already sweeps every concurrency below the cap, so the cap needs only a coarse grid; where the SLO
  binds between two of them, `search.refine_batches` bisects to the largest cap that meets it) and
  `limits.max_num_tokens` at the spec's value and at 2048 / 8192 / 16384 tokens (a short, a middle and a long
  step budget; a step's cost is linear in its tokens between them), each with chunked context off and on.

A model stored quantized (AutoAWQ/GPTQ) keeps its own format. Which of these fit and pass the checks is not
decided here: `search.py` plans each with the planner and checks `toolchain plan` runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

from toolchain.dynamo.roles import role_values
from toolchain.errors import ToolchainError
from toolchain.gpus import Gpu
from toolchain.hostprofile import load_profile, resolve_threads, usable_cores
from toolchain.quant.formats import KV_CACHE, METHODS
from toolchain.spec import DeploymentSpec
from toolchain.speculative import refusal
from toolchain.targets import CPU, ENGINE, target_of

BATCH_GRID = (8, 16, 32, 64, 128, 256)
NUM_TOKENS_GRID = (2048, 8192, 16384)


@dataclass(frozen=True)
class Candidate:
    spec: DeploymentSpec
    replicas: int
    gpu_count: int
    """GPUs (or CPU ranks) the candidate uses in all: replicas x tp x pp."""

    @property
    def label(self) -> str:
        s = self.spec
        q = s.quantization
        chunk = "c" if s.build.chunked_context else ""
        d = s.dynamo
        if d.disaggregated:  # prefill and decode workers of their own (tune/disagg.py), each role's settings
            pre, dec = role_values(s, "prefill"), role_values(s, "decode")
            parts = [f"disagg P{d.prefill_workers}xTP{pre['tp']} D{d.decode_workers}xTP{dec['tp']}", f"w:{q.method}",
                     f"kv:{q.kv_cache}", f"b{dec['max_batch_size']}", f"n{pre['max_num_tokens']}{chunk}"]
        else:
            parts = [f"tp{s.parallelism.tp}pp{s.parallelism.pp}x{self.replicas}",
                     f"w:{q.method}", f"kv:{q.kv_cache}", f"b{s.limits.max_batch_size}",
                     f"n{s.limits.max_num_tokens}{chunk}"]
        if s.speculative.mode != "none":
            parts.append(s.speculative.mode)
        if s.parallelism.attention_dp:
            parts.append("adp")
        if s.parallelism.moe_ep:
            parts.append(f"ep{s.parallelism.moe_ep}")
        if s.gpu.name:
            parts.insert(0, s.gpu.name.split()[0])
        if target_of(s).device == CPU and s.serving.engine_threads != 1:
            parts.append(f"threads{s.serving.engine_threads}")
        return " ".join(parts)

    @property
    def knobs(self) -> dict:
        """The searched fields as they are set in this candidate (tune.json)."""
        s = self.spec
        return {"gpu": s.gpu.name, "replicas": self.replicas, "tp": s.parallelism.tp, "pp": s.parallelism.pp,
                "quantization": s.quantization.method, "kv_cache": s.quantization.kv_cache,
                "max_batch_size": s.limits.max_batch_size, "max_num_tokens": s.limits.max_num_tokens,
                "chunked_context": s.build.chunked_context, "speculative": s.speculative.mode,
                "attention_dp": s.parallelism.attention_dp, "moe_ep": s.parallelism.moe_ep or 1,
                "engine_threads": s.serving.engine_threads, **self.disagg_knobs}

    @property
    def disagg_knobs(self) -> dict:
        """A disaggregated candidate's roles (none for an aggregated one, whose tune.json stays as it was)."""
        d = self.spec.dynamo
        if not d.disaggregated:
            return {}
        return {"disaggregated": True, **{f"{role}_{k}": v for role in ("prefill", "decode")
                                          for k, v in {"workers": getattr(d, f"{role}_workers"),
                                                       **d.role(role).given}.items()}}


def derive(spec: DeploymentSpec, changes: dict[str, Any]) -> DeploymentSpec:
    """The spec with dotted fields replaced ("limits.max_batch_size": 64), validated as a loaded file is; a
    combination the spec's own validators refuse raises ToolchainError with their message (Section.derived)."""
    return spec.derived(changes)


def layouts(gpu_count: int, on_cpu: bool) -> list[tuple[int, int, int]]:
    """(tp, pp, replicas) over `gpu_count` devices: tp x pp divides the count and replicas take the rest; on the
    CPU one server runs the ranks, so replicas is 1 and tp x pp is at most the count."""
    out = []
    for tp in range(1, gpu_count + 1):
        for pp in range(1, gpu_count // tp + 1):
            if on_cpu:
                out.append((tp, pp, 1))
            elif gpu_count % (tp * pp) == 0:
                out.append((tp, pp, gpu_count // (tp * pp)))
    return out


def weight_methods(spec: DeploymentSpec, device: Gpu | None, stored_quantized: bool) -> list[str]:
    """Weight formats the device can run: on a GPU those its SM builds (the formats table's rule), on the CPU
    engine those with a CPU kernel it runs. Only formats convert computes on the path (`Format.ready_on`), and on the
    engine path those trtllm-build builds (`Format.engine_why_not`): tune never proposes what convert refuses. (The
    LLM-API path's own refusal stays llmapi.quantization's, under which tune reports what it drops.) A checkpoint
    stored quantized keeps its format."""
    if stored_quantized:
        return [spec.quantization.method]
    target = target_of(spec)
    rows = {name: row for name, row in METHODS.items()
            if row.ready_on(target.path) and (target.path != ENGINE or row.engine_why_not is None)}
    if target.device == CPU:
        return [name for name, row in rows.items() if (row.cpu_kernel is not None and row.cpu_kernel_ready)
                or name == "none"]
    sm = device.sm if device is not None and device.sm is not None else None
    return [name for name, row in rows.items() if sm is None or row.refused_on(sm) is None]


def kv_formats(spec: DeploymentSpec, device: Gpu | None) -> list[str]:
    """KV-cache formats the device can run (the same SM rule; every one on the CPU engine)."""
    if target_of(spec).device == CPU:
        return list(KV_CACHE)
    sm = device.sm if device is not None and device.sm is not None else None
    return [name for name, row in KV_CACHE.items() if sm is None or row.refused_on(sm) is None]


def engine_threads(spec: DeploymentSpec) -> tuple[list[int], str | None]:
    """Engine thread counts a single-rank CPU candidate is searched at: the spec's, and every core this process
    may use where that differs and this host has a profile for it (without one the count could not be predicted,
    and unpredicted candidates would fall back to the ordering rule); and a note when it is left out for want of
    a profile. Several ranks are not given more threads: their processes already share the cores."""
    own = spec.serving.engine_threads
    cores = usable_cores()
    if target_of(spec).device != CPU or resolve_threads(own) == cores:
        return [own], None
    if load_profile(cores) is None:
        return [own], (f"engine_threads {cores} not searched: no profile of this host for {cores} engine threads "
                       f"(run `toolchain probe-host --threads {cores}` to search it)")
    return [own, cores], None


def speculative_modes(spec: DeploymentSpec, mtp: bool = False) -> list[str]:
    """The spec's speculative mode and none: a draft or heads exist only where the spec names them. A model with its
    own multi-token-prediction layers (`mtp`: num_nextn_predict_layers in config.json, DeepSeek-V3's) drafts without
    either, so a spec without a mode gets mtp too where its target runs it (speculative.py's row)."""
    mode = spec.speculative.mode
    if mode != "none":
        return [mode, "none"]
    return ["none", "mtp"] if mtp and refusal("mtp", target_of(spec)) is None else ["none"]


def moe_ep_sizes(tp: int, moe: bool) -> list[int | None]:
    """A mixture of experts' expert parallelism at `tp`: None (moe_ep 1, each expert's width over the tp ranks, as
    TensorRT-LLM's Mapping derives it) and every other moe_ep dividing tp (moe_tp = tp / moe_ep). What the model's
    experts refuse (their count or width) is the plan's moe.parallelism check's to say."""
    return [None, *(e for e in range(2, tp + 1) if tp % e == 0)] if moe else [None]


def attention_dp_modes(spec: DeploymentSpec, tp: int, moe: bool) -> list[bool]:
    """Attention data parallelism off, and on where it exists: the LLM-API path, a mixture-of-experts model (the
    only kind plan places it for, archs/layout.py) and tp > 1 (the spec refuses it at tp 1)."""
    return [False, True] if moe and target_of(spec).llmapi_path and tp > 1 else [False]


def structures(spec: DeploymentSpec, gpu_count: int, device: Gpu | None,
               stored_quantized: bool, moe: bool = False, mtp: bool = False) -> tuple[list[Candidate], list[str]]:
    """Pass one: every layout x weight format x KV format (x speculative mode, MTP on and off for an `mtp` model,
    x attention DP and moe_ep for a `moe` model) at the spec's limits; and the messages of combinations the spec's
    validators refuse."""
    on_cpu = target_of(spec).device == CPU
    threads, _ = engine_threads(spec)
    out, refused = [], []
    for tp, pp, replicas in layouts(gpu_count, on_cpu):
        # a checkpoint stored quantized keeps its KV cache too: nothing can be calibrated on it (quant/view.py)
        kvs = [spec.quantization.kv_cache] if stored_quantized else kv_formats(spec, device)
        for method, kv, mode, n, adp, ep in product(weight_methods(spec, device, stored_quantized),
                                                    kvs, speculative_modes(spec, mtp),
                                                    threads if tp * pp == 1 else threads[:1],
                                                    attention_dp_modes(spec, tp, moe), moe_ep_sizes(tp, moe)):
            changes: dict[str, Any] = {"parallelism.tp": tp, "parallelism.pp": pp,
                                       "parallelism.moe_tp": None, "parallelism.moe_ep": ep,
                                       "parallelism.attention_dp": adp,
                                       "parallelism.gpus": None if on_cpu else gpu_count,
                                       "quantization.method": method, "quantization.kv_cache": kv,
                                       "speculative.mode": mode, "serving.engine_threads": n}
            if mode == "none" and spec.speculative.mode != "none":
                # off means the whole section at its defaults: a draft_model or heads left behind would be
                # planned and converted for a deployment that never runs them
                del changes["speculative.mode"]
                changes["speculative"] = {"mode": "none"}
            if on_cpu and spec.serving.launch == "mpirun" and tp * pp == 1:
                changes["serving.launch"] = None  # one rank has no processes to launch
            try:
                out.append(Candidate(derive(spec, changes), replicas, tp * pp * replicas))
            except ToolchainError as err:
                refused.append(str(err))
    return out, refused


def knob_variants(base: Candidate) -> tuple[list[Candidate], list[str]]:
    """Pass two for one structure: max_batch_size x (max_num_tokens, chunked context) around the spec's values."""
    lim = base.spec.limits
    batches = sorted({lim.max_batch_size, *BATCH_GRID})
    tokens = sorted({lim.max_num_tokens, *NUM_TOKENS_GRID})
    out, refused = [], []
    for batch in batches:
        for num in tokens:
            for chunked in (False, True):
                changes = {"limits.max_batch_size": batch, "limits.max_num_tokens": num,
                           "build.chunked_context": chunked}
                try:
                    out.append(Candidate(derive(base.spec, changes), base.replicas, base.gpu_count))
                except ToolchainError as err:
                    refused.append(str(err))
    return out, refused
