"""Corpus -> tokenizer -> trained model -> a complete Hugging Face directory."""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from toolchain.errors import ToolchainError
from toolchain.fsutil import atomic_dir
from toolchain.tinymodel.corpus import Corpus, load_corpus, read_text
from toolchain.tinymodel.tokenizer import BOS, EOS, PAD, encode_documents, save_tokenizer, train_tokenizer
from toolchain.tinymodel.train import (DRAFT, FULL, QUICK, Recipe, eval_windows, init_model, make_config, perplexity,
                                       train_model)

RECORD = "training.json"
SAMPLE_PROMPT = "def "


def check_out_dir(out_dir: Path) -> None:
    """Only a previous tiny-model output may be replaced: the rename would
    otherwise silently delete whatever the user had there."""
    if out_dir.exists() and not out_dir.is_dir():
        raise ToolchainError(f"{out_dir} exists and is not a directory", "pass a new directory name")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not (out_dir / RECORD).is_file():
        raise ToolchainError(f"{out_dir} is not empty and was not written by `toolchain tiny-model`",
                             "pass an empty or new directory")


def build_tiny_model(out_dir: Path, *, seed: int = 0, steps: int | None = None, quick: bool = False,
                     draft_of: Path | None = None, log: Callable[[str], None] = print) -> dict:
    """Train the tiny Llama and write it to `out_dir` (atomically); return the
    training record also saved as training.json. `draft_of`: train a smaller draft model
    for speculative decoding with that model's tokenizer, so the two share a vocabulary."""
    out_dir = Path(out_dir)
    check_out_dir(out_dir)
    tokenizer = load_tokenizer(Path(draft_of)) if draft_of is not None else None
    recipe = QUICK if quick else DRAFT if draft_of is not None else FULL
    steps = steps if steps is not None else recipe.steps
    if steps < 1:
        raise ToolchainError(f"--steps must be at least 1, got {steps}")

    corpus = load_corpus(max_files=recipe.max_files)
    log(corpus.describe())
    tok, train_stream, held_stream = prepare_data(corpus, recipe.vocab_size, log, tokenizer)
    model = init_model(make_config(recipe, tok.get_vocab_size(), *(tok.token_to_id(t) for t in (BOS, EOS, PAD))),
                       seed)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters, "
        f"{recipe.num_attention_heads} query / {recipe.num_key_value_heads} KV heads; "
        f"training {steps} steps of {recipe.batch_size} x {recipe.seq_len} tokens (seed {seed}, "
        f"{torch.get_num_threads()} threads)")
    started = time.perf_counter()
    final_loss = train_model(model, train_stream, recipe, steps, seed, log)
    train_seconds = time.perf_counter() - started
    round_to_fp16(model)

    record = {
        "seed": seed, "steps": steps, "quick": quick,
        "command": reproduce_command(out_dir, seed, steps, quick, draft_of),
        "draft_of": str(draft_of) if draft_of is not None else None,
        "corpus": corpus.describe(), "train_files": len(corpus.train), "heldout_files": len(corpus.heldout),
        "train_tokens": len(train_stream), "heldout_tokens": len(held_stream),
        "batch_size": recipe.batch_size, "seq_len": recipe.seq_len, "lr": recipe.lr,
        "final_train_loss": round(final_loss, 4), **evaluate(model, tok, held_stream, recipe, log),
        "train_seconds": round(train_seconds, 1), **environment(),
    }
    with atomic_dir(out_dir) as tmp:
        save_model(model, tok, recipe, tmp)
        (tmp / RECORD).write_text(json.dumps(record, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(record))
        make_readable(tmp)
    log(f"wrote {out_dir} in {train_seconds:.0f}s of training")
    return record


def evaluate(model, tok, held_stream: torch.Tensor, recipe: Recipe, log: Callable[[str], None]) -> dict:
    windows = eval_windows(held_stream, recipe.eval_windows, recipe.seq_len)
    ppl = perplexity(model, windows)
    vocab = model.config.vocab_size
    log(f"held-out perplexity {ppl:.2f} on {windows.numel():,} tokens (uniform model: {vocab})")
    sample = greedy_sample(model, tok)
    log(f"greedy sample from {SAMPLE_PROMPT!r}:\n{sample}")
    return {"heldout_eval_tokens": windows.numel(), "heldout_perplexity": round(ppl, 3),
            "uniform_perplexity": vocab, "greedy_sample": {"prompt": SAMPLE_PROMPT, "text": sample}}


def environment() -> dict:
    """What the same-seed-same-weights promise depends on."""
    return {"threads": torch.get_num_threads(), "python": sys.version.split()[0], "torch": torch.__version__,
            "machine": platform.machine(), "weights_dtype": "float16"}


def load_tokenizer(model_dir: Path):
    """The tokenizer of a model written by this command (for its draft)."""
    from tokenizers import Tokenizer

    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise ToolchainError(f"--draft-of {model_dir}: no tokenizer.json there",
                             "point it at a model written by `toolchain tiny-model` (e.g. models/tiny-llama)")
    tok = Tokenizer.from_file(str(path))
    missing = [t for t in (BOS, EOS, PAD) if tok.token_to_id(t) is None]
    if missing:
        raise ToolchainError(f"--draft-of {model_dir}: its tokenizer lacks {', '.join(missing)}",
                             "point it at a model written by `toolchain tiny-model`")
    return tok


def prepare_data(corpus: Corpus, vocab_size: int, log: Callable[[str], None], tokenizer=None):
    """Tokenized training and held-out streams; the tokenizer is trained to `vocab_size` unless given."""
    started = time.perf_counter()
    train_texts = [read_text(p) for p in corpus.train]
    held_texts = [read_text(p) for p in corpus.heldout]
    tok = tokenizer if tokenizer is not None else train_tokenizer(train_texts, vocab_size)
    train_stream = torch.tensor(encode_documents(tok, train_texts), dtype=torch.long)
    held_stream = torch.tensor(encode_documents(tok, held_texts), dtype=torch.long)
    log(f"tokenizer: {tok.get_vocab_size()} tokens; {len(train_stream):,} training and {len(held_stream):,} "
        f"held-out tokens ({time.perf_counter() - started:.1f}s)")
    return tok, train_stream, held_stream


def round_to_fp16(model) -> None:
    """Round the weights to what is shipped (fp16), keeping fp32 compute, so
    the reported perplexity is the saved model's."""
    model.to(torch.float16).to(torch.float32)


@torch.no_grad()
def greedy_sample(model, tok, max_new_tokens: int = 48) -> str:
    ids = torch.tensor([tok.encode(SAMPLE_PROMPT).ids])
    out = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                         pad_token_id=tok.token_to_id(PAD), eos_token_id=tok.token_to_id(EOS))
    return tok.decode(out[0].tolist(), skip_special_tokens=True)


def save_model(model, tok, recipe: Recipe, out: Path) -> None:
    from transformers.utils import logging as hf_logging

    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = (tok.token_to_id(t) for t in (BOS, EOS, PAD))
    # a progress bar for one small shard is noise in the command's output
    hf_logging.disable_progress_bar()
    try:
        model.to(torch.float16).save_pretrained(out)
    finally:
        hf_logging.enable_progress_bar()
    save_tokenizer(tok, out, recipe.max_position_embeddings)


def make_readable(out: Path) -> None:
    """The temporary directory is created private (0700); the model is meant
    to be read by other users and services, e.g. a Triton server."""
    out.chmod(0o755)
    for path in out.iterdir():
        path.chmod(0o644)


def reproduce_command(out_dir: Path, seed: int, steps: int, quick: bool, draft_of: Path | None = None) -> str:
    return (f"toolchain tiny-model {out_dir} --seed {seed} --steps {steps}" + (" --quick" if quick else "")
            + (f" --draft-of {draft_of}" if draft_of is not None else ""))


def model_card(record: dict) -> str:
    purpose = ("A `--quick` smoke-test build: far too little training to be useful." if record["quick"] else
               f"The draft model of {record['draft_of']} for draft-target speculative decoding: the same corpus, "
               "training and tokenizer, half the width and half the depth." if record.get("draft_of") else
               "It is the project's default model: small enough to commit, trained enough that its output "
               "looks like Python.")
    title = "tiny-llama-draft" if record.get("draft_of") else "tiny-llama"
    return f"""# {title}

A {record['steps']}-step, from-scratch Llama (grouped-query attention: 4 query heads, 2 KV heads,
tied embeddings, fp16 weights) trained on CPU by `toolchain tiny-model`.
{purpose}

- Corpus: {record['corpus']}.
- Tokens: {record['train_tokens']:,} training, {record['heldout_tokens']:,} held out; byte-level BPE tokenizer.
- Training: seed {record['seed']}, {record['steps']} steps of {record['batch_size']} x {record['seq_len']} tokens,
  AdamW lr {record['lr']}, {record['train_seconds']} s on {record['threads']} CPU threads
  (Python {record['python']}, torch {record['torch']}).
- Held-out perplexity: **{record['heldout_perplexity']}** on {record['heldout_eval_tokens']:,} tokens
  (a uniform model scores {record['uniform_perplexity']}).

Reproduce (same machine and thread count give the same weights):

    {record['command']}
"""
