"""PEFT adapters made by PEFT itself on a tiny base model the tests built (never downloaded)."""

from __future__ import annotations

from pathlib import Path

import torch


def make_peft_adapter(base: Path, out: Path, targets: list[str], *, seed: int = 0, r: int = 4,
                      alpha: int = 8) -> Path:
    """Save a random LoRA adapter (A and B both random: init_lora_weights=False) for the HF model at `base`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    peft_model = get_peft_model(model, LoraConfig(init_lora_weights=False, r=r, lora_alpha=alpha,
                                                  target_modules=targets))
    with torch.no_grad():  # a visible effect on a base whose weights conftest scaled up
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.mul_(4.0)
    peft_model.save_pretrained(out)
    return Path(out)
