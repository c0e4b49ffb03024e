"""Greedy tokens of built CPU engines, each prompt alone and all batched: the before/after check of a change to the
CPU engine's arithmetic (issue 41 asks for the same greedy tokens on every shipped spec).

    .venv/bin/python tools/engine_tokens.py engines/*/engine --json after.json
    TOOLCHAIN_CPU_NATIVE=0 .venv/bin/python tools/engine_tokens.py engines/*/engine --json before.json
    .venv/bin/python tools/engine_tokens.py --compare before.json after.json

Engines come from `toolchain build-engine build/<spec>.yaml`; every rank's shard loads in this one process. Block
reuse is off, so each prompt is computed whole in every run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Fixed ids (taken modulo each engine's vocabulary): short and long prompts, one past a 32-token block.
PROMPTS = [[1, 450, 4996, 17354, 1701, 432], [1, 15043, 29892, 920, 526, 366, 29973], [1, 306, 763],
           [1, 1724, 338, 278, 7483, 310, 3444, 29973, 450, 7483, 310], [1, *range(100, 160)]]


def generate(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    from toolchain.engine.cpu import SamplingParams

    seqs = [engine.start(p, SamplingParams(max_new_tokens=n)) for p in prompts]
    for s in seqs:
        engine.add(s)
    try:
        while not all(s.finished for s in seqs):
            engine.step([(s, s.pending) for s in seqs if not s.finished])
        return [list(s.output) for s in seqs]
    finally:
        for s in seqs:
            engine.release(s)


def tokens(engine_dir: Path, n: int) -> dict:
    from toolchain.engine.cpu import CpuEngine, SamplingParams

    engine = CpuEngine.load(engine_dir, num_threads=2)
    engine.kv.enable_block_reuse = False
    prompts = [[t % engine.model.d.vocab_size for t in p] for p in PROMPTS]
    return {"alone": [engine.generate(p, SamplingParams(max_new_tokens=n)) for p in prompts],
            "batched": generate(engine, prompts, n),
            "native_kernels": getattr(engine.model, "kernels", None) is not None}


def compare(before: dict, after: dict) -> int:
    differ = 0
    for name in sorted(set(before) | set(after)):
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'after' if a is None else 'before'}")
            differ += 1
            continue
        same = {k: a[k] == b[k] for k in ("alone", "batched")}
        differ += not all(same.values())
        print(f"{name}: alone {'same' if same['alone'] else 'DIFFER'}, batched {'same' if same['batched'] else 'DIFFER'}"
              f" (native kernels {a['native_kernels']} -> {b['native_kernels']})")
    return 1 if differ else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("engines", nargs="*", type=Path)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if not args.engines:
        ap.error("name engine directories, or --compare BEFORE AFTER")
    out = {str(d): tokens(d, args.new_tokens) for d in args.engines}
    text = json.dumps(out)
    if args.json:
        args.json.write_text(text)
    else:
        sys.stdout.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
