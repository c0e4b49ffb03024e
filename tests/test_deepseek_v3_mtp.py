"""DeepSeek-V3's multi-token prediction (speculative.mode mtp): convert keeps the MTP layer, the CPU engine drafts with
it and verifies the drafts, the CPU stand-in of the LLM API serves it and reports acceptance, and plan counts it.

transformers 5.25 has no MTP module (it drops model.layers.{num_hidden_layers}.*), so the fixture writes the layer
itself: a decoder layer plus enorm, hnorm, eh_proj and shared_head.norm, trained for a few seconds to predict the
token two ahead of the tiny model's own greedy text (so drafts are accepted often, not never). The references are
(a) greedy output with MTP equal to greedy output without it and (b) `reference_logits`, the MTP formula written
out here over transformers' own DeepseekV3 decoder layer holding the MTP weights."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from conftest import DEEPSEEK_V3_TINY, make_hf_model
from safetensors.torch import load_file, save_file
from test_engine_cpu_util import _one_thread, make_engine_dir  # noqa: F401

from toolchain.checkpoint.convert import convert_checkpoint
from toolchain.engine.cpu import CpuEngine, SamplingParams
from toolchain.engine.cpu.kv_cache import BlockTable
from toolchain.engine.cpu.model import Chunk
from toolchain.errors import ToolchainError

ARCH = "DeepseekV3ForCausalLM"
N = 3  # main layers; the MTP layer is model.layers.3
TINY = {**DEEPSEEK_V3_TINY, "num_hidden_layers": N}
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")
PROMPTS = [[1, 17, 101, 3, 44, 90, 91, 92, 12, 240, 6], [1, 5, 9, 33, 200, 7, 7, 7, 8, 9, 10, 11, 12, 13],
           [1, 60, 61, 62, 63, 64]]
NEW = 24

_CACHE: dict = {}


class Mtp:
    """The MTP module as the formula says, over transformers' DeepseekV3 decoder layer: x_t = eh_proj([enorm(
    embed(token_{t+1})); hnorm(h_t)]), h_t the main model's last hidden state after its final norm; the decoder
    layer over x at positions 0.., causal; logits = lm_head(shared_head.norm(out))."""

    def __init__(self, hf_dir: Path):
        from transformers import AutoModelForCausalLM, DeepseekV3Model

        self.main = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
        # transformers builds layer N (a mixture, as N >= first_k_dense_replace) when told of N + 1 layers
        self.full = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, num_hidden_layers=N + 1)
        config = copy.deepcopy(self.main.config)
        config.num_hidden_layers = 1
        self.block = DeepseekV3Model(config)
        self.block.layers = torch.nn.ModuleList([self.full.model.layers[N]])
        stored, hidden = load_file(hf_dir / "model.safetensors"), config.hidden_size
        fresh = {"eh_proj.weight": 0.2 * torch.randn(hidden, 2 * hidden)}  # before training: norms at one
        self.own = {k: torch.nn.Parameter(stored[f"model.layers.{N}.{k}"].clone() if f"model.layers.{N}.{k}" in stored
                                          else fresh.get(k, torch.ones(hidden))) for k in OWN}
        self.block.norm.weight = self.own["shared_head.norm.weight"]
        self.eps = config.rms_norm_eps

    def hidden(self, tokens: list[int]) -> torch.Tensor:
        got = {}
        hook = self.main.model.norm.register_forward_hook(lambda _m, _args, out: got.__setitem__("h", out))
        with torch.no_grad():
            self.main(torch.tensor([tokens]))
        hook.remove()
        return got["h"][0]

    def logits(self, tokens: list[int], h: torch.Tensor | None = None) -> torch.Tensor:
        """[len(tokens) - 1, V]: row t predicts tokens[t + 2]."""
        h = self.hidden(tokens) if h is None else h

        def norm(x, w):
            return torch.nn.functional.rms_norm(x, (x.shape[-1],), w, self.eps)

        e = self.main.model.embed_tokens(torch.tensor(tokens[1:]))
        x = torch.nn.functional.linear(torch.cat([norm(e, self.own["enorm.weight"]),
                                                  norm(h[:-1], self.own["hnorm.weight"])], -1),
                                       self.own["eh_proj.weight"])
        return self.main.lm_head(self.block(inputs_embeds=x[None], use_cache=False).last_hidden_state[0])

    def train(self, steps: int = 300) -> None:
        """Fit the MTP layer (Adam, seconds on one core) to what it should predict: at t, the main model's own
        greedy token at t + 1, over random token sequences."""
        g = torch.Generator().manual_seed(0)
        data = []
        with torch.no_grad():
            for _ in range(64):
                s = torch.randint(3, 250, (32,), generator=g).tolist()
                h = self.hidden(s)
                data.append((s, h, self.main.lm_head(h).argmax(-1)[1:]))
        opt = torch.optim.Adam([*self.own.values(), *self.block.layers.parameters()], lr=3e-3)
        for step in range(steps):
            s, h, target = data[step % len(data)]
            loss = torch.nn.functional.cross_entropy(self.logits(s, h), target)
            opt.zero_grad()
            loss.backward()
            opt.step()

    def save(self, hf_dir: Path, tmp: Path) -> None:
        """model.layers.N.* as a released checkpoint stores them (per-expert names: transformers' own save), with
        the MTP layer's own tensors and a copy of the embedding under it."""
        self.full.save_pretrained(tmp, safe_serialization=True)
        layer = {k: v for k, v in load_file(tmp / "model.safetensors").items() if k.startswith(f"model.layers.{N}.")}
        stored = load_file(hf_dir / "model.safetensors")
        own = {f"model.layers.{N}.{k}": v.detach().clone() for k, v in self.own.items()}
        own[f"model.layers.{N}.embed_tokens.weight"] = stored["model.embed_tokens.weight"].clone()
        save_file({**stored, **layer, **own}, hf_dir / "model.safetensors")


def with_mtp(factory, trained: bool = True) -> tuple[Path, Mtp]:
    """The tiny model with an MTP layer, and its reference (re-read from the saved checkpoint). Trained: the main
    model's attention output scaled by 0.1 first, so its next token depends mostly on the current one and a
    one-layer module can learn to foresee it (about 70% of held-out tokens); untrained: the model as it is with
    transformers' random init of the layer."""
    if trained not in _CACHE:
        torch.manual_seed(5)
        hf = make_hf_model(ARCH, factory.mktemp("hf-dsv3-mtp"), seed=21, **TINY)
        if trained:
            w = load_file(hf / "model.safetensors")
            save_file({k: 0.1 * v if k.endswith("o_proj.weight") else v for k, v in w.items()}, hf / "model.safetensors")
        mtp = Mtp(hf)
        if trained:
            mtp.train()
        mtp.save(hf, factory.mktemp("hf-dsv3-mtp-save"))
        _CACHE[trained] = hf, Mtp(hf)
    return _CACHE[trained]


def engine(factory, tp: int, mtp_layers: int, trained: bool = True) -> CpuEngine:
    key = ("engine", tp, mtp_layers, trained)
    if key not in _CACHE:
        hf, _ = with_mtp(factory, trained)
        out = factory.mktemp(f"engine-mtp-tp{tp}-{mtp_layers}-{trained}")
        _CACHE[key] = CpuEngine.load(make_engine_dir(hf, out, tp, 1, convert_kwargs={"mtp_layers": mtp_layers}))
    return _CACHE[key]


def run(eng: CpuEngine, prompt: list[int], new: int = NEW, **sampling):
    seq = eng.start(prompt, SamplingParams(max_new_tokens=new, **sampling))
    eng.add(seq)
    try:
        while not seq.finished:
            eng.step([(seq, seq.pending)])
    finally:
        eng.release(seq)
    return seq


# -- convert ----------------------------------------------------------------------------------------------------


def test_convert_keeps_the_mtp_layer_only_when_asked(tmp_path_factory, tmp_path):
    hf, _ = with_mtp(tmp_path_factory)
    for tp in (1, 2):
        (tmp_path / f"mtp{tp}").mkdir()
        config = convert_checkpoint(hf, tmp_path / f"mtp{tp}", tp=tp, pp=1, dtype="float32", target="cpu",
                                    mtp_layers=1)
        assert config["num_hidden_layers"] == N and config["num_nextn_predict_layers"] == 1
        for rank in range(tp):
            written = load_file(tmp_path / f"mtp{tp}" / f"rank{rank}.safetensors")
            layer = {n.removeprefix(f"transformer.layers.{N}."): t for n, t in written.items()
                     if n.startswith(f"transformer.layers.{N}.")}
            assert layer["eh_proj.weight"].shape == (64, 128)  # whole on every rank
            assert {"enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.router.weight",
                    "attention.kv_b_proj.weight"} <= set(layer)
            assert layer["attention.q_b_proj.weight"].shape[0] == 4 // tp * (16 + 8)  # split by head as any layer's
            assert not any("embed_tokens" in n or "shared_head.head" in n for n in layer)
    (tmp_path / "plain").mkdir()
    config = convert_checkpoint(hf, tmp_path / "plain", tp=1, pp=1, dtype="float32", target="cpu")
    assert "num_nextn_predict_layers" not in config
    assert not any(f".layers.{N}." in n for n in load_file(tmp_path / "plain" / "rank0.safetensors"))


def test_convert_refuses_mtp_in_one_line(tmp_path_factory, tmp_path):
    from test_deepseek_v3 import tiny

    hf, _ = with_mtp(tmp_path_factory)
    no_weights = tiny(tmp_path_factory)  # the tiny model as transformers writes it: no layer 3
    none_declared = tmp_path / "none"  # and one whose config.json says it has none
    none_declared.mkdir()
    for f in no_weights.iterdir():
        (none_declared / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((none_declared / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    cfg.pop("num_mtp_layers", None)
    (none_declared / "config.json").write_text(json.dumps(cfg))
    cases = [(no_weights, 1, "the weights lack model.layers.3.enorm.weight"),
             (none_declared, 1, "num_nextn_predict_layers 0"),
             (hf, 2, "PP \\+ MTP combination is not supported")]
    for i, (src, pp, message) in enumerate(cases):
        (tmp_path / f"out{i}").mkdir()
        with pytest.raises(ToolchainError, match=message) as err:
            convert_checkpoint(src, tmp_path / f"out{i}", tp=1, pp=pp, dtype="float32", target="cpu", mtp_layers=1)
        assert "\n" not in str(err.value)


# -- the CPU engine ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "random"])
def test_the_mtp_forward_is_the_formula(tmp_path_factory, trained):
    """The engine's MTP layer over a whole sequence (its own cache layer written, then read by each position)
    equals the formula over transformers' decoder layer, at tp 1 and tp 2."""
    _, ref = with_mtp(tmp_path_factory, trained)
    tokens = PROMPTS[1]
    want = ref.logits(tokens).detach()
    for tp in (1, 2):
        eng = engine(tmp_path_factory, tp, 1, trained)
        table = BlockTable()
        eng.kv.add_sequence(table, tokens, reuse=False)
        try:
            with torch.no_grad():
                main = Chunk(table, tokens, logits=len(tokens), want_states=True)
                logits = eng.model.forward([main], eng.kv)[0]
                assert main.states is not None and logits is not None
                torch.testing.assert_close(main.states, ref.hidden(tokens), atol=1e-4, rtol=0)
                got = eng.model.mtp_forward([Chunk(table, tokens[1:], logits=len(tokens) - 1,
                                                   states=main.states[:-1])], eng.kv)[0]
        finally:
            eng.kv.release(table)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("trained", [True, False], ids=["trained", "random"])
@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_output_with_mtp_is_greedy_output_without(tmp_path_factory, tp, trained):
    """Lossless: every emitted token is the main model's own greedy choice, whether the drafts are mostly accepted
    (the trained layer) or mostly rejected (random weights, the model's attention at full strength)."""
    plain, mtp = engine(tmp_path_factory, tp, 0, trained), engine(tmp_path_factory, tp, 1, trained)
    drafted = accepted = 0
    for prompt in PROMPTS:
        want, got = run(plain, prompt), run(mtp, prompt)
        assert got.output == want.output and want.drafted == 0
        # one draft per generation step, each step emitting its accepted drafts and one token of its own
        assert got.drafted + got.accepted_draft == NEW - 1
        drafted, accepted = drafted + got.drafted, accepted + got.accepted_draft
    rate = accepted / drafted
    assert rate > 0.4 if trained else rate < 0.2, (accepted, drafted)
    assert mtp.kv.k.shape[0] == N + 1 and plain.kv.k.shape[0] == N  # the MTP layer's own latent cache layer


def test_sampled_output_with_mtp_is_the_same_seed_for_seed(tmp_path_factory):
    """A draft is accepted only where the target's own sample equals it, so sampling keeps its distribution; with
    the sampler's per-position draws the tokens are even the same as without MTP for the same seed."""
    plain, mtp = engine(tmp_path_factory, 1, 0), engine(tmp_path_factory, 1, 1)
    accepted = 0
    for seed, prompt in enumerate(PROMPTS):
        sampling = {"temperature": 0.8, "top_k": 4, "seed": seed}
        got = run(mtp, prompt, **sampling)
        assert got.output == run(plain, prompt, **sampling).output
        accepted += got.accepted_draft
    assert accepted > 0


def test_mtp_under_chunked_context_prefix_reuse_and_batching(tmp_path_factory):
    """The inflight batcher with prompts cut into 8-token chunks, a 24-token prefix shared (its blocks reused the
    second time round, MTP entries included) and requests decoding side by side: still the plain greedy output."""
    import threading

    from toolchain.engine.cpu import InflightBatcher, SchedulerConfig

    hf, _ = with_mtp(tmp_path_factory)
    eng = CpuEngine.load(make_engine_dir(hf, tmp_path_factory.mktemp("engine-mtp-chunked"), 1, 1,
                                         convert_kwargs={"mtp_layers": 1}, max_num_tokens=16,
                                         plugin_config={"tokens_per_block": 8}))
    plain = engine(tmp_path_factory, 1, 0)
    prefix = list(range(3, 27))
    prompts = [prefix + [40], prefix + [41, 42], [1, 60, 61, 62, 63, 64]]
    with InflightBatcher(eng, SchedulerConfig(enable_chunked_context=True)) as b:
        for round_ in range(2):
            got: dict = {i: [] for i in range(len(prompts))}
            done = threading.Semaphore(0)

            def callback(i, got=got, done=done):
                def cb(tokens, finished, error):
                    got[i].extend(tokens if error is None else [error])
                    if finished:
                        done.release()
                return cb

            for i, prompt in enumerate(prompts):
                b.submit((round_, i), prompt, SamplingParams(max_new_tokens=16), callback(i))
            for _ in prompts:
                assert done.acquire(timeout=120)
            assert [got[i] for i in range(len(prompts))] == [run(plain, p, 16).output for p in prompts]
        stats = b.stats
    assert stats.chunked_steps > 0 and eng.kv.reused_total > 0 and stats.max_running > 1
    assert stats.accepted_draft_tokens > 0.4 * stats.draft_tokens


# -- the LLM API's CPU stand-in (target llmapi-cpu) ------------------------------------------------------------


def test_the_llmapi_cpu_stand_in_serves_mtp_and_reports_acceptance(tmp_path_factory, tmp_path):
    """LLM(speculative_config=MTPDecodingConfig) at tp 2 through the inflight batcher: greedy output as without it,
    and each request's perf metrics count its drafts and accepted drafts, as the PyTorch backend reports them."""
    import shutil
    import threading

    from triton_helpers import make_tiny_tokenizer

    from toolchain.llmapi.cpu_llm import CpuLLM
    from toolchain.llmapi.cpu_llm import SamplingParams as LlmParams

    src, _ = with_mtp(tmp_path_factory)
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    make_tiny_tokenizer(hf)
    plain = engine(tmp_path_factory, 2, 0)
    outputs: dict = {}
    done = threading.Event()
    with CpuLLM(model=str(hf), backend="pytorch", tensor_parallel_size=2, max_batch_size=4, max_seq_len=64,
                speculative_config={"decoding_type": "MTP", "num_nextn_predict_layers": 1},
                work_dir=tmp_path / "work") as llm:
        assert llm.spec.speculative.mode == "mtp" and llm.engine.mtp_draft_len == 1

        def on_output(out):
            if out.finished:
                outputs[out.request_id] = out
                if len(outputs) == len(PROMPTS):
                    done.set()

        for prompt in PROMPTS:  # batched: the three run in the same steps
            llm.generate_async(prompt, LlmParams.from_kwargs({"max_tokens": NEW, "ignore_eos": True,
                                                             "return_perf_metrics": True}), on_output=on_output)
        assert done.wait(120)
        stats = llm.stats
    drafted = accepted = 0
    for out, prompt in zip(sorted(outputs.values(), key=lambda o: o.request_id), PROMPTS, strict=True):
        c = out.outputs[0]
        assert c.token_ids == run(plain, prompt).output
        perf = c.request_perf_metrics
        assert perf.total_draft_tokens + perf.total_accepted_draft_tokens == NEW - 1
        assert perf.acceptance_rate == perf.total_accepted_draft_tokens / perf.total_draft_tokens
        drafted, accepted = drafted + perf.total_draft_tokens, accepted + perf.total_accepted_draft_tokens
    assert (stats.draft_tokens, stats.accepted_draft_tokens) == (drafted, accepted)
    assert accepted / drafted > 0.4, (accepted, drafted)


@pytest.mark.parametrize("config, message", [
    ({"decoding_type": "MTP", "num_nextn_predict_layers": 2}, "num_nextn_predict_layers 2"),
    ({"decoding_type": "MTP", "use_relaxed_acceptance_for_thinking": True}, "use_relaxed_acceptance_for_thinking"),
    ({"decoding_type": "NGram", "max_draft_len": 3}, "runs MTP only"),
])
def test_the_stand_in_refuses_what_it_does_not_run(tmp_path_factory, config, message):
    from toolchain.llmapi.cpu_llm import LlmArgsError, engine_spec

    hf, _ = with_mtp(tmp_path_factory)
    with pytest.raises(LlmArgsError, match=message) as err:
        engine_spec({"model": str(hf), "speculative_config": config})
    assert "\n" not in str(err.value)


def test_the_checks_pass_mtp_on_llmapi_cpu_for_deepseek_only(tmp_path_factory, tmp_path, hf_llama):
    from test_llmapi_path import llmapi_spec

    from toolchain.checks.preflight import build_context, run_checks
    from toolchain.workspace import Workspace

    hf, _ = with_mtp(tmp_path_factory)
    for model, pp, status, fragment in [(hf, 1, "pass", "MTP layer"), (hf, 2, "fail", "PP + MTP"),
                                        (hf_llama, 1, "fail", "multi-token prediction layers")]:
        spec = llmapi_spec(tmp_path, model, target="llmapi-cpu", speculative={"mode": "mtp"},
                           parallelism={"pp": pp})
        got = {r.id: r for r in run_checks(build_context(spec, "plan", Workspace(tmp_path)))}["llmapi.speculative"]
        assert (got.status, "\n" in got.message) == (status, False) and fragment in got.message, got.message


# -- the plan ---------------------------------------------------------------------------------------------------

R1 = Path(__file__).resolve().parent.parent / "build" / "configs" / "deepseek-r1"


def test_the_mtp_layer_of_r1_is_11_6b_parameters():
    """One mixture-of-experts decoder layer of DeepSeek-R1 (MLA, 256 routed experts and the shared one, the float32
    router and correction bias) plus eh_proj [7168, 14336] and three norms: 11.61B parameters, counted at one byte
    each at tp 1 (the router and bias at four)."""
    from toolchain.archs import load_params
    from toolchain.plan.mtp import weight_bytes
    from toolchain.quant.view import Quantization

    _, p = load_params(json.loads((R1 / "config.json").read_text()))
    assert p.num_hidden_layers == 61 and p.is_moe_layer(61)
    h, router = 7168, 256 * 7168 + 256
    attention = 1536 * h + 128 * 192 * 1536 + 576 * h + 128 * 256 * 512 + h * 128 * 128
    experts = (256 + 1) * 3 * 2048 * h
    params = attention + experts + router + (2 * h + 1536 + 512) + 2 * h * h + 3 * h
    assert weight_bytes(p, 1, tp=1, quant=Quantization(), dt_bytes=1) - 3 * router == params == 11_610_068_224
    assert abs(params / 11.5e9 - 1) < 0.02


def test_plan_with_mtp_adds_the_layer_its_latent_and_a_draft_token(tmp_path):
    """R1 on 8 H200s (tp 8, moe_ep 8) in bf16: with speculative.mode mtp each rank holds the MTP layer's share (its
    heads, 32 experts, an eighth of the shared expert, the rest whole), one more latent of 576 values per token, and
    sequences one draft token longer."""
    from test_plan_memory import plan, spec_for

    from toolchain.archs import load_params
    from toolchain.plan.memory import sequence_tokens
    from toolchain.plan.mtp import weight_bytes
    from toolchain.quant.view import Quantization

    par = {"tp": 8, "moe_ep": 8}
    base = dict(target="llmapi", gpu={"name": "H200"}, model={"dtype": "bfloat16"}, parallelism=par)
    without = plan(spec_for(tmp_path, R1, **base))
    spec = spec_for(tmp_path, R1, **base, speculative={"mode": "mtp"})
    with_mtp = plan(spec)
    _, p = load_params(json.loads((R1 / "config.json").read_text()))
    h, heads = 7168, 128 // 8
    attention = 1536 * h + heads * 192 * 1536 + 576 * h + heads * 256 * 512 + h * heads * 128
    layer = 2 * (attention + 32 * 3 * 2048 * h + 3 * (2048 // 8) * h + 2 * h + 1536 + 512 + 2 * h * h + 3 * h) \
        + 4 * (256 * h + 256)
    assert weight_bytes(p, 1, tp=8, quant=Quantization(), dt_bytes=2, moe_ep=8) == layer
    for a, b in zip(without.ranks, with_mtp.ranks, strict=True):
        assert b.weights_bytes - a.weights_bytes == layer
        assert (a.kv_bytes_per_token, b.kv_bytes_per_token) == (61 * 576 * 2, 62 * 576 * 2)
    lim, tpb = spec.limits, spec.build.tokens_per_block
    assert spec.speculative.max_draft_len == 0  # MTPDecodingConfig's one draft token all the same
    assert (without.sequence_tokens, with_mtp.sequence_tokens) == (sequence_tokens(lim.max_seq_len, 0, tpb),
                                                                   sequence_tokens(lim.max_seq_len, 1, tpb))
    assert with_mtp.sequence_tokens > without.sequence_tokens


@pytest.mark.parametrize("par", [{"tp": 1}, {"tp": 2}, {"tp": 2, "moe_ep": 2}])
def test_plan_bytes_with_mtp_are_what_convert_writes(tmp_path_factory, tmp_path, par):
    from test_plan_memory import plan, spec_for

    from toolchain.checkpoint.convert import plan_any

    hf, _ = with_mtp(tmp_path_factory)
    spec = spec_for(tmp_path, hf, target="llmapi", gpu={"name": "H200"}, parallelism=par,
                    speculative={"mode": "mtp"})
    planned = plan(spec)
    tp = par["tp"]
    dry = plan_any(hf, tp=tp, pp=1, dtype="float16", target="trtllm", moe_ep=par.get("moe_ep"), mtp_layers=1)
    plain = plan_any(hf, tp=tp, pp=1, dtype="float16", target="trtllm", moe_ep=par.get("moe_ep"))
    assert all(dry.rank_bytes(r) > plain.rank_bytes(r) for r in range(tp))
    assert [r.checkpoint_bytes for r in planned.ranks] == [dry.rank_bytes(r) for r in range(tp)]
