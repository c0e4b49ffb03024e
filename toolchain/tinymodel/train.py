"""Model shape, training loop and held-out evaluation.

Training runs a fixed number of optimizer steps with a seeded init and a
seeded batch order, so a seed names one set of weights (on a given machine
and thread count); a wall-clock budget would make the result depend on load.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Recipe:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    seq_len: int
    batch_size: int
    steps: int
    warmup_steps: int
    eval_windows: int
    log_every: int
    max_files: int | None = None
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # grouped-query attention, so GQA paths downstream get exercised
    max_position_embeddings: int = 1024
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0


# ~4.2 M parameters: 8.4 MB in fp16, so the shipped directory stays under 9 MB.
FULL = Recipe(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
              seq_len=256, batch_size=16, steps=320, warmup_steps=30, eval_windows=48, log_every=10)
# ~0.9 M parameters (1.8 MB in fp16): a draft for FULL, trained the same way with FULL's tokenizer.
DRAFT = Recipe(vocab_size=4096, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
               seq_len=256, batch_size=16, steps=320, warmup_steps=30, eval_windows=48, log_every=10)
QUICK = Recipe(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               seq_len=64, batch_size=4, steps=6, warmup_steps=2, eval_windows=4, log_every=2, max_files=40)


def make_config(recipe: Recipe, vocab_size: int, bos_id: int, eos_id: int, pad_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=recipe.hidden_size, intermediate_size=recipe.intermediate_size,
        num_hidden_layers=recipe.num_hidden_layers, num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads, max_position_embeddings=recipe.max_position_embeddings,
        tie_word_embeddings=True, bos_token_id=bos_id, eos_token_id=eos_id, pad_token_id=pad_id)


def init_model(config, seed: int):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to `min_ratio` at the last step."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(model, recipe: Recipe) -> torch.optim.Optimizer:
    # Norm gains are not decayed: pulling them to zero only fights the norm.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=recipe.lr, betas=recipe.betas)


def sample_batch(stream: torch.Tensor, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(stream) - seq_len + 1, (batch_size,), generator=gen)
    return stream[starts[:, None] + torch.arange(seq_len)]


def train_model(model, stream: torch.Tensor, recipe: Recipe, steps: int, seed: int,
                log: Callable[[str], None]) -> float:
    """Run `steps` AdamW steps on random windows of `stream`; return the final
    smoothed training loss."""
    gen = torch.Generator().manual_seed(seed)
    opt = make_optimizer(model, recipe)
    warmup = min(recipe.warmup_steps, steps // 4)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, steps, warmup, recipe.min_lr_ratio))
    model.train()
    ema, start = None, time.perf_counter()
    for step in range(1, steps + 1):
        batch = sample_batch(stream, recipe.batch_size, recipe.seq_len, gen)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        opt.step()
        sched.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % recipe.log_every == 0 or step == steps:
            elapsed = time.perf_counter() - start
            rate = step * recipe.batch_size * recipe.seq_len / elapsed
            log(f"step {step:>4}/{steps}  loss {ema:.3f}  lr {sched.get_last_lr()[0]:.2e}  "
                f"{rate:,.0f} tok/s  {elapsed:5.1f}s")
    model.eval()
    if ema is None:  # no step ran
        raise ValueError(f"steps must be at least 1, got {steps}")
    return ema


def eval_windows(stream: torch.Tensor, count: int, seq_len: int) -> torch.Tensor:
    """`count` non-overlapping windows spread evenly over `stream`: a fixed
    subset, independent of the seed, so runs compare on the same tokens."""
    fit = len(stream) // seq_len
    if fit == 0:
        raise ValueError(f"held-out stream of {len(stream)} tokens is shorter than one window ({seq_len})")
    count = min(count, fit)
    starts = torch.linspace(0, len(stream) - seq_len, count).long()
    return stream[starts[:, None] + torch.arange(seq_len)]


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token NLL) over every predicted position of `windows`."""
    total, count = 0.0, 0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk).logits[:, :-1].float()
        targets = chunk[:, 1:]
        total += F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), reduction="sum").item()
        count += targets.numel()
    return math.exp(total / count)
