"""The C++ tensorrtllm backend's parameter rules as the CPU stand-in applies them:
the std:: conversions, required keys, fallbacks and the load checks."""

from __future__ import annotations

import pytest

from toolchain.triton import backend_params as bp
from toolchain.upstream import facts


def config(**params) -> dict:
    return {"parameters": {k: ({"string_value": v} if v != "" else {}) for k, v in params.items()}}


def minimal(**extra) -> dict:
    """The keys the backend reads without a fallback, filled in."""
    params = {"gpt_model_type": "inflight_fused_batching", "gpt_model_path": "/engine", "tokenizer_dir": "",
              "guided_decoding_backend": "", "xgrammar_tokenizer_info_path": ""}
    params.update(extra)
    return config(**params)


@pytest.mark.parametrize("text,want", [("12", 12), ("  7", 7), ("12abc", 12), ("-3", -3), ("+4", 4), ("0.9", 0)])
def test_stoi_parses_the_longest_prefix(text, want):
    assert bp.stoi(text) == want


@pytest.mark.parametrize("text", ["", "${max_beam_width}", "abc", " ", "99999999999"])
def test_stoi_refuses_what_std_stoi_throws_on(text):
    with pytest.raises(ValueError):
        bp.stoi(text)


def test_stoul_wraps_a_minus_like_strtoul():
    assert bp.PARSERS["stoul"]("-1") == (1 << 32) - 1 and bp.PARSERS["stoull"]("5") == 5


@pytest.mark.parametrize("text,want", [("0.5", 0.5), ("1e-3", 0.001), (" .25x", 0.25), ("1", 1.0)])
def test_stof(text, want):
    assert bp.stof(text) == want


def test_bool_accepts_exactly_the_backend_spellings():
    assert [bp.to_bool(t) for t in ("True", "true", "TRUE", "1", "False", "false", "FALSE", "0")] == [True] * 4 + [False] * 4
    for text in ("yes", "on", "t", "tRue", " true", ""):
        with pytest.raises(ValueError, match="Cannot convert"):
            bp.to_bool(text)


def test_int_lists_follow_csv_str_to_vec_int():
    assert bp.int_list("1, 2,3") == [1, 2, 3]
    assert bp.int_list("4096,") == [4096]
    with pytest.raises(ValueError):
        bp.int_list("")
    assert bp.int_list_list("{0}, {0, 1},{1}") == [[0], [0, 1], [1]]
    assert bp.int_list_list("{0},{0,1") == [[0]]  # a group with no closing brace is dropped, as in C++
    with pytest.raises(ValueError):
        bp.int_list_list("0,1")


def test_the_facts_mark_the_guided_decoding_keys_and_model_type_required():
    required = {p["name"] for p in facts("backend_parameters")["parameters"] if p["required"] and not p["when"]}
    assert {"gpt_model_type", "tokenizer_dir", "guided_decoding_backend", "xgrammar_tokenizer_info_path"} <= required
    assert "kv_cache_free_gpu_mem_fraction" not in required


@pytest.mark.parametrize("key", ["gpt_model_type", "tokenizer_dir", "guided_decoding_backend",
                                 "xgrammar_tokenizer_info_path"])
def test_a_missing_required_key_fails_with_the_backend_message(key):
    cfg = minimal()
    del cfg["parameters"][key]
    with pytest.raises(bp.ParameterError, match=f"Cannot find parameter with name: {key}"):
        bp.read(cfg)


def test_no_parameters_section_fails():
    with pytest.raises(bp.ParameterError, match="parameters section"):
        bp.read({})


def test_fallbacks_take_the_backend_default_and_warn():
    warnings = []
    values = bp.read(minimal(exclude_input_in_output="yes", max_beam_width="${max_beam_width}",
                             batch_scheduler_policy="fifo", cancellation_check_period_ms="250"),
                     warn=warnings.append)
    assert values["exclude_input_in_output"] is False and values["max_beam_width"] == 1
    assert values["batch_scheduler_policy"] is None and values["cancellation_check_period_ms"] == 250
    assert values["enable_kv_cache_reuse"] is True  # the C++ default, absent key
    assert any("exclude_input_in_output" in w for w in warnings)


def test_an_invalid_model_type_fails():
    with pytest.raises(bp.ParameterError, match="gpt_model_type"):
        bp.read(minimal(gpt_model_type="${batching_strategy}"))


def test_lookahead_needs_its_three_parameters():
    with pytest.raises(bp.ParameterError, match="lookahead_window_size"):
        bp.read(minimal(decoding_mode="lookahead"))
    values = bp.read(minimal(decoding_mode="lookahead", lookahead_window_size="4", lookahead_ngram_size="3",
                             lookahead_verification_set_size="4"))
    assert values["lookahead_ngram_size"] == 3
    assert "lookahead_window_size" not in bp.read(minimal())


def test_load_checks_the_engine_path_and_guided_decoding(tmp_path):
    with pytest.raises(bp.ParameterError, match="Both encoder and decoder model paths are empty"):
        bp.check_load(bp.read(minimal(gpt_model_path=str(tmp_path / "missing"))))
    assert bp.check_load(bp.read(minimal(gpt_model_path=str(tmp_path)))) == str(tmp_path)
    guided = minimal(gpt_model_path=str(tmp_path), guided_decoding_backend="outlines",
                     xgrammar_tokenizer_info_path=str(tmp_path))
    with pytest.raises(bp.ParameterError, match="xgrammar"):
        bp.check_load(bp.read(guided))
    # the template's own placeholders mean "unset"
    assert bp.check_load(bp.read(minimal(gpt_model_path=str(tmp_path),
                                         guided_decoding_backend="${guided_decoding_backend}")))
