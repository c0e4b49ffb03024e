"""toolchain.bench.results: the benchmarks' results JSON, printed and written to --json PATH."""

from __future__ import annotations

import json

from toolchain.bench.results import print_and_write, write_results


def test_written_with_its_folder_and_a_final_newline(tmp_path):
    path = tmp_path / "reports" / "benchmarks" / "x.json"
    write_results({"a": 1, "b": [1, 2]}, path, indent=1)
    assert path.read_text() == json.dumps({"a": 1, "b": [1, 2]}, indent=1) + "\n"


def test_no_path_writes_nothing(tmp_path, capsys):
    write_results({"a": 1}, None)
    print_and_write({"a": 1}, None)
    assert list(tmp_path.iterdir()) == [] and json.loads(capsys.readouterr().out) == {"a": 1}


def test_printed_may_be_a_summary_of_what_is_written(tmp_path, capsys):
    path = tmp_path / "r.json"
    results = {"summary": {"x": 1}, "detail": {"when": tmp_path}}  # a Path: written through default=str
    print_and_write(results, path, printed=results["summary"], default=str)
    assert json.loads(capsys.readouterr().out) == {"x": 1}
    assert json.loads(path.read_text())["detail"]["when"] == str(tmp_path)
