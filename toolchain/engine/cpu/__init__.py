"""The CPU engine: runs a converted TensorRT-LLM checkpoint rank by rank on CPU.

`CpuEngine.load(engine_dir)` reads the engine directory (config.json +
rank{N}.safetensors), `generate` runs one request synchronously, and
`InflightBatcher` serves many with inflight batching and streaming callbacks.
"""

from toolchain.engine.cpu.batcher import InflightBatcher, QueueFull, RequestStats, SchedulerConfig
from toolchain.engine.cpu.engine import CpuEngine
from toolchain.engine.cpu.guided import Guide, GuidedDecoder, GuideError
from toolchain.engine.cpu.kv_cache import KvCacheConfig
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.engine.cpu.sampling import SamplingParams

__all__ = ["CpuEngine", "Guide", "GuideError", "GuidedDecoder", "InflightBatcher", "KvCacheConfig", "QueueFull",
           "RequestStats", "SamplingParams", "SchedulerConfig", "TokenLogprobs"]
