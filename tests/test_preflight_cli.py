"""The stage commands run the preflight checks guarding them: a failing check
stops convert / build-engine / model-repo / serve in one line naming the check
and --skip-check, which lets the stage run anyway; dry runs only warn."""

from __future__ import annotations

from conftest import write_spec
from toolchain.cli import main


def run(tmp_path, *argv) -> int:
    return main(["--root", str(tmp_path / "ws"), *map(str, argv)])


def test_convert_refuses_on_a_failing_check_until_skipped(tmp_path, hf_llama, capsys):
    # A GPU far too small for even this tiny model: memory.fits fails.
    spec = write_spec(tmp_path / "s.yaml", hf_llama, gpu={"memory_gib": 0.0001, "sm": 90})
    assert run(tmp_path, "convert", spec) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert err.startswith("error: preflight check memory.fits failed: does not fit")
    assert "--skip-check memory.fits" in err
    assert not (tmp_path / "ws" / "engines").exists()
    assert run(tmp_path, "convert", spec, "--skip-check", "memory.fits") == 0
    assert (tmp_path / "ws" / "engines" / "test-model" / "checkpoint" / "rank0.safetensors").is_file()


def test_checks_are_quiet_when_they_pass(tmp_path, hf_llama, capsys):
    spec = write_spec(tmp_path / "s.yaml", hf_llama)
    assert run(tmp_path, "convert", spec, "--dry-run") == 0
    assert "warning" not in capsys.readouterr().err


def test_unknown_skip_id_is_an_error_everywhere(tmp_path, hf_llama, capsys):
    spec = write_spec(tmp_path / "s.yaml", hf_llama)
    for command in ("convert", "build-engine", "bench"):
        assert run(tmp_path, command, spec, "--skip-check", "memory.fit") == 2
        assert "unknown check id 'memory.fit'" in capsys.readouterr().err


def test_model_repo_refuses_an_engine_built_for_another_batch(tmp_path, hf_llama, capsys):
    from triton_helpers import make_tiny_tokenizer

    tok = make_tiny_tokenizer(tmp_path / "tok")
    spec = write_spec(tmp_path / "s.yaml", hf_llama, model={"tokenizer": str(tok)}, limits={"max_batch_size": 4})
    assert run(tmp_path, "build-engine", spec) == 0
    capsys.readouterr()
    assert run(tmp_path, "model-repo", spec, "--set", "limits.max_batch_size=8") == 2
    err = capsys.readouterr().err
    assert "preflight check triton.batch-size failed" in err and "max_batch_size 4" in err
    assert run(tmp_path, "model-repo", spec) == 0
