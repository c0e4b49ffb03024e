"""Checks that guard model-repo and serve: end ids, tokenizer, the built engine
against the spec, the launch, ports, and whether the bench workload fits.

Each check's description cites the upstream source it rests on: a file of
TensorRT-LLM's triton_backend/ (model files under
all_models/inflight_batcher_llm/, scripts/launch_triton_server.py), a
tensorrtllm_backend doc, or an upstream issue. Checks on built artefacts run
where a stage consumes them (plan, model-repo, serve) and report `skip` while
they do not exist yet.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.engine.build import build_hash
from toolchain.manifest import Manifest
from toolchain.netutil import port_in_use
from toolchain.checks.registry import ENGINE_PATH, FAIL, GPU_ONLY, PASS, SERVING, SKIP, WARN, Context, check
from toolchain.versions import TENSORRT_VERSION, TRITON_IMAGE, TRTLLM_VERSION, in_line, tensorrt_of
from toolchain.errors import ToolchainError
from toolchain.host import cpu_mpirun, physical_cores
from toolchain.targets import CPU, ENGINE, named, target_of
from toolchain.triton.endpoints import TRITON_KINDS, endpoints

NOT_BUILT = (SKIP, "no engine built yet")
DEFAULT_TRITONSERVER = "/opt/tritonserver/bin/tritonserver"


# ---- end ids (TensorRT-LLM issue #2120; preprocessing/1/model.py) ---------------------------------------------------
@check("eos.resolved", SERVING,
       "generation must stop: EOS ids resolved from generation_config.json (TensorRT-LLM issue #2120)")
def _eos_resolved(ctx: Context):
    e = ctx.eos
    if e is None:
        return SKIP, "model config not readable here; the stage reports why"
    if e.end_id is None:
        return FAIL, ("no eos_token_id in generation_config.json or config.json and no tokenizer eos_token: "
                      "generation would only stop at max_tokens; add eos_token_id to generation_config.json")
    tok = ctx.tokenizer
    if tok is not None and tok.names:
        unknown = [i for i in e.eos_ids if i not in tok.names]
        if unknown:
            return FAIL, (f"EOS id(s) {', '.join(map(str, unknown))} are not special tokens of the tokenizer in "
                          f"{tok.directory}: model and tokenizer disagree; fix eos_token_id or model.tokenizer")
    return PASS, e.describe()


@check("eos.tokenizer-default", SERVING,
       "the tokenizer's eos_token (preprocessing's end_id) must end a turn (preprocessing/1/model.py)", paths=ENGINE_PATH)
def _eos_default(ctx: Context):
    e, tok = ctx.eos, ctx.tokenizer
    if e is None or tok is None:
        return SKIP, "no tokenizer files to compare (model-repo needs them)"
    if e.end_id is None or e.tokenizer_eos_id is None:
        return SKIP, "see eos.resolved"
    if e.tokenizer_eos_id != e.end_id:
        return FAIL, (f"the tokenizer's eos_token {tok.label(e.tokenizer_eos_id)} is what preprocessing sends as "
                      f"end_id, but the model ends a turn with {e.label(e.end_id)}; set eos_token to "
                      f"\"{tok.names.get(e.end_id, e.end_id)}\" in {tok.directory / 'tokenizer_config.json'}")
    return PASS, f"preprocessing's default end_id is {e.label(e.end_id)}"


@check("triton.tokenizer", SERVING, "pre/postprocessing need the model's tokenizer (preprocessing/1/model.py)")
def _tokenizer(ctx: Context):
    tok, where = ctx.tokenizer, ctx.spec.model.tokenizer_dir
    if tok is None:
        if ctx.stage == "plan":
            return WARN, f"no tokenizer files in {where}; model-repo needs them (set model.tokenizer)"
        return SKIP, "the stage reports the missing tokenizer"
    if ctx.model is not None and tok.size and tok.size > ctx.model.params.vocab_size:
        return FAIL, (f"the tokenizer in {where} has {tok.size} tokens but the model's vocab_size is "
                      f"{ctx.model.params.vocab_size}: they belong to different models; fix model.tokenizer")
    return PASS, f"tokenizer in {where}" + (f" ({tok.size} tokens)" if tok.size else "")


# ---- the built engine against the spec ------------------------------------------------------------------------------
def _engine(ctx: Context, owner: bool = False):
    """(engine config, None), or (None, the result to report); a malformed config, or at plan an engine
    built from other build settings, is reported once, by triton.engine-dir (`owner`)."""
    cfg = ctx.engine_config()
    if cfg is None:
        return None, NOT_BUILT
    stale = _rebuilt(ctx, cfg)
    if stale:
        return None, ((WARN, stale) if owner else (SKIP, "see triton.engine-dir"))
    if "_unreadable" in cfg or not isinstance(cfg.get("build_config"), dict):
        if not owner:
            return None, (SKIP, "see triton.engine-dir")
        return None, (FAIL, f"{ctx.engine_dir() or ''}/config.json is not an engine config (no build_config); "
                            "rerun `toolchain build-engine --force`")
    return cfg, None


def _rebuilt(ctx: Context, cfg: dict) -> str | None:
    """At plan, why the built engine is not what the spec will serve: its manifest records other build settings
    (`--set parallelism.tp=4` over an engine built at tp 2), so build-engine (and deploy) build it again and
    checking the old one against the spec would fail a plan that is fine. None when it is current, or at a
    stage that serves the engine as it is (model-repo, serve), where a mismatch must fail."""
    engine_dir = ctx.engine_dir()
    if ctx.stage != "plan" or engine_dir is None:
        return None
    built = Manifest.read(engine_dir)
    if built is None or built.spec_hash == build_hash(ctx.spec):
        return None
    world = ((cfg.get("pretrained_config") or {}).get("mapping") or {}).get("world_size")
    want = ctx.spec.parallelism.world_size
    differs = f" (world size {world}, the spec {want})" if world is not None and world != want else ""
    return (f"the engine in {engine_dir} was built with other build settings{differs}: "
            "`toolchain build-engine` (and deploy) will rebuild it for this spec")


@check("triton.engine-dir", SERVING,
       "the engine dir must hold config.json and one engine per rank (tensorrtllm_backend issue #61)", paths=ENGINE_PATH)
def _engine_dir(ctx: Context):
    cfg, early = _engine(ctx, owner=True)
    if cfg is None:
        return early
    builder = ctx.row.engine_builder
    assert builder is not None  # declared for the engine path
    pattern = builder.rank_files
    engine_dir = ctx.engine_dir()
    ranks = sorted(engine_dir.glob(pattern)) if engine_dir is not None else []
    want = ctx.spec.parallelism.world_size
    if len(ranks) != want:
        return FAIL, (f"{ctx.engine_dir()} holds {len(ranks)} {pattern} file(s), tp x pp needs {want}; "
                      "rerun `toolchain build-engine --force`")
    return PASS, f"{len(ranks)} rank file(s) in {ctx.engine_dir()}"


@check("triton.engine-version", SERVING,
       "engines load only in the TensorRT-LLM that built them (tensorrtllm_backend issue #531)", paths=ENGINE_PATH,
       devices=GPU_ONLY)
def _engine_version(ctx: Context):
    cfg, early = _engine(ctx)
    if cfg is None:
        return early
    version = str(cfg.get("version") or "").strip()
    if version == TRTLLM_VERSION:
        return PASS, f"engine built by TensorRT-LLM {version}, as {TRITON_IMAGE} runs"
    rebuild = f"rebuild with TensorRT-LLM {TRTLLM_VERSION} (the version {TRITON_IMAGE} runs)"
    if in_line(version) and tensorrt_of(version) == TENSORRT_VERSION:
        return WARN, (f"engine built by TensorRT-LLM {version}, {TRITON_IMAGE} runs {TRTLLM_VERSION} "
                      f"(same TensorRT {TENSORRT_VERSION}, so it deserializes); {rebuild} to match")
    return FAIL, f"engine built by TensorRT-LLM {version or 'unknown'}, which {TRITON_IMAGE} cannot load; {rebuild}"


@check("triton.world-size", SERVING,
       "MPI world size must equal the engine's tp x pp (tensorrtllm_backend README.md, Leader Mode)", paths=ENGINE_PATH)
def _world_size(ctx: Context):
    cfg, early = _engine(ctx)
    if cfg is None:
        return early
    mapping = (cfg.get("pretrained_config") or {}).get("mapping") or {}
    engine_world = mapping.get("world_size", 1)
    if engine_world != ctx.spec.parallelism.world_size:
        return FAIL, (f"the engine was built for world size {engine_world}, the spec launches "
                      f"tp x pp = {ctx.spec.parallelism.world_size} ranks; rebuild the engine")
    return PASS, f"world size {engine_world}"


@check("triton.batch-size", SERVING,
       "Triton's max_batch_size and beam width within the engine's (tensorrtllm_backend docs/model_config.md)", paths=ENGINE_PATH)
def _batch_size(ctx: Context):
    cfg, early = _engine(ctx)
    if cfg is None:
        return early
    bc = cfg["build_config"]
    builder = ctx.row.engine_builder
    assert builder is not None  # declared for the engine path
    mbs, beam = ctx.spec.limits.max_batch_size, ctx.spec.build.max_beam_width if builder.beams else 1
    if bc.get("max_batch_size", mbs) < mbs:
        return FAIL, (f"the engine was built for max_batch_size {bc['max_batch_size']}, the repository uses "
                      f"limits.max_batch_size {mbs}; rebuild the engine")
    if bc.get("max_beam_width", 1) < beam:
        return FAIL, f"the engine supports beam width {bc.get('max_beam_width', 1)}, the spec {beam}; rebuild"
    return PASS, f"max_batch_size {mbs} <= engine {bc.get('max_batch_size', mbs)}"


@check("triton.kv-fraction", SERVING,
       "KV fractions of models sharing a GPU must sum below 1 (tensorrtllm_backend docs/llama_multi_instance.md)", paths=ENGINE_PATH)
def _kv_fraction(ctx: Context):
    target = ctx.spec.serving.kv_cache_free_gpu_mem_fraction
    if mode_of(ctx.spec.speculative.mode).adds != DRAFT_ENGINE:
        return PASS, f"one TensorRT-LLM model per GPU, fraction {target}"
    draft = ctx.spec.speculative.draft_kv_cache_free_gpu_mem_fraction
    if target + draft >= 1:
        return FAIL, (f"target ({target}) and draft ({draft}) KV fractions share GPU 0 and sum to "
                      f"{target + draft:.2f}; lower serving.kv_cache_free_gpu_mem_fraction to {1 - draft - 0.05:.2f}")
    return PASS, f"target {target} + draft {draft} < 1"


@check("triton.placeholders", SERVING, "no unfilled ${...} may reach tritonserver (tensorrtllm_backend issue #250)", paths=ENGINE_PATH)
def _placeholders(ctx: Context):
    if not ctx.artefacts or ctx.workspace is None:
        return SKIP, "the repository is rendered by this run"
    repo = Path(ctx.workspace.model_repo_dir(ctx.spec))
    configs = sorted(repo.glob("*/config.pbtxt"))
    if not configs:
        return SKIP, "no model repository rendered yet"
    for path in configs:
        m = re.search(r"\$\{[^}]*\}", path.read_text(errors="replace"))
        if m:
            return FAIL, f"{path} still holds {m.group(0)}; rerun `toolchain model-repo --force` (never edit by hand)"
    return PASS, f"{len(configs)} config.pbtxt without placeholders"


# ---- launch (launch_triton_server.py; tensorrtllm_backend README.md) ------------------------------------------------
@check("launch.multi-node", SERVING,
       "ranks beyond one host need a hostfile (tensorrtllm_backend README.md, Leader Mode)", paths=ENGINE_PATH)
def _multi_node(ctx: Context):
    world, g = ctx.spec.parallelism.world_size, ctx.spec.gpu
    if g.hostfile is not None and not Path(g.hostfile).is_file():
        return FAIL, f"gpu.hostfile {g.hostfile} does not exist"
    if world > g.per_node and g.hostfile is None:
        return FAIL, (f"tp x pp = {world} ranks exceed gpu.per_node {g.per_node}; list the hosts in gpu.hostfile "
                      "(or raise gpu.per_node if one host has that many GPUs), or let Slurm or Kubernetes place "
                      "the ranks: `toolchain serve SPEC --manifests DIR`")
    nodes = -(-world // g.per_node)
    return PASS, f"{world} rank(s) on {nodes} host(s)"


@check("launch.cpu-ranks", ("serve",),
       "serving.launch mpirun on CPU: one tritonserver per rank under mpirun needs mpirun and a slot (core) per rank "
       "(Open MPI 5 defaults its slots to the host's cores)")
def _cpu_ranks(ctx: Context):
    spec = ctx.spec
    if not spec.rank_processes:
        return SKIP, ("ranks run in one process (serving.launch single)" if "single" in ctx.row.launches
                      else f"not target {named(ENGINE, CPU)}")
    try:
        mpirun = cpu_mpirun()
    except ToolchainError as err:
        return FAIL, f"{err.message}; {err.hint}"
    world, cores = spec.parallelism.world_size, physical_cores()
    if world > cores and not spec.serving.oversubscribe:
        return FAIL, (f"{world} ranks but {cores} core(s), mpirun's slots here: lower tp x pp or set "
                      "serving.oversubscribe: true")
    return PASS, f"{world} rank process(es) under {mpirun} on {cores} core(s)"


def _tritonserver(ctx: Context) -> Path | None:
    explicit = ctx.spec.serving.tritonserver
    found = str(explicit) if explicit else (shutil.which("tritonserver") or DEFAULT_TRITONSERVER)
    resolved = shutil.which(found) if "/" not in found else found
    return Path(resolved) if resolved and Path(resolved).is_file() else None


@check("triton.backend-present", ("serve",),
       "the tritonserver must ship the tensorrtllm backend (TensorRT-LLM PR #15907)", paths=ENGINE_PATH,
       devices=GPU_ONLY, elsewhere=(PASS, f"target {named(ENGINE, CPU)} runs the Python backend"))
def _backend_present(ctx: Context):
    if ctx.stage == "plan":
        return SKIP, "checked on the serving host when serve starts"
    binary = _tritonserver(ctx)
    if binary is None:
        return SKIP, "no tritonserver here; serve reports it"
    backend = binary.resolve().parent.parent / "backends" / "tensorrtllm"
    need = ["libtriton_tensorrtllm.so"] + (["trtllmExecutorWorker"]
                                           if mode_of(ctx.spec.speculative.mode).adds == DRAFT_ENGINE else [])
    missing = [n for n in need if not (backend / n).is_file()]
    if missing:
        return FAIL, (f"{binary} has no {backend / missing[0]}: serve target trtllm inside the "
                      f"{TRITON_IMAGE} image (TensorRT-LLM {TRTLLM_VERSION})")
    return PASS, f"tensorrtllm backend in {backend}"


def bound_ports(spec) -> list[tuple[str, str, int]]:
    """(spec field, host, port) of every fixed port that serve and deploy bind on this host: Triton's three
    (metrics where exposure puts them) and, for target llmapi-cpu, llmapi.openai_port: both commands start the
    OpenAI server beside Triton there. A port 0 is picked free at start, so it is not listed."""
    served = endpoints(spec)
    ports = [(f"serving.{kind}_port", at.bind, at.port) for kind in TRITON_KINDS for at in [served.triton[kind]]]
    if target_of(spec).openai_beside_triton:
        ports.append(("llmapi.openai_port", served.openai.bind, served.openai.port))
    return [(field, host, port) for field, host, port in ports if port]


@check("serve.ports-free", ("serve",),
       "a stale tritonserver or another process holds the ports (launch_triton_server.py)")
def _ports(ctx: Context):
    if ctx.stage == "plan":
        return SKIP, "checked on the serving host when serve starts"
    ports = bound_ports(ctx.spec)
    # Checked together, before any server starts: on llmapi-cpu a taken OpenAI port would otherwise surface
    # only once tritonserver had loaded the model.
    fields: dict[int, str] = {}
    for field, _, port in ports:
        if port in fields:
            return FAIL, f"{fields[port]} and {field} are both {port}: give each server its own port (0 = any free one)"
        fields[port] = field
    busy = [f"{field}={port}" for field, host, port in ports if port_in_use(host, port)]
    if busy:
        return FAIL, (f"{', '.join(busy)} already in use on {ctx.spec.serving.host} (a server still running?); "
                      "stop it or pick other ports (0 = any free one)")
    return PASS, "ports free: " + ", ".join(f"{field}={port}" for field, _, port in ports)


# The Python backend gives every Python model instance its own shared-memory
# region in /dev/shm, created at `shm-default-byte-size` (1 MiB by default) and
# grown by `shm-growth-byte-size` (1 MiB) as request and response tensors pass
# through it (triton-inference-server/python_backend, README "Managing Shared
# Memory"). Docker's default /dev/shm is 64 MiB, a common cause of
# "Failed to increase the shared memory pool size" under load.
SHM_REGION_BYTES = 1 << 20
SHM_PATH = Path("/dev/shm")


def shm_needed(spec) -> tuple[int, int]:
    """(Python model instances, bytes of /dev/shm they need at full batch): a region each, plus
    token tensors of a full batch (ids and lengths in, ids out, int32) in flight through every hop."""
    s, lim, row = spec.serving, spec.limits, target_of(spec)
    cpu_engine_model = row.engine_builder is not None and row.engine_builder.python_model  # the CPU engine's tensorrt_llm
    python_models = 3 + (1 if cpu_engine_model else 0)  # pre, post, BLS (+ the CPU tensorrt_llm)
    instances = python_models * s.instance_count
    tokens = lim.max_batch_size * lim.max_seq_len * 4
    return instances, instances * SHM_REGION_BYTES + 4 * python_models * tokens


@check("serve.shm-size", ("serve",), "/dev/shm must hold the Python backend's shared-memory regions")
def _shm(ctx: Context):
    if ctx.stage == "plan":
        return SKIP, "checked on the serving host when serve starts"
    if not SHM_PATH.is_dir():
        return SKIP, f"no {SHM_PATH} on this host"
    instances, need = shm_needed(ctx.spec)
    free = shutil.disk_usage(SHM_PATH).free
    mib = 1 << 20
    if free < need:
        return FAIL, (f"{SHM_PATH} has {free // mib} MiB free, {instances} Python model instances need about "
                      f"{-(-need // mib)} MiB; in a container pass --shm-size=2g (or --ipc=host), on Kubernetes "
                      "mount an emptyDir with medium Memory at /dev/shm")
    return PASS, f"{free // mib} MiB free in {SHM_PATH} for {instances} Python model instances"


# ---- the bench workload ---------------------------------------------------------------------------------------------
@check("bench.workload-limits", ("bench",),
       "prompts and outputs must fit the engine limits (tensorrtllm_backend issue #565)")
def _workload_limits(ctx: Context):
    w, lim = ctx.spec.validation.workload, ctx.spec.limits
    longest = int(w.input_tokens + 3 * w.input_tokens_stddev)
    if longest > lim.max_input_len:
        return FAIL, (f"the workload's prompts reach {longest} tokens (mean + 3 stddev), above limits.max_input_len "
                      f"{lim.max_input_len}; shorten validation.workload.input_tokens")
    if longest + w.output_tokens > lim.max_seq_len:
        return FAIL, (f"prompt {longest} + output {w.output_tokens} tokens exceed limits.max_seq_len "
                      f"{lim.max_seq_len}; lower validation.workload.output_tokens")
    return PASS, f"prompts up to {longest} + {w.output_tokens} output tokens fit"


@check("bench.streaming", ("bench",),
       "streaming requests need decoupled models and vice versa (Triton server decoupled_models.md)")
def _bench_streaming(ctx: Context):
    w, served = ctx.spec.validation.workload, ctx.spec.serving.streaming
    if not w.protocol.startswith("triton"):
        return SKIP, f"protocol {w.protocol} talks to another server"
    if w.streaming != served:
        fix = ("set validation.workload.streaming=false" if not served else
               "set validation.workload.streaming=true (a decoupled model answers streaming requests only)")
        return FAIL, (f"validation.workload.streaming={str(w.streaming).lower()} but serving.streaming="
                      f"{str(served).lower()}: {fix}")
    return PASS, ("decoupled models, streamed over " + w.protocol) if served else "non-streaming requests"


# ---- deploy's quality gate ------------------------------------------------------------------------------------------
@check("quality.openai-endpoint", ("deploy",),
       "validation.quality is measured through an OpenAI server's echoed prompt log-probs (eval/served.py)",
       paths=ENGINE_PATH)
def _quality_needs_openai(ctx: Context):
    bounds = ctx.spec.validation.quality.bounds()
    if not bounds:
        return PASS, "no validation.quality bounds"
    return FAIL, (f"validation.quality ({', '.join(bounds)}) is measured through an OpenAI server's echoed "
                  f"log-probs, and target {ctx.spec.target} serves Triton's tensorrt_llm model only: use target "
                  "llmapi-cpu (llmapi on a GPU host), or measure an OpenAI-compatible endpoint with "
                  "`toolchain eval SPEC --endpoint URL`")
