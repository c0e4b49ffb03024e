"""A tiny Mixtral "upcycled" from the embedded tiny Llama, so a mixture-of-experts model deploys on CPU.

Every layer's trained MLP becomes `EXPERTS` experts: each a copy of it with a small multiplicative noise of its
own, behind a router of small random weights that picks `TOP_K` of them per token. Mixtral's routing
renormalizes the k weights to sum to one (archs/mixtral.py), so a layer's output is a weighted mean of k
near-copies of the trained MLP: the model still writes what the tiny Llama writes (its greedy text is
meaningful), while the experts differ enough that which rank holds which expert matters to the numbers.
Attention, norms, embeddings and the tokenizer are the tiny Llama's, unchanged.

Generated, not committed: four experts of the 768-wide MLP make ~22 MB in float16, more than the repository
should carry for a derivative of weights it already holds. The output is a pure function of the committed
tiny Llama and `SEED` (torch's CPU generator), so `make tiny-mixtral` (`toolchain tiny-mixtral`) rebuilds the
same bytes anywhere, and is a no-op while provenance.json matches the source and this recipe.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from toolchain.fsutil import atomic_dir
from toolchain.tinymodel.derived import is_current, llama_config, sha256

EXPERTS, TOP_K = 4, 2
NOISE = 0.05          # relative std of each expert's multiplicative noise
ROUTER_STD = 0.5      # std of the router's weights: RMS-normed hidden states give logits spread over the experts
SEED = 0
RECIPE = 1            # bump when the recipe changes, so an existing output is rebuilt
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}  # HF Llama -> HF Mixtral expert names


def _provenance(src: Path) -> dict:
    return {"source": src.name, "source_sha256": sha256((src / "model.safetensors").read_bytes()), "recipe": RECIPE,
            "experts": EXPERTS, "top_k": TOP_K, "noise": NOISE, "router_std": ROUTER_STD, "seed": SEED}


def mixtral_config(llama_cfg: dict) -> dict:
    """The tiny Llama's config.json as a MixtralForCausalLM with EXPERTS experts of its MLP's width."""
    cfg = {k: v for k, v in llama_cfg.items() if k not in ("mlp_bias", "pretraining_tp", "attention_bias")}
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=EXPERTS,
               num_experts_per_tok=TOP_K, router_aux_loss_coef=0.0, output_router_logits=False,
               sliding_window=None)
    return cfg


def upcycle_weights(weights: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """The Llama's tensors with every layer's MLP replaced by a router and EXPERTS noisy copies of it."""
    g = torch.Generator().manual_seed(SEED)
    out = {k: v for k, v in weights.items() if ".mlp." not in k}
    for i in range(layers):
        mlp = {name: weights[f"model.layers.{i}.mlp.{name}.weight"].float() for name in MLP}
        hidden = mlp["gate_proj"].shape[1]
        moe = f"model.layers.{i}.block_sparse_moe"
        router = torch.randn(EXPERTS, hidden, generator=g) * ROUTER_STD / hidden ** 0.5
        out[f"{moe}.gate.weight"] = router.to(weights[f"model.layers.{i}.mlp.gate_proj.weight"].dtype)
        for e in range(EXPERTS):
            for name, short in MLP.items():
                w = mlp[name]
                noisy = w * (1 + NOISE * torch.randn(w.shape, generator=g))
                out[f"{moe}.experts.{e}.{short}.weight"] = noisy.to(weights[f"model.layers.{i}.mlp.{name}.weight"].dtype)
    return out


def build_tiny_mixtral(src: Path, out: Path, log: Callable[[str], None] = print) -> Path:
    """Write the upcycled tiny Mixtral of `src` (a tiny-Llama directory) to `out`; a no-op when current."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src), Path(out)
    llama_cfg = llama_config(src, "upcycle the embedded tiny Llama, models/tiny-llama")
    provenance = _provenance(src)
    if is_current(out, provenance, src, log):
        return out
    weights = load_file(str(src / "model.safetensors"))
    moe = upcycle_weights(weights, llama_cfg["num_hidden_layers"])
    with atomic_dir(out) as tmp:
        tmp = Path(tmp)
        save_file({k: v.contiguous() for k, v in sorted(moe.items())}, str(tmp / "model.safetensors"),
                  metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(mixtral_config(llama_cfg), indent=2) + "\n")
        for name in COPIED:
            if (src / name).is_file():
                (tmp / name).write_bytes((src / name).read_bytes())
        os.chmod(tmp / "model.safetensors", 0o644)  # safetensors writes 0600; a service account reads it
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        (tmp / "README.md").write_text(
            f"# tiny-mixtral\n\nMixtralForCausalLM upcycled from {src.name} by `toolchain tiny-mixtral` "
            f"(toolchain/tinymodel/upcycle.py): each layer's trained MLP copied into {EXPERTS} experts with "
            f"{NOISE:.0%} multiplicative noise, a random router (std {ROUTER_STD}/sqrt(hidden)), top-{TOP_K} "
            f"routing, seed {SEED}. Not committed; `make tiny-mixtral` rebuilds it.\n")
    log(f"wrote {out} ({EXPERTS} experts, top-{TOP_K}, "
        f"{os.path.getsize(out / 'model.safetensors') / 2**20:.1f} MiB)")
    return out
