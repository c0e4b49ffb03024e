"""Draft trees of tree-based speculative decoding (Medusa, EAGLE-1): a list of paths, each a
list of candidate indices (node [0, 1] = the first head's best token followed by the second
head's runner-up). Written in Triton's medusa_choices / eagle_choices syntax, "{0}, {0, 1}",
which the C++ backend parses with csvStrToVecVecInt."""

from __future__ import annotations

import heapq


def build_tree(accuracy: list[list[float]], size: int) -> list[list[int]]:
    """The `size` paths with the highest estimated chance of acceptance (the product of the
    per-head accuracies along the path, Medusa's sparse-tree rule), grown best-first from the
    root so every node's parent is in the tree. Sorted by depth, then path."""
    frontier: list[tuple[float, tuple[int, ...]]] = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))]
    heapq.heapify(frontier)
    chosen: list[tuple[int, ...]] = []
    while frontier and len(chosen) < size:
        neg, path = heapq.heappop(frontier)
        chosen.append(path)
        depth = len(path)
        if depth < len(accuracy):
            for r in range(len(accuracy[depth])):
                heapq.heappush(frontier, (neg * accuracy[depth][r], path + (r,)))
    return [list(p) for p in sorted(chosen, key=lambda p: (len(p), p))]


def choices_text(choices: list[list[int]]) -> str:
    """The tree as Triton's medusa_choices / eagle_choices parameter writes it: "{0}, {0, 1}"."""
    return ", ".join("{" + ", ".join(str(i) for i in path) + "}" for path in choices)


def parse_choices(text: str) -> list[list[int]]:
    """Inverse of choices_text; raises ValueError naming the first bad piece."""
    body = text.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise ValueError(f"choices {text!r} must look like \"{{0}}, {{0, 0}}, {{1}}\"")
    paths = []
    for piece in body[1:-1].split("}"):
        piece = piece.strip().lstrip(",").strip().lstrip("{").strip()
        if not piece:
            raise ValueError(f"choices {text!r} hold an empty path")
        try:
            path = [int(x) for x in piece.split(",")]
        except ValueError:
            raise ValueError(f"choices {text!r}: {piece!r} is not a list of integers") from None
        if any(i < 0 for i in path):
            raise ValueError(f"choices {text!r}: indices must be >= 0")
        paths.append(path)
    return paths


def tree_problem(choices: list[list[int]], num_heads: int | None = None) -> str | None:
    """Why a list of paths is not a usable tree: duplicates, a path whose parent is missing, or
    one deeper than the heads."""
    seen = set()
    for path in choices:
        key = tuple(path)
        if key in seen:
            return f"path {path} appears twice"
        seen.add(key)
    for path in choices:
        if len(path) > 1 and tuple(path[:-1]) not in seen:
            return f"path {path} has no parent {path[:-1]} in the tree"
        if num_heads is not None and len(path) > num_heads:
            return f"path {path} is {len(path)} deep but there are only {num_heads} heads"
    return None


# The tree the backend falls back to when no medusa_choices / eagle_choices is set: Medusa's
# mc_sim_7b_63 (63 nodes, 4 deep), which TensorRT-LLM's examples/eagle README names as the default.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0], [0, 0, 0, 1],
    [1, 6], [0, 7, 0],
]


def non_leaves_per_level(choices: list[list[int]]) -> list[int]:
    """How many nodes at each depth (1-based depth d at index d - 1) have children: EAGLE's
    EagleNet at that level drafts from exactly those (max_non_leaves_per_layer bounds it)."""
    parents = {tuple(p[:-1]) for p in choices if len(p) > 1}
    depth = max((len(p) for p in choices), default=0)
    return [sum(1 for p in parents if len(p) == d) for d in range(1, depth + 1)]
