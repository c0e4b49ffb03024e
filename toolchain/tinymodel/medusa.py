"""Medusa heads for a target model, trained on the target's own training text.

Each head is Medusa's residual block stack (x + SiLU(W x + b), `num_layers`
times) followed by its own vocabulary projection, fed the target's final
normalised hidden state at position t; head h proposes the token at t + h + 2
(the target's own lm_head proposes t + 1). The target stays frozen.

Heads learn the target's greedy choices (its argmax at t + h + 1 given the true
prefix) rather than the text: verification accepts a draft token only when it
equals the target's choice, so agreeing with the target is what pays.

The directory written is the Hugging Face layout Medusa's trainer produces and
TensorRT-LLM's converter reads (tensorrt_llm/models/medusa/weight.py,
load_medusa_hf): `medusa_lm_head.safetensors` holding `{h}.{l}.linear.weight`,
`{h}.{l}.linear.bias` and `{h}.{num_layers}.weight`, and `config.json` with
`medusa_num_heads` and `medusa_num_layers`. The config also carries the tree
measured for these heads (`medusa_choices`) and the accuracies it came from.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from toolchain.draft_tree import build_tree, choices_text
from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir
from toolchain.tinymodel.corpus import load_corpus

WEIGHTS = "medusa_lm_head.safetensors"
RECORD = "training.json"


@dataclass(frozen=True)
class HeadsRecipe:
    num_heads: int = 4
    num_layers: int = 1
    steps: int = 240
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 20
    top_k: int = 8  # candidates per head considered for the tree
    tree_size: int = 24  # draft tokens per step (the tree's nodes)
    eval_windows: int = 24
    max_files: int | None = None
    log_every: int = 20


QUICK_HEADS = HeadsRecipe(num_heads=3, steps=6, batch_size=2, seq_len=64, warmup_steps=2, top_k=4, tree_size=8,
                          eval_windows=4, max_files=40, log_every=2)


class ResBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        # Zero init: each head starts as the target's own projection of the hidden state.
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def make_heads(hidden: int, vocab: int, num_heads: int, num_layers: int, lm_head: torch.Tensor) -> nn.ModuleList:
    """Heads whose state_dict keys are Medusa's: `{h}.{l}.linear.*` and `{h}.{num_layers}.weight`."""
    heads = nn.ModuleList()
    for _ in range(num_heads):
        proj = nn.Linear(hidden, vocab, bias=False)
        with torch.no_grad():
            proj.weight.copy_(lm_head)
        heads.append(nn.Sequential(*[ResBlock(hidden) for _ in range(num_layers)], proj))
    return heads


@torch.no_grad()
def target_view(model, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's final normalised hidden states [B, T, H] and greedy choices [B, T]."""
    out = model.model(input_ids=batch)
    hidden = out.last_hidden_state
    return hidden, model.lm_head(hidden).argmax(-1)


def head_loss(heads: nn.ModuleList, hidden: torch.Tensor, choices: torch.Tensor) -> list[torch.Tensor]:
    """Cross-entropy of head h at position t against the target's choice at t + h + 1."""
    losses = []
    for h, head in enumerate(heads):
        shift = h + 1
        logits = head(hidden[:, :-shift])
        losses.append(F.cross_entropy(logits.reshape(-1, logits.size(-1)), choices[:, shift:].reshape(-1)))
    return losses


@torch.no_grad()
def topk_accuracy(model, heads: nn.ModuleList, windows: torch.Tensor, top_k: int) -> list[list[float]]:
    """acc[h][r]: how often the target's choice is head h's r-th candidate, on held-out windows."""
    hits = torch.zeros(len(heads), top_k)
    counts = torch.zeros(len(heads))
    for chunk in windows.split(8):
        hidden, choices = target_view(model, chunk)
        for h, head in enumerate(heads):
            shift = h + 1
            cand = head(hidden[:, :-shift]).topk(top_k, dim=-1).indices
            match = cand == choices[:, shift:, None]
            hits[h] += match.reshape(-1, top_k).sum(0).float()
            counts[h] += match.shape[0] * match.shape[1]
    return [[round(float(v), 4) for v in hits[h] / counts[h]] for h in range(len(heads))]


def train_medusa_heads(target_dir: Path, out_dir: Path, *, recipe: HeadsRecipe = HeadsRecipe(), seed: int = 0,
                       log: Callable[[str], None] = print) -> dict:
    """Train heads for the HF Llama-family model at `target_dir` on the stdlib corpus tokenized
    with its tokenizer; write the heads directory atomically; return the training record."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from toolchain.tinymodel.build import load_tokenizer, prepare_data
    from toolchain.tinymodel.train import eval_windows, lr_factor, sample_batch

    target_dir, out_dir = Path(target_dir), Path(out_dir)
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / RECORD).is_file():
        raise ToolchainError(f"{out_dir} is not empty and was not written by `toolchain medusa-heads`",
                             "pass an empty or new directory")
    tok = load_tokenizer(target_dir)
    # safetensors weights and transformers' own classes only: the target is a user-given directory.
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, use_safetensors=True,
                                                 trust_remote_code=False)
    model.eval().requires_grad_(False)
    cfg = model.config
    if tok.get_vocab_size() != cfg.vocab_size:
        raise ToolchainError(f"{target_dir}: tokenizer has {tok.get_vocab_size()} tokens, config {cfg.vocab_size}",
                             "point at a model written by `toolchain tiny-model`")
    corpus = load_corpus(max_files=recipe.max_files)
    _, train_stream, held_stream = prepare_data(corpus, cfg.vocab_size, log, tok)

    torch.manual_seed(seed)
    heads = make_heads(cfg.hidden_size, cfg.vocab_size, recipe.num_heads, recipe.num_layers,
                       model.lm_head.weight.detach())
    opt = torch.optim.AdamW(heads.parameters(), lr=recipe.lr, weight_decay=0.0)
    warmup = min(recipe.warmup_steps, recipe.steps // 4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, recipe.steps, warmup, 0.1))
    gen = torch.Generator().manual_seed(seed)
    n_params = sum(p.numel() for p in heads.parameters())
    log(f"medusa heads: {recipe.num_heads} x {recipe.num_layers} residual layer(s) + lm_head, "
        f"{n_params / 1e6:.2f} M parameters; {recipe.steps} steps of {recipe.batch_size} x {recipe.seq_len} tokens")
    started, ema = time.perf_counter(), None
    for step in range(1, recipe.steps + 1):
        hidden, choices = target_view(model, sample_batch(train_stream, recipe.batch_size, recipe.seq_len, gen))
        losses = head_loss(heads, hidden, choices)
        # Later heads are harder and less often reached; Medusa weighs head h by 0.8^h.
        loss = sum((0.8 ** h * part for h, part in enumerate(losses)), torch.zeros(()))  # a tensor start: 0 + t is t
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if step % recipe.log_every == 0 or step == recipe.steps:
            log(f"step {step:>4}/{recipe.steps}  loss {ema:.3f}  {time.perf_counter() - started:5.1f}s")
    train_seconds = time.perf_counter() - started
    if ema is None:  # no step ran
        raise ValueError(f"recipe.steps must be at least 1, got {recipe.steps}")
    heads.eval()
    windows = eval_windows(held_stream, recipe.eval_windows, recipe.seq_len)
    accuracy = topk_accuracy(model, heads, windows, recipe.top_k)
    tree = build_tree(accuracy, recipe.tree_size)
    for h, acc in enumerate(accuracy):
        log(f"head {h}: top-1 {acc[0]:.1%}, top-{recipe.top_k} {sum(acc):.1%} agreement with the target")
    log(f"tree of {len(tree)} nodes, {max(len(p) for p in tree)} deep, about "
        f"{expected_tokens_per_step(accuracy, tree):.2f} tokens per step: {choices_text(tree)}")

    config = {
        # Both spellings of the head count: Medusa's trainer and TensorRT-LLM's MedusaConfig differ.
        "medusa_num_heads": recipe.num_heads, "num_medusa_heads": recipe.num_heads,
        "medusa_num_layers": recipe.num_layers,
        "hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size, "hidden_act": "silu",
        "base_model_name_or_path": str(target_dir), "medusa_choices": tree,
        "heldout_topk_accuracy": accuracy,
    }
    record = {"seed": seed, "recipe": asdict(recipe), "train_seconds": round(train_seconds, 1),
              "final_loss": round(ema, 4), "heldout_tokens": int(windows.numel()),
              "command": f"toolchain medusa-heads {target_dir} {out_dir} --seed {seed} --steps {recipe.steps}"
                         f" --heads {recipe.num_heads}"}
    with atomic_dir(out_dir) as tmp:
        state = {k: v.detach().to(torch.float16).contiguous() for k, v in heads.state_dict().items()}
        save_file(state, str(tmp / WEIGHTS))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
    log(f"wrote {out_dir} ({train_seconds:.0f}s of training)")
    return {**record, "accuracy": accuracy, "tree": tree}


def expected_tokens_per_step(accuracy: list[list[float]], tree: list[list[int]]) -> float:
    """1 (the target's own token) + the summed acceptance estimates of the tree's nodes."""
    return 1.0 + sum(math.prod(accuracy[d][r] for d, r in enumerate(path)) for path in tree)
