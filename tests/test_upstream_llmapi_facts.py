"""The LLM-API fact file (toolchain/upstream/facts/llmapi.json): the values a
Triton llmapi deployment is built from are there with the expected shape, and its
entries stay consistent with one another (each file's commit, each line)."""

from __future__ import annotations

from toolchain import upstream

UP = upstream.facts("llmapi")
FILES = upstream.load("llmapi")["sources"]["trtllm"]["files"]


def test_speculative_config_dispatches_on_decoding_type():
    types = UP["speculative"]["types"]
    assert {"MTP", "Medusa", "Eagle", "Lookahead", "NGram", "DraftTarget", "UserProvided", "AUTO"} <= set(types)
    for key, entry in types.items():
        # The from_dict key is what a config names; the class's own ClassVar may be spelled
        # differently (DraftTarget -> "Draft_Target", UserProvided -> "User_Provided").
        assert entry["fields"] is not None, entry
        assert entry["decoding_type"].replace("_", "") == key, entry
    assert types["DraftTarget"]["class"] == "DraftTargetDecodingConfig"
    assert types["NGram"]["fields"]["max_matching_ngram_size"]["default"] == 0
    assert types["MTP"]["fields"]["num_nextn_predict_layers"] == {
        **types["MTP"]["fields"]["num_nextn_predict_layers"], "type": "int", "default": 1}
    assert {"max_draft_len", "speculative_model_dir"} <= set(UP["speculative"]["base_fields"])


def test_speculative_backends():
    types = UP["speculative"]["types"]
    for key in ("DraftTarget", "NGram", "MTP", "AUTO"):
        assert types[key]["supports_backend"]["allows"] == ["pytorch"], key
    for key in ("Medusa", "Lookahead"):
        assert "pytorch" in types[key]["supports_backend"]["excludes"], key
    # Eagle inherits the base's `return True`.
    assert types["Eagle"]["supports_backend"] == {**types["Eagle"]["supports_backend"], "allows": "all",
                                                  "declared_in": "DecodingBaseConfig"}


def test_llm_args_fields_and_strictness():
    args = UP["llm_args"]
    assert args["class"] == "TorchLlmArgs" and args["bases"][0] == "BaseLlmArgs"
    assert args["extra_forbidden"] and args["extra_policy"]["extra"] == "forbid"
    fields = args["fields"]
    for name in ("tensor_parallel_size", "max_num_tokens", "kv_cache_config", "scheduler_config",
                 "speculative_config", "enable_chunked_prefill", "cuda_graph_config", "max_batch_size"):
        assert name in fields, name
    assert fields["model"]["required"] is True
    assert fields["tensor_parallel_size"]["default"] == 1
    assert fields["max_num_tokens"]["default"] == 8192
    assert fields["kv_cache_config"]["default_factory"] == "KvCacheConfig"
    assert fields["cuda_graph_config"]["declared_in"] == "TorchLlmArgs"
    assert fields["load_format"]["overrides"] == "BaseLlmArgs"
    assert fields["scheduler_config"]["status"] == "prototype"
    assert fields["mpi_session"]["alias"] == "_mpi_session"
    assert args["extra_dict_conversions"]["speculative_config"]["via"] == "from_dict"
    assert "kv_cache_config" not in args["extra_dict_conversions"]


def test_nested_configs():
    kv = UP["kv_cache_config"]
    assert kv["extra_forbidden"]
    assert kv["fields"]["free_gpu_memory_fraction"]["default"] == 0.9
    assert kv["fields"]["enable_block_reuse"]["default"] is True
    sched = UP["scheduler_config"]
    assert sched["fields"]["capacity_scheduler_policy"]["default"] == "GUARANTEED_NO_EVICT"
    assert set(sched["policies"]["CapacitySchedulerPolicy"]["members"]) == {
        "MAX_UTILIZATION", "GUARANTEED_NO_EVICT", "STATIC_BATCH"}
    assert sched["dynamic_batch_config"]["fields"]["enable_batch_size_tuning"]["required"] is True
    assert UP["cuda_graph_config"]["fields"]["max_batch_size"]["default"] == 0


def test_triton_model_code():
    code = UP["triton_model_code"]
    rules = code["rules"]
    assert rules["config_path_env"]["value"] == {"env": "LLM_CONFIG_PATH", "default": "model.yaml"}
    assert rules["triton_config_cancellation_check_period_ms"]["value"]["default"] == 100
    assert rules["triton_config_decoupled_required"]["value"]["required"] is True
    assert "update_llm_args_with_extra_dict" in rules["other_keys_to_llm_args"]["quote"]
    assert rules["text_output_is_output_text"]["value"]["from"] == "output.text"
    params = code["sampling_params"]
    assert params["sampling_param_exclude_input_from_output"] == {
        **params["sampling_param_exclude_input_from_output"], "field": "exclude_input_from_output", "default": False}
    assert params["sampling_param_max_tokens"]["field"] == "max_tokens" and "default" not in params[
        "sampling_param_max_tokens"]
    assert code["outputs"]["finish_reason"]["when"] == "return_finish_reason"
    assert "text_output" in code["outputs"]
    assert len({(r["path"], r["line"]) for r in rules.values()}) == len(rules)


def test_triton_model_takes_text_and_leaves_batching_to_model_yaml():
    model = UP["triton_model"]
    assert model["backend"] == "python"
    assert model["inputs"]["text_input"] == {**model["inputs"]["text_input"], "data_type": "TYPE_STRING",
                                             "optional": False}
    assert all(t["optional"] for name, t in model["inputs"].items() if name != "text_input")
    assert "text_output" in model["outputs"]
    assert not model["max_batch_size_set"] and not model["decoupled_set"]
    assert UP["model_yaml"]["triton_config"]["max_batch_size"]["default"] == 0
    assert "triton_config" not in UP["model_yaml"]["llm_kwargs"]


def test_launch_flags_have_their_defaults():
    flags = UP["launch_flags"]
    assert flags["--world_size"]["default"] == 1
    assert flags["--no-mpi"]["default"] is False and flags["--trtllm_llmapi_launch"]["action"] == "store_true"
    assert flags["--force"]["aliases"] == ["-f"]


def test_every_entry_names_the_commit_its_file_was_read_at():
    def walk(node):
        if isinstance(node, dict):
            if "path" in node and "line" in node:
                yield node
            for value in node.values():
                yield from walk(value)

    entries = list(walk(UP))
    assert entries
    for entry in entries:
        assert entry["commit"] == FILES[entry["path"]], entry
        assert isinstance(entry["line"], int) and entry["line"] > 0, entry


def test_rules_quote_distinct_lines():
    rules = UP["rules"].values()
    assert all(r["quote"] for r in rules)
    assert len({(r["path"], r["line"]) for r in rules}) == len(UP["rules"])
