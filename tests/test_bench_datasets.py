"""Workload plans: synthetic, shared prefix, prompt files, multi-turn, classes, cancellation (no server)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from toolchain.bench.datasets import Plan
from toolchain.bench.mock import make_word_tokenizer
from toolchain.bench.workload import count_tokens, load_tokenizer
from toolchain.errors import ToolchainError
from toolchain.spec import spec_from_dict


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_word_tokenizer(tmp_path_factory.mktemp("tok")))


def workload(**kw):
    return spec_from_dict({"validation": {"workload": kw}}, Path(".")).validation.workload


def plan(tok, token_ids=False, chat=False, **kw):
    return Plan(workload(**kw), tok, max_input=400, max_seq=600, token_ids=token_ids, chat=chat)


def texts(p, level, n):
    return [t.text for s in p.sessions(level, n) for t in s.turns]


def test_seeded_and_distinct_per_level(tok):
    p = plan(tok, input_tokens=20, output_tokens=8, output_tokens_stddev=3, seed=5)
    assert texts(p, 0, 6) == texts(plan(tok, input_tokens=20, output_tokens=8, output_tokens_stddev=3, seed=5), 0, 6)
    assert set(texts(p, 0, 6)).isdisjoint(texts(p, 1, 6))  # no prompt reused across sweep levels
    sessions = list(p.sessions(0, 40))
    assert all(count_tokens(tok, p.prompt(s, 0, []).text) == 20 for s in sessions[:5])
    osl = [s.turns[0].max_tokens for s in sessions]
    assert len(set(osl)) > 3 and min(osl) >= 1


def test_shared_prefix_is_n_prompts_by_m_users(tok):
    p = plan(tok, input_tokens=10, shared_prefix={"num_prefixes": 3, "prefix_tokens": 30, "users_per_prefix": 2})
    prompts = [p.prompt(s, 0, []) for s in p.sessions(0, 60)]
    assert len({pr.text for pr in prompts}) == 6
    assert len({pr.text.split("\n")[0] for pr in prompts}) == 3
    assert all(pr.isl == count_tokens(tok, pr.text) for pr in prompts)
    chat = plan(tok, chat=True, input_tokens=10, shared_prefix={"num_prefixes": 2, "prefix_tokens": 30})
    msgs = chat.prompt(next(chat.sessions(0, 1)), 0, []).messages
    assert [m["role"] for m in msgs] == ["system", "user"]


def test_classes_get_their_share_priority_and_lengths(tok):
    p = plan(tok, input_tokens=16, output_tokens=8, classes=[
        {"name": "interactive", "share": 3, "priority": 1, "output_tokens": 4},
        {"name": "batch", "share": 1, "input_tokens": 40}])
    sessions = list(p.sessions(0, 400))
    counts = Counter(s.cls for s in sessions)
    assert counts["interactive"] / 400 == pytest.approx(0.75, abs=0.07)
    inter = next(s for s in sessions if s.cls == "interactive")
    batch = next(s for s in sessions if s.cls == "batch")
    assert inter.priority == 1 and inter.turns[0].max_tokens == 4 and batch.priority == 0
    assert p.prompt(batch, 0, []).isl == 40


def test_cancel_fraction_marks_requests_mid_stream(tok):
    p = plan(tok, output_tokens=10, cancel_fraction=0.3, seed=2)
    turns = [s.turns[0] for s in p.sessions(0, 300)]
    marked = [t.cancel_after for t in turns if t.cancel_after is not None]
    assert len(marked) / 300 == pytest.approx(0.3, abs=0.07)
    assert all(1 <= k <= 9 for k in marked)


def test_multi_turn_carries_history_and_drops_the_oldest_to_fit(tok):
    p = plan(tok, input_tokens=30, multi_turn={"turns": 3})
    s = next(p.sessions(0, 1))
    first = p.prompt(s, 0, [])
    second = p.prompt(s, 1, [(s.turns[0], " alpha bravo", [])])
    assert second.text.startswith(first.text) and " alpha bravo" in second.text and second.isl > first.isl
    assert p.sessions_for(10) == 4
    small = Plan(workload(input_tokens=30, multi_turn={"turns": 3}), tok, max_input=70, max_seq=200)
    s = next(small.sessions(0, 1))
    hist = [(s.turns[0], " alpha" * 20, []), (s.turns[1], " bravo" * 20, [])]
    pr = small.prompt(s, 2, hist)
    assert pr.isl <= 70 and "alpha" not in pr.text  # the oldest turn went first
    ids = Plan(workload(input_tokens=12, multi_turn={"turns": 2}), tok, max_input=200, max_seq=300, token_ids=True)
    s = next(ids.sessions(0, 1))
    assert ids.prompt(s, 1, [(s.turns[0], "", [7, 8])]).ids == s.turns[0].ids + [7, 8] + s.turns[1].ids


def test_prompt_file_entries(tok, tmp_path):
    path = tmp_path / "p.jsonl"
    lines = [{"prompt": "alpha bravo", "output_tokens": 5, "class": "gold", "priority": 2},
             {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "charlie"}]},
             {"input_ids": [5, 6, 7]}, {"turns": ["delta", "echo"]}]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    p = plan(tok, prompts_file=str(path), output_tokens=9)
    s = list(p.sessions("x", 4))
    assert (s[0].turns[0].text, s[0].turns[0].max_tokens, s[0].cls, s[0].priority) == ("alpha bravo", 5, "gold", 2)
    assert s[1].turns[0].max_tokens == 9 and s[1].turns[0].text == "be brief\ncharlie"
    assert s[2].turns[0].ids == [5, 6, 7] and len(s[3].turns) == 2
    chat = plan(tok, chat=True, prompts_file=str(path))
    assert [m["role"] for m in chat.prompt(list(chat.sessions("x", 2))[1], 0, []).messages] == ["system", "user"]


@pytest.mark.parametrize("line, fragment", [
    ('{"prompt": "ok"}\n{"prompt": "ok"\n', "p.jsonl:2: not valid JSON"),
    ('{"prompt": "ok"}\n\n{"text": 3}\n', "p.jsonl:3: needs a non-empty 'prompt'"),
    ('[1, 2]\n', "p.jsonl:1: expected a JSON object"),
    ('{"prompt": "a", "output_tokens": 0}\n', "p.jsonl:1: 'output_tokens' must be a positive integer"),
    ('\n', "holds no prompts"),
])
def test_bad_prompt_file_names_the_line(tok, tmp_path, line, fragment):
    path = tmp_path / "p.jsonl"
    path.write_text(line)
    with pytest.raises(ToolchainError, match=fragment) as err:
        plan(tok, prompts_file=str(path))
    assert "\n" not in str(err.value)


def test_spec_workload_validation():
    with pytest.raises(ToolchainError, match="whole numbers"):
        workload(mode="concurrency", sweep=[1, 2.5])
    with pytest.raises(ToolchainError, match="distinct"):
        workload(classes=[{"name": "a"}, {"name": "a"}])
    w = workload(mode="rate", sweep=[0.5, 2.5])
    # request_timeout_s None: derived from the workload and the SLOs (toolchain/bench/failfast.py)
    assert w.sweep == [0.5, 2.5] and w.request_timeout_s is None and w.protocol == "triton-grpc"
