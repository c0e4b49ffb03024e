"""Several answers per request on the CPU engine (engine/cpu/beams.py): beam search against transformers'
`generate(num_beams=W)`, n sampled child requests with their seeds, the refusals, and the KV blocks a
beam search shares and gives back."""

from __future__ import annotations

import pytest
import torch
from test_engine_cpu_util import PROMPTS, load_engine  # noqa: F401

from toolchain.engine.cpu import InflightBatcher, SamplingParams, SchedulerConfig
from toolchain.engine.cpu.beam_search import BeamSequence, generate_sequences, start_sequence
from toolchain.engine.cpu.beams import children
from toolchain.errors import ToolchainError


@pytest.fixture(scope="module")
def engine(tmp_path_factory, hf_llama):
    return load_engine(tmp_path_factory, hf_llama, 1, 1, max_beam_width=4)


@pytest.fixture(scope="module")
def hf_model(hf_llama):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_llama, dtype=torch.float32).eval()


def hf_beams(model, prompt, width, new, end_id, length_penalty, early_stopping, n):
    """transformers' beam search: (generated tokens up to the end token, score) per returned sequence."""
    out = model.generate(torch.tensor([prompt]), num_beams=width, do_sample=False, max_new_tokens=new,
                         min_new_tokens=0, length_penalty=length_penalty, early_stopping=early_stopping,
                         num_return_sequences=n, eos_token_id=end_id, pad_token_id=end_id,
                         return_dict_in_generate=True, output_scores=True)
    result = []
    for row, score in zip(out.sequences.tolist(), out.sequences_scores.tolist(), strict=True):
        gen = row[len(prompt):]
        result.append((gen[:gen.index(end_id)] if end_id in gen else gen, score))
    return result


def likely_end(engine, prompt):
    """A token greedy decoding emits early, so that beams do end on it."""
    return engine.generate(prompt, SamplingParams(max_new_tokens=4))[2]


@pytest.mark.parametrize("width,new,length_penalty,early_stopping,prompt", [
    (2, 6, 1.0, 1, PROMPTS[0]),
    (2, 10, 1.0, 0, PROMPTS[1]),
    (3, 12, 0.5, 1, PROMPTS[2]),
    (4, 12, 2.0, 0, PROMPTS[1]),
])
def test_beam_search_matches_transformers(engine, hf_model, width, new, length_penalty, early_stopping, prompt):
    end_id = likely_end(engine, prompt)
    params = SamplingParams(max_new_tokens=new, end_id=end_id, beam_width=width, num_return_sequences=width,
                            length_penalty=length_penalty, early_stopping=early_stopping)
    ours = generate_sequences(engine, prompt, params)
    theirs = hf_beams(hf_model, prompt, width, new, end_id, length_penalty, bool(early_stopping), width)
    assert [r.tokens for r in ours] == [t for t, _ in theirs]
    assert [r.score for r in ours] == pytest.approx([s for _, s in theirs], abs=1e-4)
    # The end token is taken, not only the length (a length penalty of 2 favours the long beams).
    assert any(r.reason == "end_id" for r in ours) or length_penalty > 1
    for r in ours:  # cum_log_probs: the chosen tokens' log-probs (the end token's included), unpenalized
        length = len(r.tokens) + (r.reason == "end_id")
        assert r.cum_log_prob == pytest.approx(r.score * length ** length_penalty, abs=1e-4)
        assert len(r.log_probs) == len(r.tokens)
        if r.reason == "length":
            assert sum(r.log_probs) == pytest.approx(r.cum_log_prob, abs=1e-4)
        else:  # the end token's log-prob is in the sum, not in the tokens'
            assert sum(r.log_probs) > r.cum_log_prob


def test_num_return_sequences_takes_the_best_beams(engine, hf_model):
    prompt, end_id = PROMPTS[0], likely_end(engine, PROMPTS[0])
    params = SamplingParams(max_new_tokens=8, end_id=end_id, beam_width=3, num_return_sequences=2)
    ours = generate_sequences(engine, prompt, params)
    assert [r.tokens for r in ours] == [t for t, _ in hf_beams(hf_model, prompt, 3, 8, end_id, 1.0, True, 2)]
    with pytest.raises(ToolchainError, match="beam_search"):  # one sequence per request: not for a beam search
        engine.generate(prompt, params)


def test_greedy_path_is_unchanged_and_width_one_is_greedy(engine):
    prompt = PROMPTS[1]
    greedy = engine.generate(prompt, SamplingParams(max_new_tokens=12))
    assert [r.tokens for r in generate_sequences(engine, prompt, SamplingParams(max_new_tokens=12))] == [greedy]


def test_beam_search_gives_every_block_back(engine):
    kv = engine.kv
    free = kv.free_blocks
    params = SamplingParams(max_new_tokens=40, beam_width=4, num_return_sequences=4)
    results = generate_sequences(engine, PROMPTS[3], params)
    assert len(results) == 4 and len({tuple(r.tokens) for r in results}) == 4
    assert kv.free_blocks == free and kv.used_blocks == 0


def test_beam_search_in_the_batcher_beside_sampled_requests(engine):
    prompt = PROMPTS[0]
    params = SamplingParams(max_new_tokens=10, beam_width=2, num_return_sequences=2)
    expected = generate_sequences(engine, prompt, params)
    plain = SamplingParams(max_new_tokens=10, top_k=20, seed=3)
    alone = engine.generate(PROMPTS[1], plain)
    results: list = []
    done: dict = {}

    def callback(rid):
        def on(tokens, finished, error):
            done.setdefault(rid, []).extend(tokens)
            if finished:
                done[(rid, "end")] = error
        return on

    with InflightBatcher(engine) as batcher:
        batcher.submit("beam", prompt, params, callback("beam"), beam_results=results)
        batcher.submit("plain", PROMPTS[1], plain, callback("plain"))
        import time

        deadline = time.time() + 60
        while (("beam", "end") not in done or ("plain", "end") not in done) and time.time() < deadline:
            time.sleep(0.01)
    assert done[("beam", "end")] is None and done[("plain", "end")] is None
    assert [r.tokens for r in results] == [r.tokens for r in expected]
    assert done["beam"] == expected[0].tokens and done["plain"] == alone
    assert engine.kv.used_blocks == 0


def test_max_utilization_refuses_beam_search(engine):
    errors = []
    with InflightBatcher(engine, SchedulerConfig(policy="max_utilization")) as batcher:
        batcher.submit("b", PROMPTS[0], SamplingParams(4, beam_width=2), lambda t, f, e: errors.append(e))
        import time

        deadline = time.time() + 30
        while not errors and time.time() < deadline:
            time.sleep(0.01)
    assert errors and "guaranteed_no_evict" in errors[0]


def test_children_are_seeded_from_the_request_seed(engine):
    params = SamplingParams(max_new_tokens=12, top_k=50, temperature=1.5, seed=7, num_return_sequences=3)
    kids = children(params)
    assert [k.seed for k in kids] == [7, 8, 9] and all(k.num_return_sequences == 1 for k in kids)
    assert [k.seed for k in children(SamplingParams(4, top_k=5, num_return_sequences=2))] == [0, 1]
    assert children(SamplingParams(4, seed=2**64 - 1, top_k=5, num_return_sequences=2))[1].seed == 0
    first = [r.tokens for r in generate_sequences(engine, PROMPTS[1], params)]
    assert len(set(map(tuple, first))) == 3  # n distinct sequences
    assert first == [r.tokens for r in generate_sequences(engine, PROMPTS[1], params)]  # reproducible
    assert first[0] == engine.generate(PROMPTS[1], SamplingParams(max_new_tokens=12, top_k=50, temperature=1.5,
                                                                   seed=7))  # child 0 is the request itself


@pytest.mark.parametrize("params,words", [
    (SamplingParams(4, beam_width=8), "beam_width 8 exceeds the engine's max_beam_width 4"),
    (SamplingParams(4, beam_width=2, num_return_sequences=3), "num_return_sequences 3 exceeds beam_width 2"),
    (SamplingParams(4, top_k=5, num_return_sequences=2), "submit them as child requests"),
    (SamplingParams(4, beam_width=2, stop_words=[[5]]), "stop words with beam search"),
    (SamplingParams(4, beam_width=0), "beam_width must be a positive integer"),
    (SamplingParams(4, beam_width=2, early_stopping=2), "early_stopping must be 0 or 1"),
])
def test_refusals(engine, params, words):
    with pytest.raises(ToolchainError, match=words):
        start_sequence(engine, PROMPTS[0], params)


def test_beam_search_refused_beside_draft_tokens_and_by_a_one_beam_engine(tmp_path_factory, hf_llama, engine):
    with pytest.raises(ToolchainError, match="max_beam_width 1"):
        start_sequence(load_engine(tmp_path_factory, hf_llama, 1, 1), PROMPTS[0], SamplingParams(4, beam_width=2))
    spec = load_engine(tmp_path_factory, hf_llama, 1, 1, max_beam_width=2, max_draft_len=4)
    with pytest.raises(ToolchainError, match="speculative decoding"):
        start_sequence(spec, PROMPTS[0], SamplingParams(4, beam_width=2))
    assert isinstance(start_sequence(engine, PROMPTS[0], SamplingParams(4, beam_width=2)), BeamSequence)


def test_fork_shares_full_blocks_and_copies_the_partial_one(engine):
    from toolchain.engine.cpu.kv_cache import BlockTable

    kv = engine.kv
    tpb = kv.tokens_per_block
    table = BlockTable()
    tokens = list(range(3, 3 + tpb + 3))
    kv.add_sequence(table, tokens, reuse=False)
    kv.k[:, :, table.blocks[1] * tpb:table.blocks[1] * tpb + 3] = 7.0
    table.length = len(tokens)
    child = kv.fork(table)
    assert child.blocks[0] == table.blocks[0] and child.blocks[1] != table.blocks[1]
    assert bool((kv.k[:, :, child.blocks[1] * tpb:child.blocks[1] * tpb + 3] == 7.0).all())
    kv.release(child)
    kv.release(table)
    assert kv.used_blocks == 0


def test_a_cancelled_or_stopped_beam_search_gives_every_block_back(engine):
    import time

    ended = []
    batcher = InflightBatcher(engine).start()
    batcher.submit("long", PROMPTS[3], SamplingParams(120, beam_width=4, num_return_sequences=4),
                   lambda t, f, e: ended.append(f) if f else None)
    deadline = time.time() + 30
    while engine.kv.used_blocks <= 1 and time.time() < deadline:  # the beams have branched
        time.sleep(0.005)
    batcher.cancel("long")
    while not ended and time.time() < deadline:
        time.sleep(0.01)
    assert ended == [True] and engine.kv.used_blocks == 0
    batcher.submit("stopped", PROMPTS[3], SamplingParams(120, beam_width=4, num_return_sequences=4),
                   lambda t, f, e: None)
    while engine.kv.used_blocks <= 1 and time.time() < deadline:
        time.sleep(0.005)
    batcher.stop()
    assert engine.kv.used_blocks == 0


def test_generation_logits_are_refused_with_beams(engine):
    import time

    errors = []
    with InflightBatcher(engine) as batcher:
        batcher.submit("g", PROMPTS[0], SamplingParams(4, beam_width=2), lambda t, f, e: errors.append(e),
                       generation_logits=[])
        deadline = time.time() + 30
        while not errors and time.time() < deadline:
            time.sleep(0.01)
    assert errors and "return_generation_logits with beam search" in errors[0]


def test_a_pool_without_room_for_every_beam_is_refused(tmp_path_factory, hf_llama):
    # TensorRT-LLM's check that max_tokens_in_paged_kv_cache holds one max_seq_len sequence of every beam.
    from test_engine_cpu_util import BUILD, engine_dir

    from toolchain.engine.cpu import CpuEngine, KvCacheConfig

    path = engine_dir(tmp_path_factory, hf_llama, 1, 1, max_beam_width=4)
    with pytest.raises(ToolchainError, match=r"less than one max_seq_len \(160\) sequence of 4 beams"):
        CpuEngine.load(path, kv_cache=KvCacheConfig(max_tokens=3 * BUILD["max_seq_len"]))
    assert CpuEngine.load(path, kv_cache=KvCacheConfig(max_tokens=4 * BUILD["max_seq_len"])).limits.max_beam_width == 4


def test_beam_search_is_the_same_across_tensor_parallel_ranks(tmp_path_factory, hf_llama, engine):
    params = SamplingParams(max_new_tokens=12, beam_width=3, num_return_sequences=3, early_stopping=0)
    tp2 = load_engine(tmp_path_factory, hf_llama, 2, 1, max_beam_width=4)
    ours = generate_sequences(engine, PROMPTS[1], params)
    theirs = generate_sequences(tp2, PROMPTS[1], params)
    assert [r.tokens for r in theirs] == [r.tokens for r in ours]
    assert [r.score for r in theirs] == pytest.approx([r.score for r in ours], abs=1e-4)
