"""Speculative decoding on the CPU engine: each mode against plain decoding, in one run.

Same target, prompts, token counts and threads for every mode; greedy decoding,
one request at a time (decode-bound, where speculation pays):

- draft_target: models/tiny-llama-draft proposes k tokens, the target verifies them
  in one forward, as the BLS's loop does (tensorrt_llm_bls, upstream's
  Decoder._spec_generate): each step is a request over the whole sequence with
  `draft_input_ids`, prefix blocks reused;
- ngram: prompt lookup (the BLS's `_lookup`), the same verification;
- medusa: a MedusaForCausalLM engine with heads trained on the target's own text
  (`toolchain medusa-heads`, run here unless --heads is given), tree verification
  from the heads' measured tree;
- lookahead: not run; the CPU engine has none (TensorRT-LLM decodes it in its
  C++ runtime), so its key is null with the reason.

The target must be expensive enough that its forward dominates, as a real
target's does. The benchmark makes one from the trained embedded model
(models/tiny-llama): the same 4 layers with their MLPs widened by zero units and
12 extra layers whose output projections are zero (--extra-layers, --mlp-width).
Every added unit is computed, so a forward costs what an ~80M-parameter model's
does, while the function, and so the acceptance of drafts trained for tiny-llama,
stays the trained model's. A larger target does not help on a CPU: at 28 extra
layers the multi-token verification forward grew with it (benchmarks/README.md).

Workloads: favourable = continuing held-out Python standard-library code (the
training domain); for n-gram, code whose prompt already quotes the lines being
continued; unfavourable = prompts of random tokens.

    python benchmarks/speculative.py [--json PATH] [--quick] [--heads DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# OpenMP's default (spinning) wait policy: everything here runs on one thread team, and a passive
# policy's wake-up per operation costs speculative steps, which run more small operations per
# token, up to a third of their speed (measured on this 2-core host).
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from toolchain.bench.results import write_results  # noqa: E402
from toolchain.draft_tree import build_tree  # noqa: E402
from toolchain.tinymodel.widen import widen_target  # noqa: E402
from toolchain.engine.cpu import CpuEngine, KvCacheConfig, SamplingParams  # noqa: E402
from toolchain.engine.cpu.engine import MedusaTree  # noqa: E402

THREADS = 2
K = 4  # most draft tokens per step (the engines' max_draft_len); the benchmark tunes k <= K
K_CHOICES = (2, 3, 4)
TREE_SIZES = (2, 4, 8, 16, 24)
EXTRA_LAYERS, MLP_WIDTH = 12, 6144  # the expensive target (module doc)
TARGETS = {"draft_target": 1.5, "ngram": 1.5, "medusa": 1.3}
UNFAVOURABLE_FLOOR = 0.9


# -- the expensive target --------------------------------------------------------------

def build(root: Path, name: str, hf_dir: Path, tokens_per_block: int = 16, **speculative) -> Path:
    """Convert and build an engine through the toolchain's own stages; returns its directory."""
    from toolchain.checkpoint.stage import run_convert
    from toolchain.engine.build import run_build
    from toolchain.spec import DeploymentSpec
    from toolchain.workspace import Workspace

    spec = DeploymentSpec.model_validate({
        "name": name, "target": "cpu", "model": {"checkpoint": str(hf_dir), "dtype": "float32"},
        "limits": {"max_batch_size": 4, "max_input_len": 512, "max_seq_len": 768, "max_num_tokens": 1024},
        "build": {"tokens_per_block": tokens_per_block}, "speculative": speculative})
    ws = Workspace(root)
    run_convert(spec, ws)
    run_build(spec, ws)
    return Path(ws.engine_dir(spec))


def load(engine_dir: Path, **kw) -> CpuEngine:
    return CpuEngine.load(engine_dir, num_threads=THREADS,
                          kv_cache=KvCacheConfig(max_tokens=16384, enable_block_reuse=True), **kw)


# -- one request per mode ------------------------------------------------------------------

class Trace:
    """One request as a client would see it: when its first tokens came and how many."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first_s: float | None = None
        self.first_tokens = 0
        self.accepted = self.drafted = self.steps = 0

    def emitted(self, tokens: int) -> None:
        if self.first_s is None and tokens:
            self.first_s, self.first_tokens = time.perf_counter() - self.start, tokens


def drive(engine: CpuEngine, prompt: list[int], n: int, draft: list[int] = (), trace: Trace | None = None):
    """One request to completion, step by step; returns its Sequence."""
    seq = engine.start(prompt, SamplingParams(max_new_tokens=n), draft)
    engine.add(seq)
    try:
        while not seq.finished:
            emitted = engine.step([(seq, seq.pending)])[0]
            if trace is not None:
                decoding = trace.first_s is not None  # a step after the first response: Medusa verifies in it
                trace.emitted(len(emitted))
                trace.steps += decoding
    finally:
        engine.release(seq)
    if trace is not None:
        trace.accepted, trace.drafted = trace.accepted + seq.accepted_draft, trace.drafted + seq.drafted
    return seq


def lookup(tokens: list[int], ngram: int, k: int) -> list[int]:
    """The BLS's prompt lookup (toolchain/triton/backend_models/tensorrt_llm_bls.py, _lookup)."""
    for n in range(min(ngram, len(tokens) - 1), 0, -1):
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


def speculate(target: CpuEngine, prompt: list[int], n: int, propose, k_max: int, trace: Trace,
              plain_on_miss: bool = False) -> list[int]:
    """The BLS's draft -> target loop over engine requests, each step a request over the whole
    sequence with the draft as draft_input_ids and k + 1 tokens asked for."""
    tokens = list(prompt)
    while len(tokens) < len(prompt) + n:
        k = min(k_max, len(prompt) + n - len(tokens) - 1)
        draft = propose(tokens, k) if k > 0 else []
        # As the BLS: a lookup that finds nothing asks for k + 1 plain tokens, a draft model's empty draft for 1.
        want = len(draft) + 1 if draft else (k + 1 if plain_on_miss else 1)
        seq = drive(target, tokens, want, draft)
        tokens += seq.output
        trace.emitted(len(seq.output))
        trace.accepted, trace.drafted, trace.steps = (trace.accepted + seq.accepted_draft,
                                                      trace.drafted + seq.drafted, trace.steps + bool(draft))
        if len(seq.output) < want:
            break
    return tokens[len(prompt):len(prompt) + n]


def ngram_propose(tokens, k):
    return lookup(tokens, 3, k)


def measure(label: str, prompts: list[list[int]], n: int, run, engines: list[CpuEngine]) -> dict:
    """Each prompt from a cold KV cache (no block of an earlier run to reuse), so every mode pays
    the same prefill. Decode time is what follows the first response."""
    outputs, traces = [], []
    for p in prompts:
        for engine in engines:
            engine.kv.forget_cached()
        trace = Trace()
        outputs.append(run(p, n, trace))
        trace.e2e_s = time.perf_counter() - trace.start
        traces.append(trace)
    total = sum(t.e2e_s for t in traces)
    tokens = sum(len(o) for o in outputs)
    decode_s = sum(t.e2e_s - t.first_s for t in traces)
    decode_tokens = sum(len(o) - t.first_tokens for o, t in zip(outputs, traces, strict=False))
    accepted, drafted, steps = (sum(getattr(t, k) for t in traces) for k in ("accepted", "drafted", "steps"))
    return {"label": label, "outputs": outputs, "seconds": round(total, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / total, 2), "decode_seconds": round(decode_s, 3),
            "decode_tokens_per_s": round(decode_tokens / decode_s, 2),
            "tpot_ms": round(1000 * decode_s / decode_tokens, 2),
            "ttft_ms": round(1000 * statistics.median(t.first_s for t in traces), 1),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "accepted_per_step": round(accepted / steps, 3) if steps else None}


# -- workloads ------------------------------------------------------------------------------

def workloads(tok, count: int, prompt_len: int) -> dict[str, list[list[int]]]:
    """Prompts per workload. The first two held-out files tune the draft length and the tree
    (`tune_*`); the next `count` are measured."""
    from toolchain.tinymodel.corpus import load_corpus, read_text

    files = []
    for path in load_corpus().heldout:
        ids = tok.encode(read_text(path)).ids
        if len(ids) >= 3 * prompt_len:
            files.append(ids)
        if len(files) == count + 2:
            break
    start = prompt_len // 2  # past the license header

    def code(ids):
        return [ids[0]] + ids[start:start + prompt_len]

    def quoting(ids):
        # The prompt quotes the lines that follow, then starts them again: the continuation is in
        # the prompt, as when a user asks to edit or repeat a passage.
        body = ids[start:start + prompt_len]
        return [ids[0]] + body + ids[start + prompt_len:start + 2 * prompt_len] + body[-8:]

    g = torch.Generator().manual_seed(0)
    vocab = tok.get_vocab_size()
    return {"favourable": [code(f) for f in files[2:]], "quoting": [quoting(f) for f in files[2:]],
            "unfavourable": [[0] + torch.randint(3, vocab, (prompt_len,), generator=g).tolist()
                             for _ in range(count)],
            "tune_favourable": [code(f) for f in files[:2]], "tune_quoting": [quoting(f) for f in files[:2]]}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--quick", action="store_true", help="small target, few tokens, quick heads (a smoke run)")
    ap.add_argument("--heads", type=Path, help="Medusa heads for models/tiny-llama (default: trained here)")
    ap.add_argument("--extra-layers", type=int, default=None, metavar="N",
                    help=f"zero-output layers added to the target (default {EXTRA_LAYERS}; --quick 2)")
    ap.add_argument("--mlp-width", type=int, default=None, metavar="N",
                    help=f"the target's widened MLP (default {MLP_WIDTH}; --quick 1024)")
    return ap.parse_args(argv)


class Modes:
    """The three engines (plain target, draft, Medusa target) and each decoding mode as a call
    `mode(prompt, n, trace) -> output`, with the draft lengths and tree size `tuned` picks."""

    def __init__(self, plain_engine: CpuEngine, draft_engine: CpuEngine, medusa_engine: CpuEngine, heads_cfg: dict):
        self.plain_engine, self.draft_engine, self.medusa_engine = plain_engine, draft_engine, medusa_engine
        self.heads_cfg = heads_cfg
        self.tuned = {"draft_target": K, "ngram": K, "medusa": len(heads_cfg["medusa_choices"])}
        self.engines = [plain_engine, draft_engine, medusa_engine]

    def plain(self, p, n, trace):
        return drive(self.plain_engine, p, n, trace=trace).output

    def draft_target(self, p, n, trace):
        return speculate(self.plain_engine, p, n, lambda tokens, k: drive(self.draft_engine, tokens, k).output,
                         self.tuned["draft_target"], trace)

    def ngram(self, p, n, trace):
        return speculate(self.plain_engine, p, n, ngram_propose, self.tuned["ngram"], trace, plain_on_miss=True)

    def set_tree(self, size):
        """The Medusa engine's tree: `size` nodes grown from the heads' held-out accuracies."""
        tree = build_tree(self.heads_cfg["heldout_topk_accuracy"], size)
        self.medusa_engine.medusa = MedusaTree.create(tree, self.medusa_engine.dims, self.medusa_engine.limits)
        return tree

    def medusa(self, p, n, trace):
        return drive(self.medusa_engine, p, n, trace=trace).output

    @property
    def speculative(self) -> dict:
        return {"draft_target": self.draft_target, "ngram": self.ngram, "medusa": self.medusa}


def prepare(args: argparse.Namespace, tmp: Path, base: Path, extra: int, width: int) -> tuple[Modes, float]:
    """The widened target, Medusa heads (trained here unless --heads), the draft-target and Medusa engines
    built and loaded; returns the modes and the setup seconds."""
    started = time.perf_counter()
    target = widen_target(base, tmp / "target", extra_layers=extra, intermediate=width)
    heads = args.heads
    if heads is None:
        from toolchain.tinymodel.medusa import QUICK_HEADS, HeadsRecipe, train_medusa_heads

        heads = tmp / "heads"
        train_medusa_heads(base, heads, recipe=QUICK_HEADS if args.quick else HeadsRecipe(),
                           log=lambda m: print("  heads:", m))
    dt_dir = build(tmp, "dt", target, mode="draft_target", max_draft_len=K,
                   draft_model=str(REPO / "models" / "tiny-llama-draft"))
    md_dir = build(tmp, "medusa", target, mode="medusa", heads=str(heads))
    setup_s = time.perf_counter() - started
    plain_engine, draft_engine = load(dt_dir), load(dt_dir / "draft" / "engine")
    heads_cfg = json.loads((Path(heads) / "config.json").read_text())
    medusa_engine = load(md_dir, medusa_choices=heads_cfg["medusa_choices"])
    return Modes(plain_engine, draft_engine, medusa_engine, heads_cfg), setup_s


def tune(modes: Modes, work: dict, n: int) -> dict:
    """Tuning on prompts that are not measured: the draft length per loop mode and the tree size, as a
    deployment would pick max_draft_len and medusa_choices for its hardware; returns the sweep."""
    tuned, engines = modes.tuned, modes.engines
    for fn in (modes.plain, modes.draft_target, modes.ngram, modes.medusa):  # warm-up: first-call costs land nowhere
        fn(work["tune_favourable"][0][:16], 4, Trace())
    sweep: dict[str, dict] = {}
    for mode, fn, wl in (("draft_target", modes.draft_target, "tune_favourable"),
                         ("ngram", modes.ngram, "tune_quoting")):
        times = {}
        for k in K_CHOICES:
            tuned[mode] = k
            times[k] = measure(mode, work[wl], n, fn, engines)["decode_seconds"]
        tuned[mode] = min(times, key=times.get)
        sweep[mode] = {"k": times, "chosen": tuned[mode]}
    times = {}
    for size in (t for t in TREE_SIZES if t <= len(modes.heads_cfg["medusa_choices"])):
        modes.set_tree(size)
        times[size] = measure("medusa", work["tune_favourable"], n, modes.medusa, engines)["decode_seconds"]
    tuned["medusa"] = min(times, key=times.get)
    chosen_tree = modes.set_tree(tuned["medusa"])
    sweep["medusa"] = {"tree_size": times, "chosen": tuned["medusa"], "tree": chosen_tree}
    print(f"tuned: draft_target k={tuned['draft_target']}, ngram k={tuned['ngram']}, "
          f"medusa tree of {tuned['medusa']} nodes ({json.dumps(sweep)})")
    return sweep


def measure_workloads(modes: Modes, work: dict, n: int) -> tuple[dict[str, dict], bool]:
    """Every mode against plain on each measured workload, printed as it goes; the runs, and whether every
    mode's outputs were plain's."""
    results: dict[str, dict] = {}
    identical = True
    for wname in ("favourable", "quoting", "unfavourable"):
        prompts = work[wname]
        runs = {"plain": measure("plain", prompts, n, modes.plain, modes.engines)}
        for mname, fn in modes.speculative.items():
            runs[mname] = measure(mname, prompts, n, fn, modes.engines)
            same = runs[mname]["outputs"] == runs["plain"]["outputs"]
            identical &= same
            runs[mname]["outputs_identical"] = same
        for r in runs.values():
            # Decode speed-up: plain's time per token after the first response over the mode's.
            r["speedup"] = round(r["decode_tokens_per_s"] / runs["plain"]["decode_tokens_per_s"], 3)
            r["e2e_speedup"] = round(runs["plain"]["seconds"] / r["seconds"], 3)
            del r["outputs"]
        results[wname] = runs
        print(f"\n{wname}: {len(prompts)} prompts of ~{len(prompts[0])} tokens, {n} new tokens each")
        for r in runs.values():
            print(f"  {r['label']:<13} decode {r['decode_tokens_per_s']:6.1f} tok/s  TPOT {r['tpot_ms']:6.2f} ms  "
                  f"TTFT {r['ttft_ms']:6.1f} ms  speedup {r['speedup']:.2f} (e2e {r['e2e_speedup']:.2f})  "
                  f"acceptance {r['acceptance_rate']}  accepted/step {r['accepted_per_step']}")
    return results, identical


def summarize(results: dict[str, dict], identical: bool) -> dict:
    """The headline speed-ups and acceptance rates per mode (on its favourable workload) and the targets met."""
    modes = ("draft_target", "ngram", "medusa")
    fav = {"draft_target": "favourable", "ngram": "quoting", "medusa": "favourable"}
    summary = {f"speedup_{m}": results[w][m]["speedup"] for m, w in fav.items()}
    summary["speedup_lookahead"] = None
    summary["lookahead_reason"] = NOT_RUN_LOOKAHEAD
    summary.update({f"acceptance_rate_{m}": results[w][m]["acceptance_rate"] for m, w in fav.items()})
    summary.update({f"unfavourable_speedup_{m}": results["unfavourable"][m]["speedup"] for m in modes})
    summary["outputs_identical"] = identical
    summary["targets_met"] = {
        **{f"speedup_{m}>={t}": summary[f"speedup_{m}"] >= t for m, t in TARGETS.items()},
        **{f"unfavourable_{m}>={UNFAVOURABLE_FLOOR}": summary[f"unfavourable_speedup_{m}"] >= UNFAVOURABLE_FLOOR
           for m in modes}}
    return summary


def main(argv=None) -> int:
    """Build the engines, tune each mode, measure every workload; print the summary and write the report."""
    args = parse_args(argv)
    torch.set_num_threads(THREADS)
    from tokenizers import Tokenizer

    base = REPO / "models" / "tiny-llama"
    tok = Tokenizer.from_file(str(base / "tokenizer.json"))
    count, prompt_len, n = (2, 48, 24) if args.quick else (6, 64, 96)
    extra = args.extra_layers if args.extra_layers is not None else 2 if args.quick else EXTRA_LAYERS
    width = args.mlp_width or (1024 if args.quick else MLP_WIDTH)
    with tempfile.TemporaryDirectory() as tmp:
        modes, setup_s = prepare(args, Path(tmp), base, extra, width)
        work = workloads(tok, count, prompt_len)
        sweep = tune(modes, work, n)
        results, identical = measure_workloads(modes, work, n)

    summary = summarize(results, identical)
    report = {**summary, "workloads": results, "tuning": sweep, "setup_seconds": round(setup_s, 1),
              "threads": THREADS, "max_draft_len": K, "quick": args.quick,
              "target": f"models/tiny-llama widened: {4 + extra} layers ({extra} zero-output), MLP {width} wide "
                        "(zero-padded)"}
    print("\n" + json.dumps(summary, indent=2))
    write_results(report, args.json)
    return 0

NOT_RUN_LOOKAHEAD = "the CPU engine has no lookahead decoding (TensorRT-LLM runs it in its C++ runtime)"


if __name__ == "__main__":
    sys.exit(main())
