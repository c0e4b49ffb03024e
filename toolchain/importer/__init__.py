"""`toolchain import`: an existing tensorrtllm_backend deployment (a Triton repository filled from upstream's
inflight_batcher_llm templates, its engine directory, the HF checkpoint) read into a spec for target trtllm,
with a round trip that renders the spec back and compares every parameter and build flag, and that spec moved
to the LLM-API path.

`repo.py` reads the repository (config.pbtxt through Triton's ModelConfig protobuf, fill_template.py's unset
rule, the layout), `engine.py` the engine's config.json, `to_spec.py` writes the spec, `roundtrip.py` compares,
`llmapi.py` moves it to the LLM-API path with the settings that have no counterpart there.
"""
