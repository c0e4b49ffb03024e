"""Atomic outputs and manifests: nothing half-written is ever reused."""

from __future__ import annotations

import pytest

from toolchain.fsutil import atomic_dir, sha256_tree
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
