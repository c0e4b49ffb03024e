"""Calibration data and the layer-by-layer statistics collector."""

from __future__ import annotations

import pytest
import torch

from conftest import make_hf_llama
from toolchain.errors import ToolchainError
from toolchain.quant import calibration as cal


def _chars(text: str) -> list[int]:
    return [ord(c) % 250 for c in text]


def test_builtin_set_skips_held_out_files_and_fills_windows():
    files = cal.builtin_files()
    assert files and all(f.suffix == ".py" for f in files)
    seqs = cal.calibration_tokens(_chars, "builtin", samples=5, seq_len=64)
    assert len(seqs) == 5 and all(s.shape == (64,) and s.dtype == torch.int64 for s in seqs)
    assert torch.equal(torch.stack(seqs), torch.stack(cal.calibration_tokens(_chars, "builtin", 5, 64)))


def test_prompt_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond one that is long\n")
    seqs = cal.calibration_tokens(_chars, str(txt), samples=8, seq_len=6)
    assert [s.tolist() for s in seqs] == [_chars("first ")[:6], _chars("second")]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"text": "abc"}\n"de"\n{"prompt": "fgh"}\n')
    assert [len(s) for s in cal.calibration_tokens(_chars, str(jl), samples=2, seq_len=10)] == [3, 2]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{oops\n')
    with pytest.raises(ToolchainError, match="line 2"):
        cal.calibration_tokens(_chars, str(bad), 4, 8)
    empty = tmp_path / "e.txt"
    empty.write_text("")
    with pytest.raises(ToolchainError, match="empty"):
        cal.calibration_tokens(_chars, str(empty), 4, 8)


def test_layer_by_layer_stats_match_the_whole_model(tmp_path):
    from transformers import AutoModelForCausalLM

    hf = make_hf_llama(tmp_path / "m", num_hidden_layers=3)
    seqs = [torch.randint(0, 250, (n,)) for n in (9, 5)]
    stats = cal.collect_stats(hf, seqs, covariance=True)
    assert len(stats) == 3
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    seen = {}
    for i, layer in enumerate(model.model.layers):
        for slot, name in cal.SLOTS.items():
            layer.get_submodule(name).register_forward_pre_hook(
                lambda _m, a, key=(i, slot): seen.setdefault(key, []).append(a[0].reshape(-1, a[0].shape[-1])))
    with torch.no_grad():
        for s in seqs:
            model(s[None])
    for (i, slot), xs in seen.items():
        x = torch.cat(xs)
        st = stats[i].inputs[slot]
        assert st.tokens == 14
        assert torch.allclose(st.amax, x.abs().amax(0), atol=1e-5)
        assert torch.allclose(st.absmean, x.abs().mean(0), atol=1e-5)
        assert torch.allclose(st.cov, (x.double().t() @ x.double()) / 14, atol=1e-4)
    assert all(s.qkv_amax > 0 for s in stats)


def test_stats_stream_calibrates_on_demand_and_keeps_one_layers_matrices(tmp_path):
    hf = make_hf_llama(tmp_path / "m", num_hidden_layers=3)
    seqs = [torch.randint(0, 250, (n,)) for n in (9, 5)]
    done = []
    stats = cal.collect_stats(hf, seqs, covariance=True, progress=done.append)
    assert len(stats) == 3 and done == []           # nothing runs until a layer is asked for
    assert stats[1].inputs["qkv"].xtx is not None and len(done) == 2
    assert stats[0].inputs["qkv"].xtx is None        # behind the writer: its matrices are gone
    with pytest.raises(RuntimeError, match="already dropped"):
        _ = stats[0].inputs["mlp"].cov
    assert stats[0].inputs["mlp"].absmean.shape[0] > 0 and stats[0].qkv_amax > 0  # the small stats stay
    assert [s.qkv_amax > 0 for s in stats] == [True] * 3 and len(done) == 3
    with pytest.raises(IndexError):
        stats[3]
