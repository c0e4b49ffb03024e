"""Engines: the CPU engine (cpu/) and the TensorRT-LLM build adapter (trtllm.py)."""
