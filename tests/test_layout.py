"""The one layout value and its one rule (toolchain/archs/layout.py): what TensorRT-LLM asserts when it splits a
model over tp x pp and its experts over moe_tp x moe_ep, checked in one place that convert, plan and the LLM-API
stage all read; and a scan that the copies it replaced stay gone."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from toolchain.archs.layout import Layout, layout_problems, splits_tp
from toolchain.archs.params import ArchParams
from toolchain.checkpoint import sharding
from toolchain.errors import ToolchainError

PACKAGE = Path(__file__).resolve().parents[1] / "toolchain"


def params(**kw) -> ArchParams:
    base = dict(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=96, num_attention_heads=8,
                num_key_value_heads=2, num_hidden_layers=5, vocab_size=100, head_size=8, rms_norm_eps=1e-5, rope_theta=1e4,
                rope_scaling_json=None, max_position_embeddings=128, tie_word_embeddings=False, attention_bias=False,
                mlp_bias=False, hidden_act="silu", dtype=None)
    return ArchParams(**{**base, **kw})


def moe_params(**kw) -> ArchParams:
    return params(**{"architecture": "MixtralForCausalLM", "num_experts": 8, "top_k": 2, **kw})


def texts(p, layout) -> list[tuple[str, str]]:
    return [(pr.axis, pr.text) for pr in layout_problems(p, layout)]


def test_a_layout_splits_when_every_size_divides():
    assert layout_problems(params(), Layout(tp=2, pp=5)) == []
    assert layout_problems(params(), Layout(tp=8, pp=1)) == []  # 2 KV heads, each duplicated 4x


@pytest.mark.parametrize("tp, want", [
    (3, ("tp", "tp=3 does not divide num_attention_heads=8")),
    (4, None),
    (16, ("tp", "tp=16 does not divide num_attention_heads=8")),
])
def test_heads_over_tp(tp, want):
    got = texts(params(), Layout(tp=tp))
    assert (got[0] if got else None) == want


def test_kv_heads_split_or_duplicate_evenly():
    # 6 KV heads at tp 4: neither divides the other (convert_utils.py dup_kv_weight)
    assert texts(params(num_attention_heads=12, num_key_value_heads=6, intermediate_size=48), Layout(tp=4)) == [
        ("tp", "tp=4 does not divide num_key_value_heads=6")]
    assert texts(params(num_attention_heads=12, num_key_value_heads=3, intermediate_size=48), Layout(tp=4)) == [
        ("tp", "tp=4 is not a multiple of num_key_value_heads=3 (KV heads cannot be duplicated evenly)")]


def test_dense_mlp_over_tp_but_not_a_moe_models():
    assert texts(params(intermediate_size=90), Layout(tp=4)) == [("tp", "tp=4 does not divide intermediate_size=90")]
    # a mixture-of-experts model has no dense MLP: only its expert width is split, over moe_tp
    assert layout_problems(moe_params(intermediate_size=96), Layout(tp=4, given_moe_ep=4)) == []


def test_embedding_split_over_tp():
    p = params(hidden_size=66, num_attention_heads=4, num_key_value_heads=4, intermediate_size=96, head_size=16)
    assert layout_problems(p, Layout(tp=4)) == []
    assert layout_problems(p, Layout(tp=4, parallel_embedding=True, embedding_sharding_dim=0)) == []  # vocab: padded
    assert texts(p, Layout(tp=4, parallel_embedding=True, embedding_sharding_dim=1)) == [
        ("tp", "tp=4 does not divide hidden_size=66 (embedding_sharding_dim 1)")]
    assert texts(p, Layout(tp=4, parallel_embedding=True, embedding_sharding_dim=2))[0][0] == "embedding"


def test_layers_over_pp():
    assert texts(params(), Layout(pp=6)) == [("pp", "pp=6 exceeds num_hidden_layers=5")]
    assert [list(r) for r in Layout(pp=2).stage_layers(5)] == [[0, 1, 2], [3, 4]]  # Mapping.pp_layers


def test_experts_over_moe_ep_and_widths_over_moe_tp():
    p = moe_params(intermediate_size=96)
    assert texts(p, Layout(tp=4, given_moe_tp=1, given_moe_ep=4)) == []
    assert texts(moe_params(num_experts=6), Layout(tp=4, given_moe_ep=4))[0] == (
        "moe", "moe_ep=4 does not divide num_experts=6")
    assert texts(moe_params(intermediate_size=90), Layout(tp=4))[0] == (
        "moe", "moe_tp=4 does not divide the expert intermediate_size=90")
    assert texts(p, Layout(tp=4, given_moe_tp=2, given_moe_ep=4))[0][0] == "moe"  # 2 x 4 != tp


def test_moe_sizes_derive_as_mapping_does():
    assert (Layout(tp=4).moe_tp, Layout(tp=4).moe_ep) == (4, 1)
    assert (Layout(tp=4, given_moe_ep=2).moe_tp, Layout(tp=4, given_moe_ep=2).moe_ep) == (2, 2)
    assert (Layout(tp=4, given_moe_tp=1).moe_tp, Layout(tp=4, given_moe_tp=1).moe_ep) == (1, 4)
    assert Layout(tp=4, given_moe_ep=4).experts_per_rank(8) == 2


def test_splits_tp_keeps_the_rest_of_the_layout():
    p = params(hidden_size=66, num_attention_heads=4, num_key_value_heads=4, head_size=16)
    plain = Layout(tp=1)
    assert splits_tp(p, plain, 4)
    assert not splits_tp(p, dataclasses.replace(plain, parallel_embedding=True, embedding_sharding_dim=1), 4)


def test_convert_refuses_on_the_same_rule_with_the_fix():
    with pytest.raises(ToolchainError) as err:
        sharding.check_parallelism(params(), Layout(tp=3))
    assert err.value.message == "tp=3 does not divide num_attention_heads=8"
    assert err.value.hint == "use parallelism.tp 1, 2, 4 or 8"
    with pytest.raises(ToolchainError) as err:
        sharding.check_parallelism(params(), Layout(pp=6))
    assert (err.value.message, err.value.hint) == ("pp=6 exceeds num_hidden_layers=5", "use parallelism.pp <= 5")


def test_spec_builds_one_layout(tmp_path):
    from toolchain.spec import ParallelismSection

    par = ParallelismSection(tp=4, pp=2, moe_ep=2, parallel_embedding=True, embedding_sharding_dim=1)
    assert par.layout == Layout(4, 2, None, 2, True, 1)
    assert (par.layout.moe_tp, par.layout.moe_ep, par.layout.world_size) == (2, 2, 8)


# The copies of the rule this module replaced, and the loose (tp, moe_tp, moe_ep) derivations: none may return.
GONE = re.compile(r"\b(_tp_problems|_tp_ok|layout_ok|working_tps)\b|(?<!moe)\.moe_sizes\b|def stage_layers\(num_layers|"
                  r"num_attention_heads % t\b")


def test_the_old_copies_are_gone():
    found = [f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
             for path in sorted(PACKAGE.rglob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if GONE.search(line)]
    assert found == []
    # moe_sizes (the Mapping derivation) is called by archs/ alone: every other module reads Layout.moe_tp/moe_ep
    callers = {str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if re.search(r"\bmoe_sizes\(", path.read_text())}
    assert callers <= {"archs/moe.py", "archs/layout.py"}, callers
