"""The TensorRT-LLM 1.2 checkpoint: reading HF safetensors, sharding rules,
config.json, the per-rank writer and the `convert` stage."""
