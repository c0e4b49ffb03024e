"""The house's floors, as data, and an ast scan of toolchain/ that keeps them.

A room is a top-level module or package of toolchain/ (a package's subpackages are the same room). A room may
import a room on a lower floor, never one on its own floor or above; no two modules may import each other,
however indirectly; and an import inside a function is for a heavy package only (a third-party one from
HEAVY, or a toolchain module that imports one at its top), never to step around a cycle. docs/architecture.md
draws the same floors; a new room gets its floor here and there.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from toolchain.speculative import MODES

PACKAGE = Path(__file__).resolve().parents[1] / "toolchain"

# Top floor first. Rooms on one floor do not import each other.
FLOORS: list[tuple[str, ...]] = [
    ("cli",),
    ("tune", "probe_host"),
    ("pipeline",),
    ("importer",),  # reads a deployment made by hand into a spec, renders it back, moves it to the LLM-API path
    ("checks",),
    ("dynamo",),
    ("openai",),
    ("eval",),  # evaluates the LLM-API path's CPU stand-in too
    ("llmapi",),
    ("bench",),
    ("triton",),
    ("engine",),
    ("plan",),
    ("checkpoint",),
    ("weights_source",),
    ("workspace", "spec_reference"),
    ("spec",),
    ("quant", "archs", "tinymodel", "spec_workload", "spec_lora", "spec_dynamo"),
    ("pretrained", "hub", "manifest", "gpus", "speculative", "spec_section"),
    ("remote_code", "fingerprint", "draft_tree", "netutil", "stopsignals", "slo", "eos", "versions", "host",
     "targets", "hostprofile"),
    ("fsutil", "upstream"),
    ("procgroup",),
    ("errors",),
    ("__init__",),  # the package's face: its version string
]
FLOOR = {room: len(FLOORS) - i for i, rooms in enumerate(FLOORS) for room in rooms}

# Third-party packages whose import costs seconds or pulls a runtime, or that only some installs have (aiohttp
# and uvloop come with Dynamo); a function may import these, or a toolchain module that imports one of them at
# its top, where its caller should not pay for it.
HEAVY = {"aiohttp", "uvloop", "torch", "transformers", "tokenizers", "safetensors", "tritonclient", "matplotlib", "fastapi", "uvicorn",
         "accelerate", "gguf", "modelopt", "pytriton", "dynamo", "aiperf", "triton_python_backend_utils",
         "numpy", "pyarrow", "grpc", "prometheus_client", "httptools", "jinja2", "huggingface_hub", "datasets", "xgrammar", "peft"}


@dataclass(frozen=True)
class Import:
    source: str  # module importing
    target: str  # module imported (a toolchain module, or a third-party top-level name)
    line: int
    local: bool  # inside a function
    typing_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, known: dict[str, Path]) -> str:
    """The module an import names: `toolchain.x.y` as a module, or its package when `y` is a name in it."""
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def imports_of(name: str, path: Path, known: dict[str, Path]) -> list[Import]:
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            guard = isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test)
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
                    for _ in range(child.level - 1):
                        package = package.rsplit(".", 1)[0]
                    base = f"{package}.{base}" if base else package
                # `from toolchain.x import y`: y may be a module of its own.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for target in targets:
                if target.split(".")[0] == "toolchain":
                    target = _resolve(target, known)
                found.append(Import(name, target, child.lineno, local, typing_only))
            visit(child, local or is_function, typing_only or guard)

    visit(tree, False, False)
    return found


def room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


@pytest.fixture(scope="module")
def graph() -> dict[str, list[Import]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def heavy_modules(graph: dict[str, list[Import]]) -> set[str]:
    """Toolchain modules that import a HEAVY package at their top, directly or through another such module."""
    heavy: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, imports in graph.items():
            if name in heavy:
                continue
            for imp in imports:
                if imp.local or imp.typing_only:
                    continue
                if imp.target.split(".")[0] in HEAVY or imp.target in heavy:
                    heavy.add(name)
                    changed = True
                    break
    return heavy


def test_every_room_has_a_floor(graph):
    missing = sorted({room(m) for m in graph} - set(FLOOR))
    assert not missing, f"rooms without a floor: {missing}; add each to FLOORS here and to docs/architecture.md"


def test_imports_point_down(graph):
    upward = []
    for name, imports in graph.items():
        for imp in imports:
            if not imp.target.startswith("toolchain"):
                continue
            a, b = room(name), room(imp.target)
            if a != b and FLOOR.get(b, 0) >= FLOOR.get(a, 0):
                upward.append(f"{name}:{imp.line} imports {imp.target} ({a} on floor {FLOOR.get(a)}, "
                              f"{b} on floor {FLOOR.get(b)})")
    assert not upward, "imports that do not point down:\n" + "\n".join(upward)


# The Python-backend models are copied into each model repository as 1/model.py and run by Triton's stub,
# which puts the toolchain on sys.path only in initialize(): their toolchain imports must stay in functions.
PAYLOAD = ("toolchain.triton.backend_models.", "toolchain.llmapi.triton_model")


def test_function_local_imports_are_for_heavy_packages_only(graph):
    heavy = heavy_modules(graph)
    dodges = []
    for name, imports in graph.items():
        if name.startswith(PAYLOAD):
            continue
        for imp in imports:
            if not imp.local or imp.typing_only:
                continue
            top = imp.target.split(".")[0]
            if top == "toolchain" and imp.target not in heavy:
                dodges.append(f"{name}:{imp.line} imports {imp.target} inside a function")
            elif top != "toolchain" and top not in HEAVY and top not in sys.stdlib_module_names:
                dodges.append(f"{name}:{imp.line} imports {imp.target} inside a function (not in HEAVY)")
    assert not dodges, ("function-local imports of light modules (import them at the top; a cycle is a "
                        "module in the wrong room):\n" + "\n".join(dodges))


def cycles(graph: dict[str, list[Import]]) -> list[list[str]]:
    """Strongly connected groups of two or more modules (Tarjan), over every import, typing-only ones too (a
    type named across a cycle ties the two modules as much as a call does)."""
    edges = {n: sorted({i.target for i in imps if i.target in graph and i.target != n})
             for n, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for v in edges:
        if v not in index:
            strong(v)
    return groups


def test_no_import_cycles(graph):
    found = cycles(graph)
    assert not found, "modules that import each other:\n" + "\n".join(" <-> ".join(g) for g in found)


def test_the_scan_catches_an_upward_import(graph, tmp_path):
    """The scan itself: a low room importing a high one, and two modules importing each other, are found."""
    fake = dict(graph)
    fake["toolchain.errors"] = [*graph["toolchain.errors"], Import("toolchain.errors", "toolchain.cli", 1,
                                                                   False, False)]
    with pytest.raises(AssertionError, match="toolchain.errors:1 imports toolchain.cli"):
        test_imports_point_down(fake)
    fake["toolchain.cli"] = [*graph.get("toolchain.cli", []), Import("toolchain.cli", "toolchain.errors", 1,
                                                                      False, False)]
    assert any("toolchain.errors" in g and "toolchain.cli" in g for g in cycles(fake))
    local = dict(graph)
    local["toolchain.spec"] = [*graph["toolchain.spec"], Import("toolchain.spec", "toolchain.errors", 9, True,
                                                                False)]
    with pytest.raises(AssertionError, match="toolchain.spec:9 imports toolchain.errors inside a function"):
        test_function_local_imports_are_for_heavy_packages_only(local)


# Where a spec's target may be compared: the spec itself, the targets table, the pipeline that chooses the path
# and the CLI. Elsewhere a module reads what varies from the target's row (toolchain/targets.py: its launcher,
# manifest writer, engine builder, dtype narrowing), and a check declares its paths and devices in `@check`.
TARGET_CHOOSERS = ("toolchain.spec", "toolchain.targets", "toolchain.pipeline", "toolchain.cli")
# Attributes that name the target or its path or device: `spec.target`, the row's path and device properties,
# the row's `device` (toolchain.targets.Target.device) when compared.
TARGET_ATTRS = {"target", "llmapi_path", "on_cpu", "on_gpu", "builds_engine"}
TARGET_VALUES = {"cpu", "trtllm", "llmapi", "llmapi-cpu"}
MAX_TARGET_BRANCHING = 3


def _names_target(node: ast.AST) -> bool:
    """The node reads the target: `x.target`, `x.llmapi_path`, `x.on_cpu`, `x.on_gpu` or `x.builds_engine`."""
    return any(isinstance(n, ast.Attribute) and n.attr in TARGET_ATTRS for n in ast.walk(node))


def _is_target_table(node: ast.AST) -> bool:
    """A target's name as a bare string, a literal collection of them, or a table of targets (`TARGETS`)."""
    if isinstance(node, ast.Constant):
        return node.value in TARGET_VALUES
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_is_target_table(e) for e in node.elts)
    return isinstance(node, ast.Name) and node.id.isupper() and "TARGET" in node.id


def _compares_target(node: ast.Compare) -> bool:
    """A comparison that tells targets apart by name or device: with a target's name as a bare string or a table
    of targets (`... == "llmapi"`, `target in GPU_TARGETS`), or `device ==` / `x.device !=`. `is None` tests
    and membership in a check's declared devices are no such comparison."""
    operands = [node.left, *node.comparators]
    operands += [e for o in operands if isinstance(o, ast.Tuple) for e in o.elts]  # (row.path, row.device) == ...
    if any(_is_target_table(o) for o in operands):
        return True
    equality = all(isinstance(op, (ast.Eq, ast.NotEq)) for op in node.ops)
    return equality and any(isinstance(o, ast.Name) and o.id == "device"
                            or isinstance(o, ast.Attribute) and o.attr == "device" for o in operands)


def conditions(tree: ast.AST) -> list[ast.AST]:
    """The conditions in a module: the test of an if, a conditional expression, a while, an assert or a
    comprehension's filter, an operand of `and`/`or`, and any comparison."""
    found: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.IfExp, ast.While, ast.Assert)):
            found.append(node.test)
        elif isinstance(node, ast.comprehension):
            found.extend(node.ifs)
        elif isinstance(node, ast.BoolOp):
            found.extend(node.values)
        elif isinstance(node, ast.Compare):
            found.append(node)
    return found


def branches_on_target(tree: ast.AST) -> list[int]:
    """Lines that decide on the target: a condition that reads the target or its path or device properties,
    compares a name `target` or a `device`, or compares with a target's name as a bare string. Naming the
    target in a message or a record is no branch."""
    return sorted({t.lineno for t in conditions(tree)
                   if _names_target(t) or any(isinstance(c, ast.Compare) and _compares_target(c) for c in ast.walk(t))})


def is_chooser(name: str, choosers: tuple[str, ...]) -> bool:
    """A chooser module or one inside a chooser package (toolchain.cli.serve); toolchain.speculative and
    toolchain.spec_reference merely start with a chooser's name."""
    return any(name == c or name.startswith(c + ".") for c in choosers)


def is_target_chooser(name: str) -> bool:
    return is_chooser(name, TARGET_CHOOSERS)


def branching(graph, choosers: tuple[str, ...], scan: Callable[[ast.AST], list[int]]) -> dict[str, list[int]]:
    """The modules outside the choosers with lines that `scan` finds, and those lines."""
    found = {}
    for name in graph:
        if is_chooser(name, choosers):
            continue
        lines = scan(ast.parse(modules()[name].read_text()))
        if lines:
            found[name] = lines
    return found


def assert_few(found: dict[str, list[int]], most: int, choosers: tuple[str, ...], does: str, instead: str):
    listing = "\n".join(f"{name}: lines {lines}" for name, lines in sorted(found.items()))
    assert len(found) <= most, (f"{len(found)} modules outside {', '.join(choosers)} {does} (at most {most}); "
                                f"{instead} instead:\n{listing}")


def test_few_modules_branch_on_the_target(graph):
    assert_few(branching(graph, TARGET_CHOOSERS, branches_on_target), MAX_TARGET_BRANCHING, TARGET_CHOOSERS,
               "branch on the target", "read the target's row in toolchain/targets.py")


def test_the_target_scan_catches_name_and_device_compares():
    """The scan itself: a name compare, a device compare and a path property are branches; a membership in
    declared (path, device) pairs and a name in a message are not; only the choosers' own modules are exempt."""
    source = ("if spec.target == 'llmapi':\n    pass\n"
              "x = 1 if row.device != CPU else 2\n"
              "y = row.llmapi_path and z\n"
              "ok = (row.path, row.device) in mode.runs\n"
              "msg = f'target {spec.target}'\n")
    assert branches_on_target(ast.parse(source)) == [1, 3, 4]
    assert is_target_chooser("toolchain.cli.serve") and is_target_chooser("toolchain.spec")
    assert not is_target_chooser("toolchain.speculative") and not is_target_chooser("toolchain.spec_reference")


# Where a speculative mode may be told apart by its name: its table, the spec's validators and the CLI.
# Elsewhere a module reads what the mode does from its row (toolchain/speculative.py: adds, draft,
# external_drafts, prompt_lookup, drafts_in_target, ...); a module that hands a mode to code of its own (convert
# to checkpoint/medusa.py or eagle.py, a check of one mode's tree) keys a table of its own by the name.
MODE_CHOOSERS = ("toolchain.speculative", "toolchain.spec", "toolchain.cli")
# "none" is speculation off, no mode's behaviour.
MODE_NAMES = set(MODES) - {"none"}
MAX_MODE_BRANCHING = 0


def _is_mode_table(node: ast.AST) -> bool:
    """A mode's name as a bare string, or a literal collection of mode names only (`("draft_target", "ngram")`;
    the CPU model's `(None, "top_k", ..., "medusa")` lists decoding modes)."""
    if isinstance(node, ast.Constant):
        return node.value in MODE_NAMES
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and bool(node.elts) and all(
        _is_mode_table(e) for e in node.elts)


def _reads_decoding_mode(node: ast.AST) -> bool:
    """The operand is the tensorrtllm backend's decoding_mode, whose values medusa, eagle and lookahead share
    the modes' names: the backend's parameters follow its decoding mode (its isLookahead())."""
    return any(isinstance(n, ast.Name) and "decoding" in n.id or isinstance(n, ast.Attribute) and "decoding" in n.attr
               or isinstance(n, ast.Constant) and n.value == "decoding_mode" for n in ast.walk(node))


def _compares_mode(node: ast.Compare) -> bool:
    operands = [node.left, *node.comparators]
    return any(_is_mode_table(o) for o in operands) and not any(_reads_decoding_mode(o) for o in operands)


def branches_on_mode(tree: ast.AST) -> list[int]:
    """Lines with a condition that compares with a speculative mode's name as a bare string (`sp.mode ==
    "draft_target"`, `mode in ("draft_target", "ngram")`). Naming a mode in a message or keying a table by it is
    no branch."""
    return sorted({t.lineno for t in conditions(tree)
                   if any(isinstance(c, ast.Compare) and _compares_mode(c) for c in ast.walk(t))})


def test_few_modules_branch_on_the_speculative_mode(graph):
    assert_few(branching(graph, MODE_CHOOSERS, branches_on_mode), MAX_MODE_BRANCHING, MODE_CHOOSERS,
               "compare with a speculative mode's name", "read the mode's row in toolchain/speculative.py")


def test_the_mode_scan_catches_name_compares():
    """The scan itself: an equality and a membership in a literal tuple of mode names are branches, in an if or
    a conditional expression; a compare with the backend's decoding_mode, a tuple of decoding modes, "none", a
    name in a message and a table keyed by names are not; only the choosers' own modules are exempt."""
    source = ("if sp.mode == 'draft_target':\n    pass\n"
              "n = sp.max_draft_len if spec.speculative.mode in ('draft_target', 'ngram') else 0\n"
              "ok = row.adds == DRAFT_ENGINE and sp.mode != 'eagle3'\n"
              "medusa = row.decoding_mode == 'medusa'\n"
              "bad = mode not in (None, 'top_k', 'medusa')\n"
              "on = sp.mode != 'none'\n"
              "msg = f'speculative.mode=mtp needs {sp.heads}'\n"
              "ATTACH = {'medusa': 1, 'eagle': 2}\n")
    assert branches_on_mode(ast.parse(source)) == [1, 3, 4]
    assert is_chooser("toolchain.cli.serve", MODE_CHOOSERS) and is_chooser("toolchain.speculative", MODE_CHOOSERS)
    assert not any(is_chooser(m, MODE_CHOOSERS) for m in ("toolchain.spec_reference", "toolchain.checks.speculative"))
