"""The CPU tensorrt_llm model's LoRA request rules (triton/cpu_lora.py), without a server: the C++ backend's
parameter defaults, getLoraConfigFromTensors (only with lora_task_id; batch dim squeezed; executor::LoraConfig's
checks) and PeftCacheManager's enqueue (put, then task id only; a cache miss, a full cache and a bad adapter each
answered in the executor's words), against a real CPU engine built with LoRA."""

from __future__ import annotations

import numpy as np
import pytest

from lora_helpers import make_peft_adapter
from test_engine_cpu_util import make_engine_dir
from toolchain.checkpoint.lora import CONFIG_FILE, WEIGHTS_FILE, convert_adapter
from toolchain.engine.cpu import CpuEngine
from toolchain.engine.cpu.lora import lora_build_config
from toolchain.triton import cpu_lora
from toolchain.triton.cpu_lora import LoraRequestError, RowLora, executor_error, load_options, prepare, row_lora

MODULES = ["attn_q", "attn_k", "attn_v", "attn_dense", "mlp_h_to_4h", "mlp_gate", "mlp_4h_to_h"]


class Reader:
    """The request reader the model hands in (backend_models/tensorrt_llm.py _Inputs): tensors by name, per-row
    scalars, the batch size."""

    def __init__(self, batch: int = 1, **tensors):
        self.batch, self.tensors = batch, tensors

    def get(self, name):
        return self.tensors.get(name)

    def scalar(self, name, row, default=None, cast=int):
        arr = self.tensors.get(name)
        return default if arr is None else cast(arr.reshape(self.batch, -1)[row, 0])


@pytest.fixture(scope="module")
def world(tmp_path_factory, hf_llama):
    root = tmp_path_factory.mktemp("triton-cpu-lora")
    adapter = make_peft_adapter(hf_llama, root / "adapter", ["q_proj", "down_proj"], seed=4, r=4)
    converted = convert_adapter(adapter, root / "converted" / "3", "float32")
    engine_dir = make_engine_dir(hf_llama, root / "engine", plugin_config={"lora_plugin": "float32"},
                                 lora_config=lora_build_config(MODULES, 8))
    return {"root": root, "engine_dir": engine_dir,
            "tensors": (np.load(converted / WEIGHTS_FILE), np.load(converted / CONFIG_FILE))}


def test_load_options_are_the_backends_defaults(tmp_path):
    said = []
    unset = load_options({"lora_cache_host_memory_bytes": None, "lora_prefetch_dir": "${lora_prefetch_dir}"})
    assert unset == {"lora_host_bytes": 1 << 30, "lora_prefetch_dir": None}
    missing = load_options({"lora_cache_host_memory_bytes": 4096, "lora_prefetch_dir": str(tmp_path / "no")},
                           warn=said.append)
    assert missing == {"lora_host_bytes": 4096, "lora_prefetch_dir": None} and "skipping prefetching" in said[0]
    assert load_options({"lora_prefetch_dir": str(tmp_path)})["lora_prefetch_dir"] == tmp_path


def test_tensors_are_read_only_with_a_task_id(world):
    weights, config = world["tensors"]
    # Without lora_task_id the weights and config are ignored: the base model runs.
    assert row_lora(Reader(lora_weights=weights, lora_config=config), 0) is None
    got = row_lora(Reader(lora_task_id=np.array([5], np.uint64), lora_weights=weights, lora_config=config), 0)
    assert got.task_id == 5 and got.weights.shape == weights.shape[1:] and got.config.shape == config.shape[1:]
    # Two rows: each its own task id and tensors.
    two = Reader(batch=2, lora_task_id=np.array([5, 6], np.uint64), lora_weights=np.concatenate([weights, weights]),
                 lora_config=np.concatenate([config, config]))
    assert row_lora(two, 1).task_id == 6 and row_lora(two, 1).weights.shape == weights.shape[1:]
    task = np.array([5], np.uint64)
    for tensors, words in (
            ({"lora_weights": weights}, "Request for LoRA inference with lora weights must also have lora config"),
            ({"lora_weights": weights, "lora_config": config[:, :-1]},
             "Expected dim 0 of lora weights and lora config to have the same size"),
            ({"lora_config": config.astype(np.int64)}, "Expected lora config tensor to have type kINT32")):
        with pytest.raises(ValueError, match=words):
            row_lora(Reader(lora_task_id=task, **tensors), 0)


def test_enqueue_puts_then_serves_by_id_and_answers_in_the_executors_words(world, tmp_path):
    weights, config = world["tensors"]
    engine = CpuEngine.load(world["engine_dir"], lora_host_bytes=1 << 20)
    with pytest.raises(LoraRequestError) as err:
        prepare(engine, 12, RowLora(3))
    assert str(err.value) == executor_error(12, "LoRA task 3 not found in cache. Please send LoRA weights with request")
    assert str(err.value).startswith("Executor failed process requestId 12 due to the following error: LoRA task 3")
    prepare(engine, 13, RowLora(3, weights[0], config[0]))
    assert engine.lora.has(3)
    prepare(engine, 14, RowLora(3))  # by id alone now
    # A bad adapter: the executor's prefix for an unexpected error, then the check's words, one line.
    with pytest.raises(LoraRequestError) as err:
        prepare(engine, 15, RowLora(4, weights[0][:, :10], config[0]))
    message = str(err.value)
    assert message.startswith(executor_error(15, "Encountered an error when fetching new request: "))
    assert "lora_weights has to few values for" in message and "\n" not in message
    with pytest.raises(LoraRequestError, match="must have both lora_weights and lora_keys"):
        prepare(engine, 16, RowLora(4, None, config[0]))


def test_a_full_cache_and_an_engine_without_lora(world, tmp_path, hf_llama):
    weights, config = world["tensors"]
    tiny = CpuEngine.load(world["engine_dir"], lora_host_bytes=64)
    with pytest.raises(LoraRequestError) as err:
        prepare(tiny, 2, RowLora(3, weights[0], config[0]))
    assert str(err.value) == executor_error(2, "PEFT Cache is full. Could not store taskId=3")
    plain = CpuEngine.load(make_engine_dir(hf_llama, tmp_path / "plain"))
    with pytest.raises(LoraRequestError, match="this engine was built without LoRA") as err:
        prepare(plain, 1, RowLora(3))
    assert "\n" not in str(err.value) and cpu_lora.executor_error(1, "") not in str(err.value)
