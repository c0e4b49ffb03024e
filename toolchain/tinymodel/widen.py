"""A wider copy of a trained Llama checkpoint that computes like a bigger model and answers like the original.

Speculative decoding and the distributed ranks pay off only where the target's forward dominates, as a real
target's does; the embedded tiny model's is too cheap on a CPU. `widen_target` widens every MLP with zero units
and appends layers whose output projections are zero: every added unit is computed, so a forward costs what
the larger model's does, while the function (and the acceptance of drafts trained for the original) stays the
trained model's. The benchmarks make their targets with it (benchmarks/speculative.py, benchmarks/distributed.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch


def widen_target(src: Path, out: Path, *, extra_layers: int, intermediate: int) -> Path:
    """src's model with zero-output extra layers and zero-padded MLP units (see the module doc)."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((src / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(src / "model.safetensors").items()}
    layers, inter, hidden = cfg["num_hidden_layers"], cfg["intermediate_size"], cfg["hidden_size"]
    g = torch.Generator().manual_seed(0)
    out_w = dict(w)
    for i in range(layers):  # zero units: silu(0) * 0 adds nothing through a zero down column
        p = f"model.layers.{i}.mlp."
        out_w[p + "gate_proj.weight"] = torch.cat([w[p + "gate_proj.weight"], torch.zeros(intermediate - inter, hidden)])
        out_w[p + "up_proj.weight"] = torch.cat([w[p + "up_proj.weight"], torch.zeros(intermediate - inter, hidden)])
        out_w[p + "down_proj.weight"] = torch.cat([w[p + "down_proj.weight"], torch.zeros(hidden, intermediate - inter)],
                                                  dim=1)
    template = "model.layers.0."
    for j in range(layers, layers + extra_layers):  # real compute, zero contribution to the residual
        for name, t in w.items():
            if name.startswith(template):
                new = f"model.layers.{j}." + name[len(template):]
                shape = out_w[name].shape
                out_w[new] = torch.randn(shape, generator=g) * 0.02 if t.dim() == 2 else torch.ones(shape)
        out_w[f"model.layers.{j}.self_attn.o_proj.weight"].zero_()
        out_w[f"model.layers.{j}.mlp.down_proj.weight"].zero_()
    out.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in out_w.items()}, str(out / "model.safetensors"))
    cfg.update(num_hidden_layers=layers + extra_layers, intermediate_size=intermediate, dtype="float32")
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_bytes((src / name).read_bytes())
    return out
