"""The LLM-API path: TensorRT-LLM's PyTorch backend, with no engine build.

Everything specific to that runtime lives here, beside `engine/trtllm.py` for the
1.2 engines: the spec -> `LLM()` arguments (`args.py`, checked against the pinned
release's own argument names in `upstream/facts/llmapi.json`), the convert stage
of this path (`stage.py`: the Hugging Face checkpoint as it is, or a Hugging
Face-format quantized one), Triton's `llmapi` repository (`repo.py`), and the
CPU stand-in for `tensorrt_llm.LLM` (`cpu_llm.py`) that serves both that
repository and the OpenAI-compatible server on this host.
"""
