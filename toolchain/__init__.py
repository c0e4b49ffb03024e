"""trtllm-toolchain: one declarative spec from a Hugging Face checkpoint to a
validated TensorRT-LLM deployment on Triton Inference Server."""

__version__ = "0.1.0"
