"""What a spec's `lora` section resolves to: each adapter's rank, modules and tensor shapes (read from its
adapter_config.json and its safetensors header, no tensor loaded), the engine's max_lora_rank and its
lora_target_modules. Every stage reads the one `LoraSetup` rather than the adapters' files.

Upstream rules: with no --lora_target_modules the modules come from the adapters (tensorrt_llm/lora_manager.py
@007e181b `load_hf_lora`, which reads the first --lora_dir), and any of attn_q/attn_k/attn_v brings the other two
(`get_missing_qkv_modules_from_lora_modules`, tensorrt_llm/lora_helper.py @037d4ba1: "q_lora_params, k_lora_params
and v_lora_params should be all enabled or all disabled at the same time"); a rank may equal max_lora_rank
(loraUtils.cpp @2a9abd95 checks adapterSize <= maxAdapterSize).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from safetensors import safe_open

from toolchain.checkpoint.lora import (ADAPTER_WEIGHTS, LLAMA_HF_TO_TRTLLM, LORA_MODULE_IDS, NOT_SPLIT, ROW_PARALLEL,
                                       _refuse, lora_scale, paired, read_adapter_config, weights_file)
from toolchain.errors import ToolchainError
from toolchain.spec_lora import LoraSection

QKV = ("attn_q", "attn_k", "attn_v")


@dataclass(frozen=True)
class AdapterInfo:
    name: str
    task_id: int
    """LoRA task id (engine path) and lora_int_id (LLM API)."""
    path: Path
    rank: int
    scale: float
    """PEFT's lora_alpha / r (or / sqrt(r) with use_rslora), folded into lora_B by convert."""
    shapes: Mapping[tuple[int, str], tuple[tuple[int, int], tuple[int, int]]]
    """(layer, TRT-LLM module) -> (lora_A shape [r, in], lora_B shape [out, r])."""

    @property
    def modules(self) -> tuple[str, ...]:
        return tuple(sorted({m for _, m in self.shapes}, key=LORA_MODULE_IDS.__getitem__))

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({layer for layer, _ in self.shapes}))


@dataclass(frozen=True)
class LoraSetup:
    adapters: tuple[AdapterInfo, ...]
    max_lora_rank: int
    target_modules: tuple[str, ...]
    """The engine's lora_target_modules in module-id order, q/k/v completed."""

    def adapter(self, name: str) -> AdapterInfo:
        for a in self.adapters:
            if a.name == name:
                return a
        raise ToolchainError(f"no LoRA adapter named {name!r}",
                             f"name one of lora.adapters: {', '.join(a.name for a in self.adapters) or 'none'}")

    def by_task_id(self, task_id: int) -> AdapterInfo | None:
        return next((a for a in self.adapters if a.task_id == task_id), None)


def with_missing_qkv(modules) -> tuple[str, ...]:
    """`modules` plus the q/k/v siblings upstream adds, in module-id order."""
    out = set(modules)
    if out & set(QKV):
        out |= set(QKV)
    return tuple(sorted(out, key=LORA_MODULE_IDS.__getitem__))


def adapter_info(name: str, task_id: int, path: Path,
                 hf_to_trtllm: Mapping[str, str] = LLAMA_HF_TO_TRTLLM) -> AdapterInfo:
    """One adapter's rank, scale and tensor shapes, refused in one line as `lora.read_adapter` refuses it."""
    path = Path(path)
    if not path.is_dir():
        raise ToolchainError(f"LoRA adapter {name!r}: {path} is not a directory",
                             "set lora.adapters.<name> to the directory PEFT's save_pretrained wrote")
    config = read_adapter_config(path, hf_to_trtllm)
    weights = weights_file(path)
    try:
        with safe_open(str(weights), framework="pt") as f:
            items = [(key, tuple(f.get_slice(key).get_shape())) for key in f.keys()]  # noqa: SIM118 (not a mapping)
    except Exception as e:  # safetensors' own SafetensorError, OSError
        raise _refuse(path, f"{ADAPTER_WEIGHTS} is not readable ({type(e).__name__})", "save the adapter again") from None
    shapes = {}
    rank = config["r"]
    for (layer, module), (a, b) in sorted(paired(path, items, hf_to_trtllm).items()):
        if len(a) != 2 or len(b) != 2 or a[0] != rank or b[1] != rank:
            raise _refuse(path, f"layer {layer} {module}: lora_A {list(a)} / lora_B {list(b)} do not fit rank {rank}",
                          "save the adapter again with PEFT")
        shapes[(layer, module)] = ((a[0], a[1]), (b[0], b[1]))
    return AdapterInfo(name, task_id, path, rank, lora_scale(config), shapes)


def lora_setup(section: LoraSection) -> LoraSetup | None:
    """The section resolved against its adapters' files; None when the spec serves no LoRA."""
    if not section.enabled:
        return None
    return setup_of(section, tuple(adapter_info(name, section.task_id(name), path)
                                   for name, path in section.adapters.items()))


def setup_of(section: LoraSection, adapters: tuple[AdapterInfo, ...]) -> LoraSetup:
    """The engine's rank limit and modules from the section and its adapters, already read."""
    largest = max((a.rank for a in adapters), default=0)
    max_rank = section.max_lora_rank if section.max_lora_rank is not None else largest
    trained = {m for a in adapters for m in a.modules}
    modules = with_missing_qkv(section.target_modules if section.target_modules is not None else trained)
    return LoraSetup(adapters, max_rank, modules)


def setup_problems(setup: LoraSetup, dims: Mapping[str, tuple[int, int]], num_layers: int, tp: int) -> list[str]:
    """Why the adapters cannot be served by this base at this tp, one line each (empty when they can): a rank above
    max_lora_rank, a module the engine does not carry or the family lacks, shapes of another base, a dim tp does
    not split. `dims` is each module's (in, out) for the base (`lora.module_dims`)."""
    problems = []
    unknown = sorted(set(setup.target_modules) - set(dims), key=LORA_MODULE_IDS.__getitem__)
    if unknown:
        problems.append(f"lora target modules {list(unknown)} are not LoRA modules of this model (it has "
                        f"{sorted(dims, key=LORA_MODULE_IDS.__getitem__)})")
    for a in setup.adapters:
        if a.rank > setup.max_lora_rank:
            problems.append(f"LoRA adapter {a.name!r} has rank {a.rank}, above lora.max_lora_rank "
                            f"{setup.max_lora_rank}; raise max_lora_rank or drop the adapter")
        extra = sorted(set(a.modules) - set(setup.target_modules), key=LORA_MODULE_IDS.__getitem__)
        if extra:
            problems.append(f"LoRA adapter {a.name!r} trains {extra}, which lora.target_modules "
                            f"{list(setup.target_modules)} leaves out; add them or drop the adapter")
        for (layer, module), (a_shape, b_shape) in sorted(a.shapes.items()):
            if layer >= num_layers:
                problems.append(f"LoRA adapter {a.name!r} has layer {layer} but the base model has {num_layers} "
                                "layers: it was trained for another base model")
                break
            if module not in dims:
                continue
            d_in, d_out = dims[module]
            if (a_shape[1], b_shape[0]) != (d_in, d_out):
                problems.append(f"LoRA adapter {a.name!r} layer {layer} {module} is {a_shape[1]} -> {b_shape[0]} but "
                                f"the base model's is {d_in} -> {d_out}: it was trained for another base model")
                break
            if module not in NOT_SPLIT and tp > 1:
                split = d_in if module in ROW_PARALLEL else d_out
                if split % tp:
                    problems.append(f"LoRA adapter {a.name!r} {module}: its {'in' if module in ROW_PARALLEL else 'out'} "
                                    f"dim {split} does not split over tp {tp}; use a tp that divides it")
                    break
    return problems
