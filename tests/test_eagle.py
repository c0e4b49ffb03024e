"""EAGLE-1 conversion: a draft in EAGLE's published layout becomes the EagleNets of an
EagleForCausalLM checkpoint under upstream's module-tree names, sharded over the world,
with EagleConfig's fields; the refusals upstream's README and model code imply come before
any write, and the CPU target refuses EAGLE in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from conftest import make_hf_llama, write_eagle_draft, write_spec
from toolchain.checkpoint.stage import plan_convert, run_convert
from toolchain.draft_tree import MC_SIM_7B_63, non_leaves_per_level
from toolchain.errors import ToolchainError
from toolchain.plan.plan import heads_rank_bytes
from toolchain.checks.preflight import FAIL, PASS
from toolchain.spec import load_spec
from toolchain.upstream import facts
from toolchain.workspace import Workspace

UP = facts("eagle")
NAMES = UP["names"]
TREE = "{0}, {1}, {0, 0}, {0, 1}, {0, 0, 0}"  # 5 nodes, 3 levels


def eagle_spec(root: Path, hf_dir: Path, draft: Path | None, *, target="trtllm", tp=1, pp=1, choices=TREE, **extra):
    root.mkdir(parents=True, exist_ok=True)
    spec = {"mode": "eagle", **({"heads": str(draft)} if draft else {}), **({"choices": choices} if choices else {}),
            **extra.pop("speculative", {})}
    return load_spec(write_spec(root / "spec.yaml", hf_dir, target=target, parallelism={"tp": tp, "pp": pp},
                                speculative=spec, **extra))


def rank_tensors(ckpt: Path, tp: int, prefix: str = "eagle_nets") -> list[dict[str, torch.Tensor]]:
    out = []
    for r in range(tp):
        with safe_open(str(ckpt / f"rank{r}.safetensors"), "pt") as fh:
            out.append({k: fh.get_tensor(k) for k in fh.keys() if k.startswith(prefix)})
    return out


def test_upstream_facts_describe_the_module_tree():
    # EagleConfig's keywords are the config keys written, and the flags that shape the drafter are recorded.
    for key in ("num_layers", "max_draft_len", "max_non_leaves"):
        assert UP["config_keys"][key] in UP["config_params"]
    assert UP["config_params"]["max_non_leaves_per_layer"]["default"] == 10
    assert {"fc_after_embed", "no_first_input_layernorm", "no_ln_f", "nets_whole_world"} <= set(UP["rules"])
    # The default tree's shape is what the README states: 63 nodes, 4 deep, 10 non-leaves on a level.
    assert len(MC_SIM_7B_63) == 63 and max(map(len, MC_SIM_7B_63)) == 4
    assert max(non_leaves_per_level(MC_SIM_7B_63)) == 10


@pytest.mark.parametrize("tp", [1, 2])
def test_converted_checkpoint_has_upstream_names_config_and_tp_slices(tmp_path, hf_llama, tp):
    draft = write_eagle_draft(tmp_path / "draft", hf_llama)
    spec = eagle_spec(tmp_path, hf_llama, draft, tp=tp)
    ws = Workspace(tmp_path)
    run_convert(spec, ws)
    ckpt = ws.checkpoint_dir(spec)
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architecture"] == UP["architecture"]
    assert (cfg["num_eagle_layers"], cfg["max_draft_len"], cfg["max_non_leaves_per_layer"]) == (3, 5, 10)
    net = cfg["eagle_net_config"]
    assert net["architecture"] == UP["net_architecture"] and net["num_hidden_layers"] == 1
    assert net["hidden_size"] == cfg["hidden_size"] and net["vocab_size"] == cfg["vocab_size"]
    src = load_file(str(draft / "model.safetensors"))
    base = load_file(next(hf_llama.glob("*.safetensors")))
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    padded = -(-vocab // tp) * tp
    ranks = rank_tensors(ckpt, tp)
    layer = [f"layers.0.{n}" for n in ("attention.qkv.weight", "attention.dense.weight", "mlp.fc.weight",
                                          "mlp.gate.weight", "mlp.proj.weight", "post_layernorm.weight")]
    expected = set()
    for i in range(3):
        expected |= {NAMES["fc"].format(i=i, part=p) for p in ("weight", "bias")}
        expected |= {NAMES["embedding"].format(i=i), NAMES["lm_head"].format(i=i)}
        expected |= {NAMES["layer"].format(i=i, layer=0, name=n.removeprefix("layers.0.")) for n in layer}
    # No input_layernorm in the first layer and no ln_f: the drafter does not declare them.
    assert set(ranks[0]) == expected
    fc, lm = NAMES["fc"].format(i=0, part="weight"), NAMES["lm_head"].format(i=0)
    assert ranks[0][fc].shape == (hidden // tp, 2 * hidden) and ranks[0][lm].shape == (padded // tp, hidden)
    assert torch.equal(torch.cat([r[fc] for r in ranks]), src["fc.weight"])
    assert torch.equal(torch.cat([r[NAMES["fc"].format(i=0, part="bias")] for r in ranks]), src["fc.bias"])
    full_lm = torch.cat([r[lm] for r in ranks])
    assert torch.equal(full_lm[:vocab], base["lm_head.weight"]) and not full_lm[vocab:].any()
    # Row-parallel dense: the rank slices on dim 1 are the draft's o_proj.
    dense = NAMES["layer"].format(i=0, layer=0, name="attention.dense.weight")
    assert torch.equal(torch.cat([r[dense] for r in ranks], dim=1), src["layers.0.self_attn.o_proj.weight"])
    # Every EagleNet holds the same draft (upstream duplicates it per level).
    for name in ranks[0]:
        twin = name.replace("eagle_nets.0.", "eagle_nets.2.")
        assert torch.equal(ranks[0][name], ranks[0][twin])
    # The base model is converted as usual next to the nets.
    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as fh:
        assert "transformer.layers.0.attention.qkv.weight" in fh.keys() and "lm_head.weight" in fh.keys()


def test_deeper_draft_with_prefixed_names_and_the_targets_embedding(tmp_path, hf_llama):
    # Two draft layers under `model.`: the second keeps its input_layernorm; without embed_tokens the
    # target's embedding is copied into every net.
    draft = write_eagle_draft(tmp_path / "draft", hf_llama, layers=2, with_embed=False, prefix="model.")
    spec = eagle_spec(tmp_path, hf_llama, draft, choices="{0}, {0, 0}")
    ws = Workspace(tmp_path)
    run_convert(spec, ws)
    ranks = rank_tensors(ws.checkpoint_dir(spec), 1)
    src = load_file(str(draft / "model.safetensors"))
    base = load_file(next(hf_llama.glob("*.safetensors")))
    ln = NAMES["layer"].format(i=1, layer=1, name="input_layernorm.weight")
    assert torch.equal(ranks[0][ln], src["model.layers.1.input_layernorm.weight"])
    assert NAMES["layer"].format(i=1, layer=0, name="input_layernorm.weight") not in ranks[0]
    assert torch.equal(ranks[0][NAMES["embedding"].format(i=0)], base["model.embed_tokens.weight"])
    assert json.loads((ws.checkpoint_dir(spec) / "config.json").read_text())["num_eagle_layers"] == 2


def test_plans_count_the_nets_on_every_rank(tmp_path, hf_llama):
    draft = write_eagle_draft(tmp_path / "draft", hf_llama)
    spec = eagle_spec(tmp_path, hf_llama, draft, tp=2)
    plan = plan_convert(spec)
    nets = [sum(t.nbytes for t in rank if t.name.startswith("eagle_nets")) for rank in plan.ranks]
    assert nets[0] == nets[1] > 0
    from toolchain.archs import load_params

    _, params = load_params(json.loads((hf_llama / "config.json").read_text()))
    assert heads_rank_bytes(spec, params, spec.model.dtype) == nets[0]


def test_drafts_and_trees_that_do_not_fit_are_refused_before_any_write(tmp_path, hf_llama):
    draft = write_eagle_draft(tmp_path / "draft", hf_llama)
    narrow = make_hf_llama(tmp_path / "narrow", hidden_size=32, intermediate_size=64)
    cases = [
        (eagle_spec(tmp_path / "a", hf_llama, write_eagle_draft(tmp_path / "d32", narrow)), "hidden size"),
        (eagle_spec(tmp_path / "b", hf_llama, draft, pp=2), "pp"),
        (eagle_spec(tmp_path / "c", hf_llama, draft, quantization={"method": "int8_wo"}), "unquantized"),
        (eagle_spec(tmp_path / "d", hf_llama, draft, speculative={"max_draft_len": 3}), "max_draft_len"),
        (eagle_spec(tmp_path / "e", hf_llama, draft, choices="{0}, {1, 0}"), "no parent"),
    ]
    for spec, needle in cases:
        with pytest.raises(ToolchainError, match=needle):
            run_convert(spec, Workspace(spec.source.parent))
        assert not (spec.source.parent / "engines").exists() or not any(
            (spec.source.parent / "engines").rglob("rank*.safetensors"))
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((draft / "config.json").read_text())
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ToolchainError, match="pickle"):
        run_convert(eagle_spec(tmp_path / "f", hf_llama, pickled), Workspace(tmp_path / "f"))
    broken = write_eagle_draft(tmp_path / "broken", hf_llama)
    state = load_file(str(broken / "model.safetensors"))
    del state["fc.bias"]
    from safetensors.torch import save_file

    save_file(state, str(broken / "model.safetensors"))
    with pytest.raises(ToolchainError, match="lacks fc.bias"):
        run_convert(eagle_spec(tmp_path / "g", hf_llama, broken), Workspace(tmp_path / "g"))


def test_plan_checks_refuse_eagle_on_cpu_and_pass_a_fitting_gpu_spec(tmp_path, hf_llama):
    from toolchain.checks.preflight import build_context, run_checks

    def checks(spec):
        return {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(spec.source.parent)))}

    draft = write_eagle_draft(tmp_path / "draft", hf_llama)
    by_id = checks(eagle_spec(tmp_path / "gpu", hf_llama, draft))
    assert by_id["spec.eagle-draft"].status == PASS and "3 EagleNets" in by_id["spec.eagle-draft"].message
    assert by_id["spec.mode-runnable"].status == PASS
    cpu = checks(eagle_spec(tmp_path / "cpu", hf_llama, draft, target="cpu"))
    assert cpu["spec.mode-runnable"].status == FAIL and "EAGLE" in cpu["spec.mode-runnable"].message
    bad = checks(eagle_spec(tmp_path / "bad", hf_llama, draft, choices="{0}, {1}, {2}",
                            speculative={"max_draft_len": 2}))
    assert bad["spec.eagle-draft"].status == FAIL and "max_draft_len" in bad["spec.eagle-draft"].message


def test_gpu_build_and_repository_carry_the_eagle_settings(tmp_path, hf_llama_words, monkeypatch, capsys):
    """build-engine through the fake trtllm-build (flags checked against 1.2.1's table) and the
    Triton repository for the tensorrtllm backend: EAGLE mode, the draft length taken from the
    checkpoint, and decoding_mode eagle with the spec's tree."""
    import os

    from toolchain.cli import main
    from toolchain.engine import trtllm

    fake = Path(__file__).resolve().parent / "fake_trtllm_build"
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("PYTHONPATH", str(fake / "site"))
    record = tmp_path / "calls.jsonl"
    monkeypatch.setenv("FAKE_TRTLLM_BUILD_RECORD", str(record))
    draft = write_eagle_draft(tmp_path / "draft", hf_llama_words)
    spec = eagle_spec(tmp_path, hf_llama_words, draft, tp=2, build={"mpi": "never"})
    ws = str(tmp_path / "ws")
    assert main(["--root", ws, "build-engine", str(spec.source)]) == 0, capsys.readouterr().err
    [line] = record.read_text().splitlines()
    args = trtllm.validate(json.loads(line)["argv"])
    assert args["--speculative_decoding_mode"] == "eagle" and "--max_draft_len" not in args
    assert main(["--root", ws, "model-repo", str(spec.source)]) == 0, capsys.readouterr().err
    pbtxt = next(Path(ws).glob("model_repo/*/tensorrt_llm/config.pbtxt")).read_text()
    assert 'key: "decoding_mode"' in pbtxt and 'string_value: "eagle"' in pbtxt
    assert f'string_value: "{TREE}"' in pbtxt


def test_model_repo_and_serve_refuse_eagle_without_a_draft(tmp_path, hf_llama_words, capsys):
    """As Medusa without heads: no repository saying decoding_mode eagle for an engine that has no
    EagleNets (the backend would fall back to its 63-node default tree); one line naming the fix."""
    from toolchain.cli import main

    spec = eagle_spec(tmp_path, hf_llama_words, None, choices=None,
                      serving={"http_port": 0, "grpc_port": 0, "metrics_port": 0})
    assert spec.speculative.heads is None
    ws = str(tmp_path / "ws")
    for argv in (["model-repo", str(spec.source)], ["serve", str(spec.source)]):
        assert main(["--root", ws, *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "spec.eagle-draft" in err and "set speculative.heads" in err, err
    assert not (tmp_path / "ws" / "model_repo").exists()
