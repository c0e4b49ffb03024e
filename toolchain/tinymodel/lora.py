"""Two tiny PEFT LoRA adapters for the embedded tiny Llama, so a multi-LoRA deployment runs on CPU.

`attn` trains the attention projections only (q/k/v/o_proj, rank 8) and `all` every projection (attention and
MLP, rank 16), each briefly fine-tuned from the tiny Llama on a short text of its own (TEXTS): a few dozen AdamW
steps, enough that the adapted model's greedy text visibly leans to its text while it stays Python-like. PEFT's
own `get_peft_model` and `save_pretrained` write them (adapter_config.json + adapter_model.safetensors, float32),
so what the toolchain converts and serves is what a user's PEFT training would hand it.

Generated, not committed: the output is a function of the committed tiny Llama, the texts, the recipe and
`SEED`, rebuilt in seconds by `make tiny-lora` (`toolchain tiny-lora`), and a no-op while provenance.json
matches. lora_alpha is twice the rank, so convert's folding of the scale into lora_B (alpha / r = 2) is
exercised rather than a scale of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from toolchain.fsutil import atomic_dir
from toolchain.remote_code import auto_tokenizer
from toolchain.tinymodel.derived import is_current, llama_config, sha256

SEED = 0
RECIPE = 1            # bump when the recipe changes, so an existing output is rebuilt
STEPS, LR, WINDOW = 40, 3e-3, 48
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
EVERY = ATTN + ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Recipe:
    name: str
    targets: tuple[str, ...]
    rank: int
    text: str

    @property
    def alpha(self) -> int:
        return 2 * self.rank


# Short texts in the corpus's own language (the tiny Llama was trained on Python), each with words of its own,
# so an adapter's pull on the greedy text is easy to see next to the base model's.
TEXTS = {
    "attn": '''def greet(name):
    """Say hello to someone by name."""
    message = "hello, " + name
    print(message)
    return message


def greet_all(names):
    for name in names:
        greet(name)


class Greeter:
    def __init__(self, greeting="hello"):
        self.greeting = greeting

    def greet(self, name):
        return self.greeting + ", " + name
''',
    "all": '''import math


def area_of_circle(radius):
    """The area of a circle of the given radius."""
    return math.pi * radius * radius


def area_of_square(side):
    return side * side


def total_area(shapes):
    total = 0.0
    for shape in shapes:
        total += shape.area()
    return total


class Square:
    def __init__(self, side):
        self.side = side

    def area(self):
        return area_of_square(self.side)
''',
}
RECIPES = (Recipe("attn", ATTN, 8, TEXTS["attn"]), Recipe("all", EVERY, 16, TEXTS["all"]))


def _provenance(src: Path) -> dict:
    import peft

    return {"source": src.name, "source_sha256": sha256((src / "model.safetensors").read_bytes()),
            "recipe": RECIPE, "seed": SEED, "steps": STEPS, "lr": LR, "window": WINDOW, "peft": peft.__version__,
            "adapters": {r.name: {"target_modules": list(r.targets), "r": r.rank, "lora_alpha": r.alpha,
                                  "text_sha256": sha256(r.text.encode())} for r in RECIPES}}


def _windows(tokenizer, text: str) -> torch.Tensor:
    """The text's token ids cut into overlapping WINDOW-long rows (stride half a window), BOS first."""
    ids = tokenizer(text)["input_ids"]
    starts = range(0, max(1, len(ids) - WINDOW + 1), WINDOW // 2)
    return torch.tensor([ids[s:s + WINDOW] for s in starts if len(ids[s:s + WINDOW]) == WINDOW])


def train_adapter(src: Path, recipe: Recipe, out: Path) -> float:
    """Fine-tune one adapter of `recipe` on the tiny Llama at `src`, save it with PEFT to `out`; the last loss."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    torch.manual_seed(SEED)
    tokenizer = auto_tokenizer(src)
    rows = _windows(tokenizer, recipe.text)
    hf_logging.disable_progress_bar()  # the command's output stays its own lines
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, trust_remote_code=False)
    config = LoraConfig(r=recipe.rank, lora_alpha=recipe.alpha, target_modules=list(recipe.targets),
                        lora_dropout=0.0, bias="none", task_type="CAUSAL_LM")
    peft_model = get_peft_model(model, config)
    peft_model.train()
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=LR)
    loss = torch.tensor(0.0)
    for _ in range(STEPS):
        loss = peft_model(input_ids=rows, labels=rows).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    peft_model.save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model-card template
    return float(loss.detach())


def build_tiny_lora(src: Path, out: Path, log: Callable[[str], None] = print) -> Path:
    """Write the adapters of RECIPES for the tiny Llama at `src` to `out`/<name>; a no-op when current."""
    src, out = Path(src), Path(out)
    llama_config(src, "make the adapters for the embedded tiny Llama, models/tiny-llama")
    provenance = _provenance(src)
    if is_current(out, provenance, src, log):
        return out
    losses = {}
    with atomic_dir(out) as tmp:
        tmp = Path(tmp)
        for recipe in RECIPES:
            losses[recipe.name] = train_adapter(src, recipe, tmp / recipe.name)
            for f in (tmp / recipe.name).iterdir():
                os.chmod(f, 0o644)  # safetensors writes 0600; a service account reads it
        (tmp / "provenance.json").write_text(json.dumps(provenance, indent=2) + "\n")
        (tmp / "README.md").write_text(
            f"# tiny-llama-lora\n\nPEFT LoRA adapters for {src.name}, made by `toolchain tiny-lora` "
            f"(toolchain/tinymodel/lora.py): "
            + "; ".join(f"`{r.name}` on {', '.join(r.targets)} (r {r.rank}, lora_alpha {r.alpha})" for r in RECIPES)
            + f"; each fine-tuned {STEPS} AdamW steps (lr {LR}, seed {SEED}) on a short text of its own. "
            "Not committed; `make tiny-lora` rebuilds it.\n")
    log(f"wrote {out}: " + ", ".join(f"{r.name} (r {r.rank}, {len(r.targets)} modules, final loss "
                                     f"{losses[r.name]:.2f})" for r in RECIPES))
    return out
