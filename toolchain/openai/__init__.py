"""An OpenAI-compatible HTTP server (trtllm-serve's endpoints) over the CPU engine.

- `create_app(engine, tokenizer_dir, served_model_name, ...)`: the FastAPI app;
- `OpenAIServer`: runs `python -m toolchain.openai` as a subprocess on a free port;
- `python -m toolchain.openai --engine-dir DIR --tokenizer DIR --served-model-name NAME`.

Importing this package does not import FastAPI; `create_app` does.
"""

from __future__ import annotations

from toolchain.openai.server import OpenAIServer


def create_app(*args, **kwargs):
    from toolchain.openai.app import create_app as _create_app

    return _create_app(*args, **kwargs)


__all__ = ["OpenAIServer", "create_app"]
