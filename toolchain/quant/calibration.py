"""Calibration data and the activation statistics the quantizers need.

Data: the built-in set is text already on every machine, the running
interpreter's standard-library sources (the files the tiny model trained on;
every 20th file, which it holds out for evaluation, is skipped here too), so
calibration needs no download. A prompts file (`.jsonl` with one JSON string
or object with "text"/"prompt" per line, otherwise one prompt per non-blank
line) replaces it.

Statistics are collected layer by layer: the Hugging Face model is built on
the meta device, and only one decoder layer at a time gets real weights, runs
over the hidden states of every calibration sample (hooks record what enters
each linear), and is freed again. Memory holds the hidden states and one
layer, never the whole model.

This module imports nothing of the project outside toolchain.quant but its error type, which is
why the stdlib file selection mirrors `toolchain.tinymodel.corpus` here.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from typing import Callable, Iterator

import torch

from toolchain.errors import ToolchainError
from toolchain.quant import calibration_llama4
from toolchain.quant.calibration_stats import InputStats, LayerStats, finish_layer
from toolchain.quant.calibration_stats import Weights as _Weights
from toolchain.quant.recipe import BUILTIN, check_calibration_file
from toolchain.remote_code import auto_tokenizer
from toolchain.remote_code import auto_config

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
HOLDOUT_EVERY = 20
# HF module names of a Llama-family decoder layer, by the slot their input feeds.
SLOTS = {"qkv": "self_attn.q_proj", "dense": "self_attn.o_proj", "mlp": "mlp.gate_proj", "proj": "mlp.down_proj"}
KV_OUTPUTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
# Families whose HF layer fuses projections (Phi-3: qkv_proj, gate_up_proj) feed the same inputs to the
# fused module; its output holds q, k and v, so the KV amax over it is the one over q, k and v.
FUSED_SLOTS = {"qkv": "self_attn.qkv_proj", "mlp": "mlp.gate_up_proj"}
FUSED_KV_OUTPUTS = ("self_attn.qkv_proj",)


# -- data ------------------------------------------------------------------------------

def builtin_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found = sorted((p for p in root.rglob("*.py")
                    if p.is_file() and not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])),
                   key=lambda p: p.relative_to(root).as_posix())
    train = [f for i, f in enumerate(found) if i % HOLDOUT_EVERY != 0]
    if not train:
        raise ToolchainError(f"no standard-library sources under {root} for the built-in calibration set",
                             "set quantization.calibration.dataset to a prompts file")
    return train


def read_prompts(path: Path) -> list[str]:
    path = check_calibration_file(str(path))
    lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for n, line in enumerate(lines, 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as err:
            raise ToolchainError(f"quantization.calibration.dataset {path} line {n}: not JSON ({err.msg})",
                                 "write one JSON string or object with a 'text' field per line") from None
        text = item if isinstance(item, str) else (item.get("text") or item.get("prompt")
                                                   if isinstance(item, dict) else None)
        if not isinstance(text, str) or not text.strip():
            raise ToolchainError(f"quantization.calibration.dataset {path} line {n}: no text",
                                 "give each line a non-empty 'text' (or 'prompt') string")
        prompts.append(text)
    return prompts


def calibration_tokens(tokenize: Callable[[str], list[int]], dataset: str, samples: int,
                       seq_len: int) -> list[torch.Tensor]:
    """Up to `samples` 1-D int64 sequences of at most `seq_len` tokens.

    Built-in: the training files' text in a fixed spread-out order, cut into
    full `seq_len` windows. A prompts file: each prompt truncated to `seq_len`."""
    if dataset != BUILTIN:
        seqs: list[torch.Tensor] = [torch.tensor(tokenize(p)[:seq_len], dtype=torch.int64)
                                    for p in read_prompts(Path(dataset))]
        seqs = [s for s in seqs if s.numel() > 0][:samples]
        if not seqs:
            raise ToolchainError(f"quantization.calibration.dataset {dataset}: no prompt has any tokens",
                                 "give non-empty prompts")
        return seqs
    files = builtin_files()
    # A prime stride visits files from all over the library, not one package.
    order = [files[(i * 37) % len(files)] for i in range(len(files))]
    seqs = []
    for path in order:
        ids = tokenize(path.read_text(encoding="utf-8", errors="replace"))
        for start in range(0, len(ids) - seq_len + 1, seq_len):
            seqs.append(torch.tensor(ids[start:start + seq_len], dtype=torch.int64))
            if len(seqs) == samples:
                return seqs
    if not seqs:
        raise ToolchainError(f"the built-in calibration text yields no {seq_len}-token window",
                             "lower quantization.calibration.seq_len")
    return seqs


def hf_tokenizer(tokenizer_dir: Path, trust_remote_code: bool = False) -> Callable[[str], list[int]]:
    tok = auto_tokenizer(tokenizer_dir, trust_remote_code=trust_remote_code)
    tok.model_max_length = 1 << 62  # whole files are tokenized and cut into windows here: no length warning
    return lambda text: tok(text, add_special_tokens=False)["input_ids"]


# -- statistics -------------------------------------------------------------------------



def collect_stats(hf_dir: Path, sequences: list[torch.Tensor], *, covariance: bool,
                  progress: Callable[[str], None] | None = None) -> "StatsStream":
    """Per decoder layer, the input statistics of each linear slot ("qkv",
    "dense", "mlp", "proj"), from running the HF model layer by layer over
    `sequences`. Lazily: a layer is calibrated when its statistics are first
    asked for (see StatsStream)."""

    # Never the model's own code: only registered architectures are converted, and transformers has their classes.
    layers = auto_config(hf_dir, trust_remote_code=False).get_text_config().num_hidden_layers
    return StatsStream(_layer_stats(Path(hf_dir), sequences, covariance, progress), layers)


def _layer_stats(hf_dir: Path, sequences: list[torch.Tensor], covariance: bool,
                 progress: Callable[[str], None] | None) -> Iterator[LayerStats]:
    from transformers import AutoModelForCausalLM

    hf_dir = Path(hf_dir)
    config = auto_config(hf_dir, trust_remote_code=False)  # as in collect_stats: built-in classes only
    if config.get_text_config().model_type == "llama4_text":  # its own layer (feed_forward, chunked masks): calibration_llama4.py
        yield from calibration_llama4.layer_stats(hf_dir, config, sequences, covariance, progress)
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    weights = _Weights(hf_dir)
    base = model.model
    rotary = type(base.rotary_emb)(config=config)  # built on CPU: meta buffers hold no frequencies
    embed = weights.get("model.embed_tokens.weight").float()
    hidden = [embed[s][None] for s in sequences]
    del embed
    rope = [rotary(h, torch.arange(h.shape[1])[None]) for h in hidden]
    for i, layer in enumerate(base.layers):
        layer.to_empty(device="cpu")
        moe = hasattr(layer.mlp, "experts")
        state = weights.prefixed(f"model.layers.{i}.")
        layer.load_state_dict(fused_experts(state) if moe else state, strict=True)
        stats = LayerStats()
        hooks = []
        fused = hasattr(layer.self_attn, "qkv_proj")
        for slot, name in SLOTS.items():
            if moe and slot in ("mlp", "proj"):
                continue
            module = layer.get_submodule(FUSED_SLOTS.get(slot, name) if fused else name)
            width = module.in_features
            stats.inputs[slot] = InputStats(torch.zeros(width), torch.zeros(width),
                                            torch.zeros(width, width, dtype=torch.float64) if covariance else None)
            hooks.append(module.register_forward_pre_hook(lambda _m, args, s=stats.inputs[slot]: s.add(args[0])))

        if moe:  # the experts' shared input, and each expert's down-projection input over every token
            width = layer.mlp.experts.gate_up_proj.shape[-1]
            stats.inputs["mlp"] = InputStats(torch.zeros(width), torch.zeros(width),
                                             torch.zeros(width, width, dtype=torch.float64) if covariance else None)
            if covariance:
                count, inner = layer.mlp.experts.gate_up_proj.shape[:2]
                stats.expert_proj = [InputStats(torch.zeros(inner // 2), torch.zeros(inner // 2),
                                                torch.zeros(inner // 2, inner // 2, dtype=torch.float64))
                                     for _ in range(count)]

            def experts_hook(m, args, st=stats) -> None:  # returns None: the block's input stays as it is
                st.inputs["mlp"].add(args[0])
                _expert_amax(m.experts, args[0], st)
            hooks.append(layer.mlp.register_forward_pre_hook(experts_hook))

        def kv_hook(_m, _args, out, st=stats):
            st.qkv_amax = max(st.qkv_amax, float(out.detach().abs().max()))
        hooks += [layer.get_submodule(n).register_forward_hook(kv_hook)
                  for n in (FUSED_KV_OUTPUTS if fused else KV_OUTPUTS)]
        with torch.no_grad():
            hidden = [layer(h, position_embeddings=pe, attention_mask=None) for h, pe in zip(hidden, rope, strict=False)]
        finish_layer(layer, hooks, i + 1, len(base.layers), progress)
        yield stats


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One MoE decoder layer's tensors as a checkpoint stores them (one tensor per expert: Mixtral's
    block_sparse_moe.experts.{e}.w1/w3/w2 and .gate, Qwen MoE's mlp.experts.{e}.gate_proj/up_proj/down_proj)
    -> transformers 5's layer, which holds the experts as mlp.experts.gate_up_proj [E, 2 I, H] (gate rows,
    then up rows: MixtralExperts.forward chunks gate before up) and down_proj [E, H, I]. Tensors already
    fused pass through; the strict load after this names anything left over."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {"gate": {}, "up": {}, "down": {}}
    names = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    for name, t in state.items():
        bits = name.split(".")
        if len(bits) == 5 and bits[1] == "experts" and bits[2].isdigit() and bits[3] in names:
            parts[names[bits[3]]][int(bits[2])] = t
        else:
            out[name.replace("block_sparse_moe.", "mlp.", 1)] = t
    if parts["gate"]:
        count = len(parts["gate"])
        out["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([parts["gate"][e], parts["up"][e]])
                                                       for e in range(count)])
        out["mlp.experts.down_proj"] = torch.stack([parts["down"][e] for e in range(count)])
    return out


def _expert_amax(experts, x: torch.Tensor, st: LayerStats) -> None:
    """Every expert's down-projection input on every token (not only the tokens the router sends it), so an
    expert the calibration text rarely picks still gets an activation scale (and, for AWQ, its statistics in
    `st.expert_proj`); the layer's output is unchanged."""
    x = x.detach().reshape(-1, x.shape[-1]).float()
    amax = []
    for e in range(experts.gate_up_proj.shape[0]):
        gate, up = (x @ experts.gate_up_proj[e].T).chunk(2, dim=-1)
        y = experts.act_fn(gate) * up
        amax.append(float(y.abs().max()))
        if st.expert_proj:
            st.expert_proj[e].add(y)
    st.expert_proj_amax = [max(a, b) for a, b in zip(st.expert_proj_amax, amax, strict=True)] \
        if st.expert_proj_amax else amax


class StatsStream:
    """Layer statistics, calibrated on demand in layer order.

    The converter writes layer by layer in increasing order, so asking for
    layer i runs calibration up to i, and the second-moment matrices (AWQ's
    `xtx`, in × in float64 per linear input) of the layers before i are
    dropped: they are the bulk of the memory (about 2 GB per Llama-3-8B layer,
    65 GB for all 32), and only one layer's are alive at a time. The small
    per-channel vectors and the KV amax stay for every layer (the KV scales are
    written last). Asking for an earlier layer's matrix afterwards fails loudly."""

    def __init__(self, layers: Iterator[LayerStats], count: int):
        self._layers, self._count = layers, count
        self._have: list[LayerStats] = []
        self._front = 0  # layers below this one have had their matrices dropped

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> LayerStats:
        if not 0 <= i < self._count:
            raise IndexError(i)
        while len(self._have) <= i:
            self._have.append(next(self._layers))
        for j in range(self._front, i):
            for st in self._have[j].inputs.values():
                st.xtx = None
        self._front = max(self._front, i)
        return self._have[i]

    def __iter__(self) -> Iterator[LayerStats]:
        return (self[i] for i in range(self._count))
