"""The convert stage writes the engine path's converted LoRA adapters (engines/<name>/lora/<task_id>/, the
tensorrt_llm model's lora_prefetch_dir) beside the checkpoint, with their own manifest, and leaves a spec without
adapters exactly as before."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import make_hf_model, write_spec
from lora_helpers import make_peft_adapter
from toolchain.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE, convert_adapter
from toolchain.checkpoint.stage import run_convert
from toolchain.errors import ToolchainError
from toolchain.manifest import Manifest
from toolchain.spec import load_spec
from toolchain.workspace import Workspace


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_llama):
    root = tmp_path_factory.mktemp("adapters")
    return {"attn": make_peft_adapter(hf_llama, root / "attn", ["q_proj", "v_proj"], seed=1),
            "mlp": make_peft_adapter(hf_llama, root / "mlp", ["gate_proj", "up_proj", "down_proj", "o_proj"],
                                     seed=2, r=8, alpha=16)}


def test_convert_writes_the_adapters_by_task_id(tmp_path, hf_llama, adapters):
    ws = Workspace(tmp_path / "root")
    path = write_spec(tmp_path / "s.yaml", hf_llama, lora={"adapters": {k: str(v) for k, v in adapters.items()}})
    spec = load_spec(path)
    first = run_convert(spec, ws)
    lora = ws.lora_dir(spec)
    assert lora == ws.engine_root(spec) / "lora"
    assert sorted(p.name for p in lora.iterdir()) == ["1", "2", "adapters.json", "manifest.json"]
    assert json.loads((lora / "adapters.json").read_text()) == {"adapters": {"attn": 1, "mlp": 2}, "dtype": "float32"}
    for task_id, name in ((1, "attn"), (2, "mlp")):
        expected = convert_adapter(adapters[name], tmp_path / f"ref{task_id}", "float32")
        for file in (WEIGHTS_FILE, CONFIG_FILE):
            got, want = np.load(lora / str(task_id) / file), np.load(expected / file)
            assert got.dtype == want.dtype and np.array_equal(got, want), (name, file)
    assert np.load(lora / "1" / WEIGHTS_FILE).dtype == np.float32  # the checkpoint's dtype
    made = Manifest.read(lora)
    assert made.stage == "convert-lora" and set(made.inputs) == {
        f"{n}/{f}" for n in adapters for f in ("adapter_config.json", "adapter_model.safetensors")}
    assert Manifest.read(ws.checkpoint_dir(spec)).key() == first.key()

    # Current: reused, not rewritten; a changed adapter file converts again.
    said = []
    run_convert(spec, ws, echo=said.append)
    assert Manifest.read(lora).created == made.created and "reusing" in said[0]
    changed = shutil.copytree(adapters["attn"], tmp_path / "attn2")
    make_peft_adapter(hf_llama, changed, ["q_proj", "v_proj"], seed=9)
    spec2 = load_spec(path, [f"lora.adapters.attn={changed}"])
    run_convert(spec2, ws)
    again = Manifest.read(lora)
    assert again.created > made.created and again.inputs != made.inputs
    assert not np.array_equal(np.load(lora / "1" / WEIGHTS_FILE), np.load(tmp_path / "ref1" / WEIGHTS_FILE))
    assert sorted(p.name for p in ws.engine_root(spec).iterdir()) == ["checkpoint", "lora"]  # no temp dirs

    # float16: the storage dtype follows the checkpoint.
    half = load_spec(path, ["model.dtype=float16", "name=half"])
    run_convert(half, ws)
    assert np.load(ws.lora_dir(half) / "2" / WEIGHTS_FILE).dtype == np.float16


def test_a_spec_without_adapters_converts_as_before(tmp_path, hf_llama):
    ws = Workspace(tmp_path / "root")
    spec = load_spec(write_spec(tmp_path / "s.yaml", hf_llama))
    before = run_convert(spec, ws)
    assert sorted(p.name for p in ws.engine_root(spec).iterdir()) == ["checkpoint"]
    with_section = load_spec(write_spec(tmp_path / "t.yaml", hf_llama, lora={"cache": {"host_memory_bytes": 1 << 20}}))
    # the same key: the lora section is not part of what convert writes when it names no adapters
    assert run_convert(with_section, ws).created == before.created


@pytest.mark.parametrize("overrides, words", [
    (["model.dtype=bfloat16"], "a bfloat16 engine cannot take LoRA"),
    (["lora.max_lora_rank=4"], "has rank 8, above lora.max_lora_rank 4"),
])
def test_lora_refusals_come_before_anything_is_written(tmp_path, hf_llama, adapters, overrides, words):
    ws = Workspace(tmp_path / "root")
    path = write_spec(tmp_path / "s.yaml", hf_llama, lora={"adapters": {k: str(v) for k, v in adapters.items()}})
    with pytest.raises(ToolchainError, match=words) as err:
        run_convert(load_spec(path, overrides), ws)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "root" / "engines").exists()


def test_a_moe_family_with_lora_is_refused(tmp_path, adapters):
    hf = make_hf_model("MixtralForCausalLM", tmp_path / "mixtral", seed=3, num_local_experts=4)
    path = write_spec(tmp_path / "s.yaml", hf, lora={"adapters": {"attn": str(adapters["attn"])}})
    with pytest.raises(ToolchainError, match="mixture-of-experts family; LoRA is served for dense"):
        run_convert(load_spec(path), Workspace(tmp_path / "root"))
