"""NVIDIA Dynamo deployments of the LLM-API path (`toolchain dynamo`; docs/dynamo.md).

Several engine workers behind one OpenAI endpoint: Dynamo's frontend (HTTP, tokenizer, router) discovers the
workers and routes each request, by default to the worker whose cached KV blocks cover most of its prompt.

* `render.py`, `manifests.py`: target llmapi (GPU hosts). The frontend and `python3 -m dynamo.trtllm` workers
  taking the spec's LLM-API YAML (the trtllm-serve.yaml `toolchain model-repo` writes), aggregated or
  disaggregated prefill/decode, as command lines and as a DynamoGraphDeployment; every flag and field is
  looked up in the facts read from Dynamo 1.6.1 (toolchain/upstream/facts/dynamo.json).
* `worker.py`, `kv_events.py`, `launcher.py`: target llmapi-cpu (this host). The same frontend and router in
  front of CPU-engine workers registered through Dynamo's Python runtime, each publishing the KV-block events of
  its engine's prefix reuse, so the router's prefix-aware routing meets the engine's block reuse.
* `install.py`, `checks.py`: whether Dynamo is installed, and the spec combinations refused in one line.
"""

# The release every fact, flag and test here was read from (`make dynamo` installs it).
DYNAMO_VERSION = "1.6.1"
