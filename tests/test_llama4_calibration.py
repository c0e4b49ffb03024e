"""Llama 4's calibration (quant/calibration_llama4.py): run layer by layer, each linear's input statistics, the
KV amax and every expert's down-projection amax equal what hooks on transformers' whole Llama4ForCausalLM record
over the same sequences, chunked masks, NoPE temperature and router-scaled expert inputs included."""

from __future__ import annotations

import torch
from test_parity_families import hf_dir, reference

from toolchain.quant.calibration import collect_stats

FAMILY = "llama4-chunked-nope-moe"  # layers 0 and 2 dense, 1 and 3 mixtures; layer 2 NoPE; chunks of 4 tokens


def _whole_model_stats(model, seqs):
    """slot -> per layer amax, from forward hooks on the whole model (the ground truth)."""
    got: dict[tuple[int, str], torch.Tensor] = {}
    kv: dict[int, float] = {}
    routed: dict[int, list[float]] = {}

    def keep(key):
        def hook(_m, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).abs().amax(0)
            got[key] = torch.maximum(got[key], x) if key in got else x
        return hook

    def kv_keep(i):
        def hook(_m, _a, out):
            kv[i] = max(kv.get(i, 0.0), float(out.abs().max()))
        return hook

    def experts_keep(i, moe):
        def hook(_m, args):  # every expert's down input over every token at its own score, computed directly
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            s = torch.sigmoid(x @ moe.router.weight.T)
            now = [float((torch.nn.functional.silu(g) * u).abs().max())
                   for e in range(s.shape[1]) for g, u in [((x * s[:, e:e + 1]) @ moe.experts.gate_up_proj[e])
                                                          .chunk(2, -1)]]
            routed[i] = [max(a, b) for a, b in zip(routed.get(i, now), now, strict=True)]
        return hook

    hooks = []
    for i, layer in enumerate(model.model.layers):
        ff = layer.feed_forward
        watched = {"qkv": layer.self_attn.q_proj, "dense": layer.self_attn.o_proj}
        if hasattr(ff, "experts"):
            watched.update(mlp=ff, shared_proj=ff.shared_expert.down_proj)
            hooks.append(ff.register_forward_pre_hook(experts_keep(i, ff)))
        else:
            watched.update(mlp=ff.gate_proj, proj=ff.down_proj)
        hooks += [m.register_forward_pre_hook(keep((i, slot))) for slot, m in watched.items()]
        hooks += [getattr(layer.self_attn, n).register_forward_hook(kv_keep(i)) for n in ("q_proj", "k_proj", "v_proj")]
    with torch.no_grad():
        for s in seqs:
            model(s[None])
    for h in hooks:
        h.remove()
    return got, kv, routed


def test_layer_by_layer_statistics_equal_the_whole_models(tmp_path_factory):
    path = hf_dir(tmp_path_factory, FAMILY, "float32")
    g = torch.Generator().manual_seed(5)
    seqs = [torch.randint(3, 256, (11,), generator=g) for _ in range(3)]  # 11 tokens: three chunks, NoPE scale > 1
    want, kv, routed = _whole_model_stats(reference(path, torch.float32), seqs)
    stats = collect_stats(path, seqs, covariance=False)
    assert len(stats) == 4
    for i, st in enumerate(stats):
        moe = i % 2 == 1
        assert set(st.inputs) == ({"qkv", "dense", "mlp", "shared_proj"} if moe else {"qkv", "dense", "mlp", "proj"})
        for slot, s in st.inputs.items():
            torch.testing.assert_close(s.amax, want[(i, slot)], rtol=1e-5, atol=1e-6)
            assert s.tokens == 33
        assert abs(st.qkv_amax - kv[i]) <= 1e-5 * kv[i]
        if moe:
            assert len(st.expert_proj_amax) == 4
            torch.testing.assert_close(torch.tensor(st.expert_proj_amax), torch.tensor(routed[i]), rtol=1e-5, atol=0)
        else:
            assert st.expert_proj_amax == []
