"""The Makefile a newcomer runs first: every declared target has a rule, and setup says what it is installing
(it takes minutes, and pip runs quiet). Run for real, with pip replaced by `echo` and a venv without pip."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
MAKEFILE = REPO / "Makefile"

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="GNU make is not installed")


def _make(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["make", "--no-print-directory", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60)


def test_every_phony_target_has_a_rule():
    text = MAKEFILE.read_text()
    phony = {name for line in re.findall(r"^\.PHONY:(.*)$", text, re.M) for name in line.split()}
    rules = {name for line in re.findall(r"^([A-Za-z][\w .-]*?)\s*::?(?!=)", text, re.M) for name in line.split()}
    assert phony and not phony - rules, f"declared .PHONY without a rule: {sorted(phony - rules)}"


@pytest.fixture
def bare_venv(tmp_path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv


def test_setup_prints_a_line_before_each_install_step(bare_venv):
    run = _make("-B", "setup", f"VENV={bare_venv}", "PIP=echo PIP")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    installs = [i for i, line in enumerate(lines) if line.startswith("PIP ")]
    # torch, the project, xgrammar (--no-deps: its triton is GPU-only) and AIConfigurator's kernel database
    # (--no-deps: its own code needs numpy 2)
    assert len(installs) == 4, run.stdout
    for i in installs:  # each pip run follows a progress line naming what it installs
        step = next(line for line in reversed(lines[:i]) if line.startswith("==> "))
        assert "installing" in step and lines.index(step) > max([j for j in installs if j < i], default=-1), \
            run.stdout
    torch = next(line for line in lines if "torch" in line and line.startswith("PIP "))
    assert "torch==2.13.0+cpu" in torch.split()  # the CPU build, never PyPI's CUDA build of 2.13.0


def test_setup_takes_torch_from_the_cpu_index_when_its_host_resolves(bare_venv):
    # localhost always resolves; an unresolvable host falls back to pip's configured sources, saying so.
    run = _make("-B", "setup", f"VENV={bare_venv}", "PIP=echo PIP", "TORCH_INDEX=http://localhost/whl/cpu")
    assert "PIP --extra-index-url http://localhost/whl/cpu torch==2.13.0+cpu" in run.stdout, run.stdout
    run = _make("-B", "setup", f"VENV={bare_venv}", "PIP=echo PIP", "TORCH_INDEX=https://nowhere.invalid/whl/cpu")
    assert "nowhere.invalid does not resolve" in run.stdout and "PIP torch==2.13.0+cpu" in run.stdout, run.stdout


def test_make_deploy_deploys_the_spec(bare_venv):
    (bare_venv / ".setup-stamp").touch()
    run = _make("-n", "-o", str(bare_venv / ".setup-stamp"), "deploy", f"VENV={bare_venv}", "SPEC=build/x.yaml")
    assert run.returncode == 0, run.stderr
    assert f"{bare_venv}/bin/toolchain deploy build/x.yaml" in run.stdout, run.stdout


def test_make_demo_ends_saying_how_to_reach_the_venv(bare_venv):
    """Issue 33: the README's next commands run from the venv, so `make demo` ends with the line that activates
    it; run as printed, that line puts the venv's `toolchain` (and `python`) first on PATH."""
    (bare_venv / ".setup-stamp").touch()
    fake = bare_venv / "bin" / "toolchain"
    fake.write_text("#!/bin/sh\necho deployed \"$@\"\n")
    fake.chmod(0o755)
    run = _make("-o", str(bare_venv / ".setup-stamp"), "demo", f"VENV={bare_venv}", "SPEC=build/x.yaml")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "deployed deploy build/x.yaml" in lines, run.stdout
    after = lines[lines.index("deployed deploy build/x.yaml") + 1:]
    activate = next(line.strip() for line in after if line.strip().startswith("source "))
    assert activate == f"source {bare_venv}/bin/activate"
    found = subprocess.run(["bash", "-c", f"{activate} && command -v toolchain && command -v python"],
                           capture_output=True, text=True, timeout=30)
    assert found.stdout.split() == [str(fake), str(bare_venv / "bin" / "python")], found.stderr
    assert f"{fake} serve build/x.yaml" in run.stdout  # the form that needs no activating


def test_the_test_extras_make_the_models_derived_from_the_tiny_llama(bare_venv):
    """`make test` (through venv-extras) makes what the CPU specs of the derived models load: the upcycled tiny
    Mixtral and the two tiny LoRA adapters, each from the committed tiny Llama, after SmolLM2."""
    stamps = [bare_venv / name for name in (".setup-stamp", ".dynamo-stamp", ".smollm2-stamp")]
    for stamp in stamps:
        stamp.touch()
    run = _make("-n", *(f"-o{s}" for s in stamps), "venv-extras", f"VENV={bare_venv}")
    assert run.returncode == 0, run.stderr
    made = [line.split(maxsplit=1)[1] for line in run.stdout.splitlines()
            if line.startswith(f"{bare_venv}/bin/toolchain ")]
    assert made == ["smollm2 models/smollm2-135m-instruct",
                    "tiny-mixtral models/tiny-mixtral --from models/tiny-llama",
                    "tiny-lora models/tiny-llama-lora --from models/tiny-llama"], run.stdout
