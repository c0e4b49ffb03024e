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
