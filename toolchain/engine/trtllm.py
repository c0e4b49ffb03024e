"""Everything specific to TensorRT-LLM 1.2's `trtllm-build`: the flag table,
the command line for a spec, the version check and the engine check.

The flag table is data transcribed from TensorRT-LLM 1.x
`tensorrt_llm/commands/build.py`, `tensorrt_llm/builder.py` (BuildConfig) and
`tensorrt_llm/plugin/plugin.py` (PluginConfig): names, value sets,
defaults, and the combinations trtllm-build rejects or silently ignores. The
command builder validates its own output against it, so a spec can never
produce a flag or value the 1.2 CLI does not document.

Version check: `trtllm-build` has no `--version` flag and importing
`tensorrt_llm` initialises CUDA and prints a banner, so the version is read
with `importlib.metadata` by the interpreter named in trtllm-build's shebang
(the Python environment it will import tensorrt_llm from).
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from toolchain.errors import ToolchainError
from toolchain.quant import formats
from toolchain.speculative import DRAFT_ENGINE, mode_of
from toolchain.versions import TRITON_IMAGE, TRTLLM_LINE, TRTLLM_VERSION, in_line
from toolchain.plan.plan import build_workers, checkpoint_bytes_per_rank
from toolchain.plan.model import load_model, read_json, weight_dtype

SUPPORTED_LINE = TRTLLM_LINE
EN = ("enable", "disable")
PLUGIN = ("auto", "float16", "float32", "bfloat16", "int32", "disable")  # a dtype, auto (model dtype) or disable
# --lora_target_modules' choices: LoraManager.LORA_MODULE_IDS.keys() (tensorrt_llm/lora_manager.py @007e181b).
LORA_MODULES = ("attn_qkv", "attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_4h_to_h", "mlp_gate",
                "cross_attn_qkv", "cross_attn_q", "cross_attn_k", "cross_attn_v", "cross_attn_dense", "moe_h_to_4h",
                "moe_4h_to_h", "moe_gate", "moe_router", "mlp_router", "mlp_gate_up")


@dataclass(frozen=True)
class Flag:
    kind: str
    """path, str, int, choice, choices (one or more of `values`, argparse nargs='+') or switch (present = on,
    takes no value)."""
    values: tuple[str, ...] = ()
    default: object = None


FLAGS: dict[str, Flag] = {
    # input / output / process (tensorrt_llm/commands/build.py)
    "--checkpoint_dir": Flag("path"), "--model_config": Flag("path"), "--build_config": Flag("path"),
    "--model_cls_file": Flag("path"), "--model_cls_name": Flag("str"),
    "--output_dir": Flag("path", default="engine_outputs"), "--workers": Flag("int", default=1),
    "--log_level": Flag("choice", ("internal_error", "error", "warning", "info", "verbose", "debug", "trace"), "info"),
    "--dry_run": Flag("switch"), "--monitor_memory": Flag("switch"), "--visualize_network": Flag("path"),
    "--enable_debug_output": Flag("switch"), "--input_timing_cache": Flag("path"),
    "--output_timing_cache": Flag("path", default="model.cache"),
    "--profiling_verbosity": Flag("choice", ("layer_names_only", "detailed", "none"), "layer_names_only"),
    "--strip_plan": Flag("switch"), "--weight_sparsity": Flag("switch"), "--weight_streaming": Flag("switch"),
    "--fast_build": Flag("switch"),
    # limits (BuildConfig, tensorrt_llm/builder.py)
    "--max_batch_size": Flag("int", default=2048), "--max_input_len": Flag("int", default=1024),
    "--max_seq_len": Flag("int"), "--max_beam_width": Flag("int", default=1),
    "--max_num_tokens": Flag("int", default=8192), "--opt_num_tokens": Flag("int"),
    "--max_encoder_input_len": Flag("int", default=1024), "--max_prompt_embedding_table_size": Flag("int", default=0),
    # KV cache and attention (PluginConfig, tensorrt_llm/plugin/plugin.py)
    "--kv_cache_type": Flag("choice", ("paged", "continuous", "disabled"), "paged"),
    "--tokens_per_block": Flag("int", default=32),
    "--use_paged_context_fmha": Flag("choice", EN, "enable"), "--use_fp8_context_fmha": Flag("choice", EN, "enable"),
    "--context_fmha": Flag("choice", EN, "enable"), "--remove_input_padding": Flag("choice", EN, "enable"),
    "--gpt_attention_plugin": Flag("choice", PLUGIN, "auto"), "--multiple_profiles": Flag("choice", EN, "disable"),
    "--paged_state": Flag("choice", EN, "enable"),
    # GEMM and fusion plugins (PluginConfig)
    # No default: unset lets trtllm-build decide (nvfp4 turns it on); "disable" forces it off.
    "--gemm_plugin": Flag("choice", ("auto", "float16", "bfloat16", "float32", "int32", "fp8", "nvfp4", "disable")),
    "--gemm_swiglu_plugin": Flag("choice", ("fp8", "disable"), "disable"),
    "--fp8_rowwise_gemm_plugin": Flag("choice", PLUGIN, "disable"),
    "--low_latency_gemm_plugin": Flag("choice", ("fp8", "disable"), "disable"),
    "--low_latency_gemm_swiglu_plugin": Flag("choice", ("fp8", "disable"), "disable"),
    "--gemm_allreduce_plugin": Flag("choice", ("float16", "bfloat16", "disable"), "disable"),
    "--use_fused_mlp": Flag("choice", EN, "enable"), "--reduce_fusion": Flag("choice", EN, "disable"),
    "--user_buffer": Flag("choice", EN, "disable"), "--norm_quant_fusion": Flag("choice", EN, "disable"),
    "--pp_reduce_scatter": Flag("choice", EN, "disable"), "--fuse_fp4_quant": Flag("choice", EN, "disable"),
    "--moe_plugin": Flag("choice", PLUGIN, "auto"), "--nccl_plugin": Flag("choice", PLUGIN, "auto"),
    "--lora_plugin": Flag("choice", PLUGIN, "disable"), "--dora_plugin": Flag("choice", EN, "disable"),
    "--mamba_conv1d_plugin": Flag("choice", PLUGIN, "auto"), "--bert_attention_plugin": Flag("choice", PLUGIN, "auto"),
    # logits, LoRA, speculative decoding (tensorrt_llm/commands/build.py)
    "--logits_dtype": Flag("choice", ("float16", "float32")), "--gather_context_logits": Flag("switch"),
    "--gather_generation_logits": Flag("switch"), "--gather_all_token_logits": Flag("switch"),
    "--lora_dir": Flag("path"), "--lora_ckpt_source": Flag("choice", ("hf", "nemo"), "hf"),
    "--max_lora_rank": Flag("int", default=64), "--lora_target_modules": Flag("choices", LORA_MODULES),
    "--speculative_decoding_mode": Flag("choice", ("draft_tokens_external", "lookahead_decoding", "medusa",
                                                   "explicit_draft_tokens", "eagle")),
    "--max_draft_len": Flag("int", default=0),
}
# Flags present in 0.x but removed by 1.x (TensorRT-LLM docs/source/release-notes.md); emitting one is a bug.
REMOVED = ("--auto_parallel", "--gpus_per_node", "--cluster_key", "--enable_xqa", "--use_embedding_sharing")
LIMIT_FLAGS = ("--max_batch_size", "--max_input_len", "--max_seq_len", "--max_beam_width", "--max_num_tokens",
               "--opt_num_tokens")

# Value patterns: "*" any value given, ">0"/">1" integers above 0/1, OFF a plugin left unset or
# "disable" (PluginConfig maps both to None), else literal values.
ANY = "*"
OFF = "off"
# (flag, when, other flag, when, why): trtllm-build errors, or ignores one of them
# (tensorrt_llm/commands/build.py main, tensorrt_llm/builder.py build).
CONFLICTS: tuple[tuple[str, str, str, str, str], ...] = (
    ("--multiple_profiles", "enable", "--opt_num_tokens", ANY, "an error in trtllm-build"),
    ("--gather_context_logits", ANY, "--max_draft_len", ">0", "an error in trtllm-build"),
    ("--max_beam_width", ">1", "--speculative_decoding_mode", ANY, "beam search has no speculative mode"),
    ("--context_fmha", "disable", "--use_paged_context_fmha", "enable", "context_fmha off turns paged FMHA off"),
    ("--checkpoint_dir", ANY, "--model_config", ANY, "two inputs"),
    *(("--build_config", ANY, f, ANY, "--build_config makes trtllm-build ignore the limit flags")
      for f in LIMIT_FLAGS),
)
# (flag, when, needs flag, at value, why); an absent flag counts with its default.
REQUIRES: tuple[tuple[str, str, str, str, str], ...] = (
    ("--user_buffer", "enable", "--reduce_fusion", "enable", "user buffers need reduce fusion"),
    ("--gemm_swiglu_plugin", "fp8", "--use_fused_mlp", "enable", "the SwiGLU plugin needs the fused MLP"),
    ("--weight_streaming", ANY, "--gemm_plugin", OFF, "weight streaming runs without the GEMM plugin"),
    ("--speculative_decoding_mode", "draft_tokens_external", "--max_draft_len", ">0", "drafts need a length"),
    ("--speculative_decoding_mode", "lookahead_decoding", "--max_draft_len", ">0", "drafts need a length"),
    ("--speculative_decoding_mode", "draft_tokens_external", "--use_paged_context_fmha", "enable",
     "draft-target relies on KV reuse"),
)


class FlagError(ValueError):
    """An argument list the 1.2 flag table does not allow."""


def _matches(value: object, pattern: str) -> bool:
    if pattern == OFF:
        return value in (None, "disable")
    if value is None or value is False:
        return False
    if pattern == ANY:
        return True
    if pattern in (">0", ">1"):
        return int(value) > int(pattern[1])  # type: ignore[call-overload]  # a parsed flag: int or numeric str
    return str(value) == pattern


def parse_args(argv: list[str]) -> dict[str, object]:
    """Parse trtllm-build arguments (without the program) against the table; raise FlagError."""
    out: dict[str, object] = {}
    i = 0
    while i < len(argv):
        name = argv[i]
        flag = FLAGS.get(name)
        if flag is None:
            raise FlagError(f"{name} is not a trtllm-build {TRTLLM_LINE} flag" + (" (removed in 1.x)" if name in REMOVED
                                                                                 else ""))
        if name in out:
            raise FlagError(f"{name} given twice")
        if flag.kind == "switch":
            out[name] = True
            i += 1
            continue
        if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
            raise FlagError(f"{name} needs a value")
        if flag.kind == "choices":  # nargs='+': every value up to the next flag
            values = []
            for value in argv[i + 1:]:
                if value.startswith("--"):
                    break
                if value not in flag.values:
                    raise FlagError(f"{name} takes some of {', '.join(flag.values)}, got {value!r}")
                values.append(value)
            out[name] = tuple(values)
            i += 1 + len(values)
            continue
        value = argv[i + 1]
        if flag.kind == "int":
            if not value.lstrip("-").isdigit():
                raise FlagError(f"{name} takes an integer, got {value!r}")
            if name == "--tokens_per_block" and (int(value) < 1 or int(value) & (int(value) - 1)):
                raise FlagError(f"--tokens_per_block must be a power of 2, got {value}")
        elif flag.kind == "choice" and value not in flag.values:
            raise FlagError(f"{name} takes one of {', '.join(flag.values)}, got {value!r}")
        out[name] = int(value) if flag.kind == "int" else value
        i += 2
    return out


def validate(argv: list[str]) -> dict[str, object]:
    """parse_args plus the conflict and requirement rules; returns the parsed flags."""
    args = parse_args(argv)
    if "--checkpoint_dir" not in args and "--model_config" not in args:
        raise FlagError("one of --checkpoint_dir or --model_config is required")

    def value(name: str) -> object:
        return args.get(name, FLAGS[name].default)

    for a, when_a, b, when_b, why in CONFLICTS:
        if a in args and b in args and _matches(args[a], when_a) and _matches(args[b], when_b):
            raise FlagError(f"{a} {args[a]} with {b} {args[b]}: {why}")
    for a, when_a, b, need, why in REQUIRES:
        if a in args and _matches(args[a], when_a) and not _matches(value(b), need):
            raise FlagError(f"{a} {args[a]} needs {b} {'disable' if need == OFF else need} ({why})")
    return args


def _en(on: bool) -> str:
    return "enable" if on else "disable"


def build_flags(spec, *, draft: bool = False) -> list[tuple[str, object]]:
    """(flag, value) pairs for the spec's target (or its draft model) engine."""
    lim, b, sp = spec.limits, spec.build, spec.speculative
    # auto becomes the plugin the weight format's GEMMs need (its row's gemm_plugin); the draft is unquantized.
    needed = None if draft else formats.METHODS[spec.quantization.method].gemm_plugin
    gemm = needed if needed and b.gemm_plugin == "auto" else b.gemm_plugin
    # Written even where they equal the 1.2 defaults: inflight batching needs them
    # (TensorRT-LLM docs/source/legacy/advanced/gpt-attention.md), and the paged-FMHA
    # and tokens_per_block defaults changed between versions (tensorrt_llm/plugin/plugin.py).
    flags: list[tuple[str, object]] = [
        ("--gemm_plugin", gemm), ("--gpt_attention_plugin", "auto"), ("--remove_input_padding", "enable"),
        ("--kv_cache_type", "paged"), ("--tokens_per_block", b.tokens_per_block),
    ]
    if not b.context_fmha:
        flags.append(("--context_fmha", "disable"))
    # The draft engine is unquantized and always wants paged context FMHA
    # (TensorRT-LLM examples/draft_target_model/README.md).
    paged = b.context_fmha if draft else b.use_paged_context_fmha
    flags += [("--use_paged_context_fmha", _en(paged)),
              ("--max_batch_size", lim.max_batch_size), ("--max_input_len", lim.max_input_len),
              ("--max_seq_len", lim.max_seq_len), ("--max_num_tokens", lim.max_num_tokens)]
    if b.max_beam_width > 1:
        flags.append(("--max_beam_width", b.max_beam_width))
    if b.opt_num_tokens is not None:
        flags.append(("--opt_num_tokens", b.opt_num_tokens))
    if b.multiple_profiles:
        flags.append(("--multiple_profiles", "enable"))
    if not b.use_fused_mlp:
        flags.append(("--use_fused_mlp", "disable"))
    if b.reduce_fusion:
        flags.append(("--reduce_fusion", "enable"))
    if b.gather_context_logits and not draft:
        flags.append(("--gather_context_logits", True))
    if draft and sp.use_draft_logits:
        # The executor returns the draft's generation logits, which the BLS sends on as draft_logits, only
        # from an engine built with the flag (TensorRT-LLM examples/draft_target_model/README.md). 1.2's
        # trtllm-build calls it deprecated, but still writes it into build_config, which the runtime reads.
        flags.append(("--gather_generation_logits", True))
    if sp.mode != "none" and not draft:
        build_mode = mode_of(sp.mode).build_mode
        if build_mode is None:  # eagle3, mtp: the spec.mode-runnable check names the target to use
            raise ToolchainError(f"speculative.mode={sp.mode} has no trtllm-build mode (LLM-API path only)",
                                 "use target llmapi")
        flags.append(("--speculative_decoding_mode", build_mode))
        if sp.max_draft_len:
            flags.append(("--max_draft_len", sp.max_draft_len))
    if spec.lora.enabled and not draft:
        flags += lora_flags(spec)
    if b.log_level != "info":
        flags.append(("--log_level", b.log_level))
    return flags


def lora_flags(spec) -> list[tuple[str, object]]:
    """The LoRA plugin in the engine's dtype, the rank limit and the modules, as tensorrtllm_backend docs/lora.md
    builds it; no --lora_dir: adapters come per request or from the lora_prefetch_dir (with --lora_dir absent,
    --lora_target_modules is what names the modules: tensorrt_llm/commands/build.py build_model)."""
    from toolchain.checkpoint.lora_setup import lora_setup

    setup = lora_setup(spec.lora)
    assert setup is not None  # spec.lora.enabled
    # The plugin's dtype is the checkpoint's, written out as upstream's examples do (`auto` resolving to the model
    # dtype is the plugins' convention, UNVERIFIED for lora_plugin itself): auto only where config.json is unreadable.
    try:
        dtype = weight_dtype(spec, load_model(spec.model.checkpoint).params)
    except ToolchainError:  # convert reports it
        dtype = "auto"
    return [("--lora_plugin", dtype), ("--max_lora_rank", setup.max_lora_rank),
            ("--lora_target_modules", tuple(setup.target_modules))]


def default_workers(spec) -> int:
    """--workers: build.workers, else one per rank bounded by build.host_memory_gib (each worker
    holds a rank's weights: TensorRT-LLM tensorrt_llm/commands/build.py, parallel_build); with
    host_memory_gib unset, trtllm-build's own default of 1, never this machine's RAM, so that the
    printed line is the same on every host."""

    gib = spec.build.host_memory_gib
    if spec.build.workers or not gib:
        return spec.build.workers or 1
    try:
        sizes = checkpoint_bytes_per_rank(spec)
    except ToolchainError:  # config unreadable: convert reports it
        return 1
    return build_workers(spec, sizes, int(gib * 1024**3))[0]


def build_command(spec, checkpoint_dir: Path, output_dir: Path, binary: str = "trtllm-build", *,
                  workers: int | None = None, draft: bool = False) -> list[str]:
    """The `trtllm-build` invocation for this spec, validated against the 1.2 flag table."""
    world = 1 if draft else spec.parallelism.world_size
    if workers is None:
        workers = 1 if draft else default_workers(spec)
    pairs = [("--checkpoint_dir", str(checkpoint_dir)), ("--output_dir", str(output_dir)),
             *build_flags(spec, draft=draft), ("--workers", min(workers, world))]
    argv: list[str] = []
    for name, value in pairs:
        argv += [name] if value is True else [name, *map(str, value)] if isinstance(value, tuple) else [name, str(value)]
    try:
        validate(argv)
    except FlagError as err:
        raise ToolchainError(f"the spec makes an invalid trtllm-build command: {err}",
                             "`toolchain plan SPEC` names the check that fails") from None
    return [binary, *argv]


def mpi_command(cmd: list[str], world: int, log_dir: Path, hostfile: Path | None = None) -> list[str]:
    """Run `cmd` as `world` MPI processes (trtllm-build then builds rank == MPI rank
    in each) with one log file per rank. Each rank creates the log directory first, so the
    line runs as printed on a fresh GPU host (and on every node of a multi-node build)."""
    rank = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-${PMIX_RANK:-0}}}"
    logs = shlex.quote(str(log_dir))
    script = f'mkdir -p {logs} && exec "$0" "$@" > {logs}/rank{rank}.log 2>&1'
    host = ["--hostfile", str(hostfile)] if hostfile else []
    return ["mpirun", "--allow-run-as-root", *host, "-n", str(world), "bash", "-c", script, *cmd]


def planned_mpi(spec, world: int) -> bool:
    """Whether the printed build line runs one rank per MPI process: `auto` means every multi-rank
    build, whatever this machine's PATH holds (the Triton trtllm image ships mpirun)."""
    mode = spec.build.mpi
    return mode == "always" or (mode == "auto" and world > 1)


def use_mpi(spec, world: int) -> bool:
    """Whether build-engine runs the MPI form here: as planned, except that `auto` on a host
    without mpirun builds the ranks in one trtllm-build process (--workers) instead."""
    return planned_mpi(spec, world) and (spec.build.mpi == "always" or shutil.which("mpirun") is not None)


# ---- finding trtllm-build and its version -------------------------------------------------------------------------
VERSION_PROBE = "import importlib.metadata as m; print(m.version('tensorrt_llm'))"


def _interpreter(binary: Path) -> list[str]:
    try:
        first = binary.read_bytes()[:256].split(b"\n", 1)[0].decode(errors="replace")
    except OSError:
        first = ""
    if not first.startswith("#!"):
        return ["python3"]
    parts = shlex.split(first[2:].strip())
    return parts if parts else ["python3"]


def installed_version(binary: Path) -> str | None:
    """tensorrt_llm's version as seen by the interpreter that runs `binary`."""
    try:
        proc = subprocess.run([*_interpreter(binary), "-c", VERSION_PROBE], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (proc.stdout.strip() or None) if proc.returncode == 0 else None


def find_trtllm_build(spec, cmd: list[str]) -> str:
    """Path of a trtllm-build of the 1.2 line; a ToolchainError with the command to run otherwise."""
    wanted = str(spec.build.trtllm_build or "trtllm-build")
    binary = wanted if "/" in wanted and Path(wanted).is_file() else shutil.which(wanted)
    if binary is None:
        raise ToolchainError(
            f"{wanted} not found{' on PATH' if '/' not in wanted else ''}; this host cannot build TensorRT engines",
            f"on a GPU host with TensorRT-LLM {SUPPORTED_LINE}.x run: {shlex.join(cmd)}")
    version = installed_version(Path(binary))
    if not in_line(version):
        found = f"TensorRT-LLM {version}" if version else "no importable tensorrt_llm"
        raise ToolchainError(f"{binary} runs {found}, not the {SUPPORTED_LINE} line this toolchain targets",
                             f"use the {TRITON_IMAGE} image or pip install "
                             f"'tensorrt_llm=={TRTLLM_VERSION}', or set build.trtllm_build")
    return binary


# ---- the built engine against the spec ----------------------------------------------------------------------------
def check_engine(spec, engine_dir: Path, *, draft: bool = False, checkpoint_dir: Path | None = None) -> list[str]:
    """What in `engine_dir`/config.json disagrees with the spec (empty when nothing). With `checkpoint_dir`,
    the checkpoint it was built from, its quantization must be the one convert wrote there from the
    quantization view (quant/view.py), which is not resolved again here."""
    import json

    path = Path(engine_dir) / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        return [f"{path} missing or unreadable ({err})"]
    problems = []
    if not in_line(cfg.get("version")):
        problems.append(f"version {cfg.get('version')!r} is not TensorRT-LLM {SUPPORTED_LINE}")
    pre, bc = cfg.get("pretrained_config") or {}, cfg.get("build_config") or {}
    world = 1 if draft else spec.parallelism.world_size
    mapping = pre.get("mapping") or {}
    if mapping.get("world_size", 1) != world:
        problems.append(f"mapping.world_size {mapping.get('world_size')} != tp x pp {world}")
    missing = [f"rank{r}.engine" for r in range(world) if not (Path(engine_dir) / f"rank{r}.engine").is_file()]
    if missing:
        problems.append(f"missing {', '.join(missing)}")
    lim, b, sp = spec.limits, spec.build, spec.speculative
    draft_len = 0 if draft or sp.mode == "none" else sp.max_draft_len
    exact = {"max_batch_size": lim.max_batch_size, "max_input_len": lim.max_input_len,
             "max_beam_width": b.max_beam_width}
    for key, want in exact.items():
        if key in bc and bc[key] != want:
            problems.append(f"build_config.{key} {bc[key]} != {want}")
    # trtllm-build adds the draft length to max_seq_len and may raise max_num_tokens
    # (TensorRT-LLM tensorrt_llm/builder.py, build).
    if "max_seq_len" in bc and bc["max_seq_len"] not in (lim.max_seq_len, lim.max_seq_len + draft_len):
        problems.append(f"build_config.max_seq_len {bc['max_seq_len']} != {lim.max_seq_len}")
    if "max_num_tokens" in bc and bc["max_num_tokens"] < min(lim.max_num_tokens, lim.max_seq_len * lim.max_batch_size):
        problems.append(f"build_config.max_num_tokens {bc['max_num_tokens']} < {lim.max_num_tokens}")
    plugin = bc.get("plugin_config") or {}
    paged = b.context_fmha if draft else b.use_paged_context_fmha
    if "use_paged_context_fmha" in plugin and bool(plugin["use_paged_context_fmha"]) != paged:
        problems.append(f"plugin_config.use_paged_context_fmha {plugin['use_paged_context_fmha']} != {paged}")
    if "tokens_per_block" in plugin and plugin["tokens_per_block"] != b.tokens_per_block:
        problems.append(f"plugin_config.tokens_per_block {plugin['tokens_per_block']} != {b.tokens_per_block}")
    gather = draft and sp.use_draft_logits
    if "gather_generation_logits" in bc and bool(bc["gather_generation_logits"]) != gather:
        problems.append(f"build_config.gather_generation_logits {bc['gather_generation_logits']} != {gather}")
    if spec.lora.enabled and not draft:
        problems += _lora_problems(spec, bc)
    quant = (pre.get("quantization") or {})
    if not draft and checkpoint_dir is not None:
        written = (read_json(Path(checkpoint_dir) / "config.json") or {}).get("quantization") or {}
        for key in ("quant_algo", "kv_cache_quant_algo"):
            if quant.get(key) != written.get(key):
                problems.append(f"quantization.{key} {quant.get(key)} != {written.get(key)}")
    return problems


def _lora_problems(spec, bc: dict) -> list[str]:
    """An engine for lora: the plugin on (gptJsonConfig.cpp parseLora reads plugin_config.lora_plugin) and
    build_config.lora_config's rank and modules those the flags asked for."""
    from toolchain.checkpoint.lora_setup import lora_setup

    setup = lora_setup(spec.lora)
    assert setup is not None  # spec.lora.enabled
    if (bc.get("plugin_config") or {}).get("lora_plugin") in (None, "disable"):
        return ["plugin_config.lora_plugin is off but the spec serves LoRA"]
    lora = bc.get("lora_config") or {}
    problems = []
    if lora.get("max_lora_rank") != setup.max_lora_rank:
        problems.append(f"build_config.lora_config.max_lora_rank {lora.get('max_lora_rank')} != {setup.max_lora_rank}")
    if set(lora.get("lora_target_modules") or ()) != set(setup.target_modules):
        problems.append(f"build_config.lora_config.lora_target_modules {lora.get('lora_target_modules')} != "
                        f"{list(setup.target_modules)}")
    return problems


# ---- what the tensorrtllm backend of the 1.2 line is told --------------------------------------------------------
# tensorrt_llm model parameters (tensorrtllm_backend docs/model_config.md) whose
# documented default is a value: written explicitly, so the
# deployment does not change when a backend default does.
TRITON_DEFAULTS: dict[str, object] = {
    "kv_cache_host_memory_bytes": 0, "kv_cache_onboard_blocks": True, "iter_stats_max_iterations": 1000,
    "request_stats_max_iterations": 0, "lora_cache_optimal_adapter_size": 8, "lora_cache_max_adapter_size": 64,
    "lora_cache_gpu_memory_fraction": 0.05, "lora_cache_host_memory_bytes": 1 << 30, "gpu_weights_percent": 1.0,
    "enable_context_fmha_fp32_acc": False, "multi_block_mode": True, "cuda_graph_mode": False,
    "cuda_graph_cache_size": 0, "enable_trt_overlap": False, "speculative_decoding_fast_logits": False,
}
# tensorrt_llm model parameters left out on purpose: their default is "unset", which no value
# expresses (an unfilled ${...} is what the upstream template leaves there).
TRITON_UNSET = {
    "encoder_model_path": "encoder-decoder models only",
    "cross_kv_cache_fraction": "encoder-decoder models only",
    "max_tokens_in_paged_kv_cache": "written when serving.max_tokens_in_paged_kv_cache is set",
    "sink_token_length": "attention sinks off",
    "participant_ids": "orchestrator mode without spawning only",
    "lora_prefetch_dir": "written when lora.adapters is set: the adapters convert wrote (triton/repo.py)",
    "medusa_choices": "written for speculative.mode medusa: speculative.choices, else the tree recorded with the heads",
    "eagle_choices": "written when speculative.choices is set (else the backend's mc_sim_7b_63)",
    "lookahead_window_size": "written for speculative.mode lookahead",
    "lookahead_ngram_size": "written for speculative.mode lookahead",
    "lookahead_verification_set_size": "written for speculative.mode lookahead",
    "gpu_device_ids": "written for draft_target (orchestrator); otherwise MPI ranks place the GPUs",
    "max_attention_window_size": "unset = the engine's max_seq_len, or the sliding window in its runtime_defaults",
}


def triton_parameters(spec, medusa_choices: str | None = None) -> dict[str, object]:
    """tensorrt_llm model parameters that come from the build and speculative sections; for Medusa,
    `medusa_choices` is the draft tree the convert stage recorded (Triton's syntax)."""
    b, sp = spec.build, spec.speculative
    params: dict[str, object] = dict(TRITON_DEFAULTS)
    params.update({
        "max_beam_width": b.max_beam_width,
        "num_nodes": -(-spec.parallelism.world_size // spec.gpu.per_node),
        "decoding_mode": mode_of(sp.mode).decoding_mode or ("beam_search" if b.max_beam_width > 1 else "top_k_top_p"),
    })
    # The settings of the backend's decoding mode: the lookahead (W, N, G) it reads under isLookahead(), the
    # draft tree of Medusa's or EAGLE's (triton_backend/inflight_batcher_llm/src/model_instance_state.cc).
    decoding = params["decoding_mode"]
    if decoding == "lookahead":
        params.update(lookahead_window_size=sp.lookahead_window_size, lookahead_ngram_size=sp.lookahead_ngram_size,
                      lookahead_verification_set_size=sp.lookahead_verification_set_size)
    if decoding == "medusa":
        if medusa_choices is None:
            raise ToolchainError("speculative.mode=medusa needs the draft tree convert recorded",
                                 "run `toolchain convert SPEC` first")
        params["medusa_choices"] = medusa_choices
    if decoding == "eagle" and sp.choices:
        params["eagle_choices"] = sp.choices
    if mode_of(sp.mode).adds == DRAFT_ENGINE:  # orchestrator mode places the GPUs, not MPI ranks
        gpus = sp.target_gpu_device_ids or range(spec.parallelism.world_size)
        params["gpu_device_ids"] = ",".join(str(g) for g in gpus)
    return params
