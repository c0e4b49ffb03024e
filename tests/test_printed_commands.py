"""Every command line the toolchain prints for pasting (plan's build and launch lines, build-engine --dry-run,
serve --print on the GPU targets, dynamo --print), over every spec in build/, parses in bash as the command it shows: `bash -n`
accepts it, no unquoted `<` or `>` turns a placeholder into a redirection (a `<port 0>` reads as "stdin from
file port, stdout to the next word"), and no variable sits in single quotes where it would never expand."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from toolchain.cli import main
from toolchain.errors import ToolchainError
from toolchain.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = sorted((REPO / "build").glob("*.yaml"))
# Headers of `toolchain plan`'s sections that hold command lines (indented below the header).
PLAN_SECTIONS = ("build:", "launch:", "OpenAI server:")
# The one redirection a printed line may hold: writing a file into the printed deployment's own directory.
ALLOWED_REDIRECT = re.compile(r"^\$[A-Z_]+_DIR/[\w./-]+$")


def _run(capsys, root: Path, *argv) -> list[str]:
    capsys.readouterr()
    rc = main(["--root", str(root), *map(str, argv)])
    got = capsys.readouterr()
    assert rc == 0, (argv, got.err)
    return got.out.splitlines()


def _plan_lines(out: list[str]) -> list[str]:
    lines, inside = [], False
    for line in out:
        if not line.startswith(" "):
            inside = line.strip() in PLAN_SECTIONS
        elif inside:
            lines.append(line.strip())
    return lines


def printed_lines(capsys, root: Path, spec_path: Path) -> list[str]:
    """Every command line the toolchain prints for `spec_path`, comments dropped."""
    spec = load_spec(spec_path)
    out = _plan_lines(_run(capsys, root, "plan", spec_path))
    if spec.target == "trtllm":
        out += _run(capsys, root, "build-engine", spec_path, "--dry-run")
        # The mpirun form of the build (one log per rank), whether or not mpirun is on this machine's PATH.
        out += _plan_lines(_run(capsys, root, "plan", spec_path, "--set", "build.mpi=always"))
        out += _run(capsys, root, "build-engine", spec_path, "--dry-run", "--set", "build.mpi=always")
    if spec.target in ("trtllm", "llmapi"):  # the GPU host's (on CPU, serve --print needs the rendered repository)
        out += _run(capsys, root, "serve", spec_path, "--print")
    if spec.target == "llmapi-cpu" and not spec.lora.enabled:  # Dynamo's TensorRT-LLM workers take no LoRA
        out += _run(capsys, root, "dynamo", spec_path, "--print")
    if spec.target == "llmapi":
        # Dynamo 1.6.1 runs TensorRT-LLM 1.3.0rc29, so `toolchain dynamo` refuses the 1.2 options whose
        # status allows change (toolchain/dynamo/checks.py); the lines are printed without them.
        out += _run(capsys, root, "dynamo", spec_path, "--print", "--set", "llmapi.options={}")
    return [line for line in out if line.strip() and not line.lstrip().startswith("#")]


def shell_problems(line: str) -> list[str]:
    """What is wrong with `line` as a bash command line (empty when nothing)."""
    problems = []
    proc = subprocess.run(["bash", "-n", "-c", line], capture_output=True, text=True)
    if proc.returncode != 0:
        problems.append(f"bash -n: {proc.stderr.strip()}")
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    for i, token in enumerate(tokens):
        if set(token) <= set("();<>|&") and ("<" in token or ">" in token):
            target = tokens[i + 1] if i + 1 < len(tokens) else ""
            if token != ">" or not ALLOWED_REDIRECT.match(target):
                problems.append(f"redirection {token!r} {target!r}")
    if re.search(r"'\$[A-Za-z_{]", line):
        problems.append("a variable in single quotes never expands")
    return problems


def test_the_checks_catch_what_they_are_for():
    assert shell_problems("DYN_SYSTEM_PORT=<port 0> python3 -m worker &")
    assert shell_problems("python3 -m worker --config '$TMP/engine-args.yaml'")
    assert shell_problems("mpirun -n 1 tritonserver : -n 1 (")
    assert not shell_problems("printf '%s\\n' '{\"a\": \"<b>\"}' > \"$DYNAMO_DIR/engine-args.yaml\"")
    assert not shell_problems("sh -c 'exec tritonserver --key=\"${KEY:?set KEY}\"' &")


@pytest.mark.parametrize("spec_path", SPECS, ids=[p.stem for p in SPECS])
def test_every_printed_line_parses_in_bash(spec_path, tmp_path, capsys):
    try:
        sp = load_spec(spec_path).speculative
    except ToolchainError as err:  # a model built at setup (make smollm2, make tiny-mixtral), absent outside make test
        if "is not built yet" not in str(err):
            raise
        pytest.skip(str(err))
    if sp.mode in ("medusa", "eagle") and not (sp.heads and Path(sp.heads).is_dir()):
        pytest.skip(f"needs trained {sp.mode} weights in {sp.heads} (make medusa-heads)")
    lines = printed_lines(capsys, tmp_path, spec_path)
    assert lines, "nothing printed"
    bad = {line[:160]: problems for line in lines if (problems := shell_problems(line))}
    assert not bad, bad


@pytest.mark.e2e
@pytest.mark.slow
def test_dynamo_print_on_cpu_runs_as_pasted(tmp_path, capsys):
    """The llmapi-cpu lines of `dynamo --print`, pasted into bash as they are, serve a completion."""
    import json
    import os
    import signal
    import time
    import urllib.request

    pytest.importorskip("dynamo.frontend", reason="NVIDIA Dynamo is not installed (make dynamo)")
    from toolchain.dynamo.install import problem

    if problem():
        pytest.skip(f"Dynamo cannot run: {problem()}")
    spec_path = REPO / "build" / "tiny-llama-dynamo.yaml"
    lines = _run(capsys, tmp_path, "dynamo", spec_path, "--set", "dynamo.http_port=0", "--print")
    port = int(re.search(r"--http-port (\d+)", "\n".join(lines)).group(1))
    script = tmp_path / "pasted.sh"
    script.write_text("\n".join(lines) + '\necho "$DYNAMO_DIR"\nwait\n')
    proc = subprocess.Popen(["bash", str(script)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            start_new_session=True)
    directory = proc.stdout.readline().strip()
    try:
        body = json.dumps({"model": "tiny-llama-dynamo", "prompt": "def main(", "max_tokens": 4}).encode()
        answer, deadline = None, time.monotonic() + 240
        while answer is None and time.monotonic() < deadline and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                             headers={"content-type": "application/json"})
                with urllib.request.urlopen(req, timeout=30) as resp:
                    answer = json.loads(resp.read())
            except (OSError, ValueError):
                time.sleep(1)
        assert answer is not None, "the pasted deployment never answered"
        assert answer["choices"][0]["text"] and answer["usage"]["completion_tokens"] == 4, answer
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if directory.startswith("/"):
            import shutil

            shutil.rmtree(directory, ignore_errors=True)
