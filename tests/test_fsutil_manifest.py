"""Atomic outputs and manifests: nothing half-written is ever reused."""

from __future__ import annotations

import pytest

from toolchain.fsutil import atomic_dir, atomic_file, sha256_tree
from toolchain.manifest import Manifest, is_current


def test_atomic_dir_replaces_only_on_success(tmp_path):
    final = tmp_path / "out"
    with atomic_dir(final) as tmp:
        (tmp / "a").write_text("1")
    assert (final / "a").read_text() == "1"
    with pytest.raises(RuntimeError):
        with atomic_dir(final) as tmp:
            (tmp / "a").write_text("2")
            raise RuntimeError("interrupted")
    assert (final / "a").read_text() == "1"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_what_a_killed_run_left_is_swept_but_a_live_writer_is_not(tmp_path):
    """kill -9 mid-stage leaves `.NAME.tmp-PID-*` (and maybe `.NAME.old-PID`); the next run of the
    stage removes them once PID is gone, and keeps those of a process still running."""
    import os
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    dead_tmp, dead_old = tmp_path / f".out.tmp-{gone}-abc", tmp_path / f".out.old-{gone}"
    live_tmp, other = tmp_path / f".out.tmp-{os.getpid()}-xyz", tmp_path / f".outer.tmp-{gone}-abc"
    for d in (dead_tmp, dead_old, live_tmp, other):
        (d / "half").mkdir(parents=True)
    with atomic_dir(tmp_path / "out") as tmp:
        (tmp / "done").write_text("1")
    assert not dead_tmp.exists() and not dead_old.exists()
    assert live_tmp.exists() and other.exists()  # a live writer, and another output's leftovers
    assert (tmp_path / "out" / "done").read_text() == "1"


def test_atomic_file_gets_the_umask_mode_not_mkstemps_0600(tmp_path):
    import os

    old = os.umask(0o022)
    try:
        with atomic_file(tmp_path / "report.json") as fh:
            fh.write("{}")
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o644
    with pytest.raises(RuntimeError):
        with atomic_file(tmp_path / "other.json") as fh:
            fh.write("partial")
            raise RuntimeError("interrupted")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]  # nothing half-written left


def test_manifest_roundtrip_and_currency(tmp_path):
    m = Manifest(stage="s", spec_hash="h", inputs={"x": "1"})
    m.write(tmp_path)
    assert is_current(tmp_path, Manifest(stage="s", spec_hash="h", inputs={"x": "1"}))
    assert not is_current(tmp_path, Manifest(stage="s", spec_hash="h2", inputs={"x": "1"}))
    assert not is_current(tmp_path, Manifest(stage="s", spec_hash="h", inputs={"x": "2"}))
    (tmp_path / "manifest.json").write_text("{broken")
    assert not is_current(tmp_path, m)


def test_tree_hash_sees_content_and_names(tmp_path):
    (tmp_path / "a").write_text("1")
    h1 = sha256_tree(tmp_path)
    (tmp_path / "a").write_text("2")
    h2 = sha256_tree(tmp_path)
    (tmp_path / "b").write_text("2")
    assert len({h1, h2, sha256_tree(tmp_path)}) == 3
