"""Multiple-choice accuracy by log-likelihood: each item's context with each of its choices as the continuation,
the choice whose continuation tokens have the highest summed log-probability is the model's answer.

The way lm-evaluation-harness scores a `multiple_choice` task's `acc` (lm_eval/api/task.py, ConfigurableTask
process_results: argmax of the loglikelihoods; lm_eval/api/model.py, TemplateLM._encode_pair: the context's
trailing spaces move to the continuation, the pair is encoded whole and the continuation is what follows the
context's own encoding). The shipped set, data/multiple_choice.jsonl, is 30 short items: general knowledge for
pretrained models and Python source for the embedded tiny model, which was trained on the standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from toolchain.errors import ToolchainError

SHIPPED = Path(__file__).resolve().parent / "data" / "multiple_choice.jsonl"

# (context ids, continuation ids) -> the continuation's summed log-probability given the context
LogLikelihood = Callable[[list[int], list[int]], float]


@dataclass(frozen=True)
class Item:
    context: str
    choices: tuple[str, ...]
    answer: int


def load_items(path: Path | None = None) -> tuple[str, list[Item]]:
    """(description, items) of a JSONL file, one {"context", "choices", "answer"} object a line; the shipped set
    by default."""
    path = Path(path) if path is not None else SHIPPED
    if not path.is_file():
        raise ToolchainError(f"multiple-choice file not found: {path}", "pass --choices with an existing JSONL file")
    items = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        problem = None
        try:
            data = json.loads(line)
        except ValueError as err:
            data, problem = None, f"not JSON ({err})"
        if problem is None:
            problem = _problem(data)
        if problem is not None:
            raise ToolchainError(f"{path} line {n}: {problem}", 'write one {"context": str, "choices": [str, ...], '
                                                                '"answer": index} object a line')
        items.append(Item(data["context"], tuple(data["choices"]), data["answer"]))
    if not items:
        raise ToolchainError(f"{path} holds no items", "add one JSON object a line")
    return (f"{path.name} ({len(items)} items)" if path == SHIPPED else f"{path} ({len(items)} items)"), items


def _problem(data) -> str | None:
    if not isinstance(data, dict):
        return "not a JSON object"
    context, choices, answer = data.get("context"), data.get("choices"), data.get("answer")
    if not isinstance(context, str) or not context.strip():
        return "context must be a non-empty string"
    if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
        return "choices must be two or more non-empty strings"
    if not isinstance(answer, int) or isinstance(answer, bool) or not 0 <= answer < len(choices):
        return f"answer must be the index of one of the {len(choices)} choices"
    return None


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's TemplateLM._encode_pair makes them where the pair's encoding
    begins with the context's (the context framed as the tokenizer frames a prompt, BOS where it adds one). A
    tokenizer that merges across the boundary (pieces ending in a space, as the tiny model's) would leave the
    continuation a different or empty tail; there it is encoded on its own."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = list(tokenizer(context + continuation, add_special_tokens=True, verbose=False)["input_ids"])
    head = list(tokenizer(context, add_special_tokens=True, verbose=False)["input_ids"])
    tail = whole[len(head):]
    if whole[:len(head)] != head or not tail:
        tail = list(tokenizer(continuation, add_special_tokens=False, verbose=False)["input_ids"])
    if not head or not tail:
        raise ToolchainError(f"the choice {continuation!r} after {context!r} encodes to no tokens",
                             "give each item a context and each choice some text")
    return head, tail


def pairs(tokenizer, items: list[Item]) -> list[list[tuple[list[int], list[int]]]]:
    """Every item's encoded (context, continuation) pairs, one per choice."""
    return [[encode_pair(tokenizer, item.context, choice) for choice in item.choices] for item in items]


def picks(scores: list[list[float]]) -> list[int]:
    """Each item's answer: its choice with the highest log-likelihood (the first of equals, as numpy's argmax)."""
    return [max(range(len(s)), key=lambda i: (s[i], -i)) for s in scores]


def accuracy(items: list[Item], chosen: list[int]) -> float:
    return sum(int(c == item.answer) for item, c in zip(items, chosen, strict=True)) / len(items)
