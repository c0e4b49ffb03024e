"""Which Triton tensor contract a served model speaks, from its metadata and config.

- text: the ensemble / tensorrt_llm_bls contract (`text_input`, `max_tokens`
  -> `text_output`); with `return_num_output_tokens` declared the server also
  returns a cumulative `num_output_tokens` per response: exact token counts.
- token ids: the `tensorrt_llm` contract (`input_ids`, `input_lengths`,
  `request_output_len` -> `output_ids`): exact counts, and the bench sends token
  ids it made with the deployment tokenizer.
- llmapi: Triton's LLM-API model (`text_input`, `sampling_param_max_tokens`,
  `streaming` -> `text_output`), where every streamed `text_output` is the whole
  text so far (the LLM API's cumulative `output.text`): the transport keeps the
  new part. Its contract has no end_id or min_tokens, so ignore_eos cannot be
  forced there; token counts come from the tokenizer.
- anything else is refused with one line naming what the model declares.

Optional inputs are sent only when the model declares them. A request for a LoRA adapter sends `lora_task_id`
[[id]] UINT64, as tensorrtllm_backend's inflight_batcher_llm_client.py does (the ensemble and the BLS pass it to
the tensorrt_llm model; the server holds the adapter from its lora_prefetch_dir); a model that declares no
`lora_task_id` is refused for such a workload in one line (`check_lora`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from toolchain.errors import ToolchainError

TEXT, TOKEN_IDS, LLMAPI = "text", "token-ids", "llmapi"


@dataclass
class Contract:
    model: str
    kind: str
    inputs: set[str]
    outputs: set[str]
    decoupled: bool
    batched: bool = True
    """max_batch_size > 0: every tensor carries a leading batch dimension."""

    @property
    def server_counts(self) -> bool:
        """Per-response token counts come from the server (exact)."""
        if self.kind == TOKEN_IDS:
            return True
        return "return_num_output_tokens" in self.inputs and "num_output_tokens" in self.outputs


def detect(model: str, url: str, meta: dict, config: dict, *, streaming: bool) -> Contract:
    inputs = {i["name"] for i in meta.get("inputs", [])}
    outputs = {o["name"] for o in meta.get("outputs", [])}
    decoupled = bool(config.get("model_transaction_policy", {}).get("decoupled", False))
    if {"input_ids", "input_lengths", "request_output_len"} <= inputs and "output_ids" in outputs:
        kind = TOKEN_IDS
    elif {"text_input", "max_tokens"} <= inputs and "text_output" in outputs:
        kind = TEXT
    elif {"text_input", "sampling_param_max_tokens"} <= inputs and "text_output" in outputs:
        kind = LLMAPI
    else:
        shown = ", ".join(sorted(inputs)[:8]) or "none"
        raise ToolchainError(
            f"model '{model}' on {url} speaks neither the text contract (text_input, max_tokens -> text_output) "
            f"nor the token-id contract (input_ids, input_lengths, request_output_len -> output_ids); "
            f"its inputs: {shown}",
            "set validation.workload.endpoint to ensemble, tensorrt_llm_bls or tensorrt_llm")
    stream_input = "stream" if kind == TEXT else "streaming"  # token ids and llmapi call it streaming
    if streaming and stream_input not in inputs:
        raise ToolchainError(f"model '{model}' on {url} has no '{stream_input}' input, so it cannot stream tokens",
                             "set validation.workload.streaming: false")
    if streaming and not decoupled:
        raise ToolchainError(f"model '{model}' on {url} is not decoupled, so it cannot stream tokens",
                             "deploy with serving.streaming: true, or set validation.workload.streaming: false")
    return Contract(model, kind, inputs, outputs, decoupled, batched=int(config.get("max_batch_size", 0) or 0) > 0)


def check_lora(c: Contract, url: str, adapters: dict[str, int]) -> None:
    """Refuse, in one line, a workload whose classes name LoRA adapters when the model cannot take one."""
    if not adapters:
        return
    names = ", ".join(adapters)
    if c.kind == LLMAPI:
        # Triton's llmapi model at TensorRT-LLM 1.2 sends no LoRARequest (model.py: "TODO : [JIRA-4040] Verify
        # Lora"); later releases add lora_id/lora_name/lora_path inputs, not pinned here.
        raise ToolchainError(f"model '{c.model}' on {url} is Triton's llmapi model, which takes no LoRA adapter per "
                             f"request, and the workload's classes name adapters ({names})",
                             "bench the adapters through the OpenAI server (protocol openai-completions)")
    if "lora_task_id" not in c.inputs:
        raise ToolchainError(f"model '{c.model}' on {url} declares no lora_task_id input, and the workload's classes "
                             f"name LoRA adapters ({names})",
                             "deploy the spec with its lora section (toolchain model-repo SPEC), or remove the "
                             "classes' adapters")


def prepared(c: Contract | None) -> Contract:
    """The contract a transport's prepare() detected; requests cannot be built before it ran."""
    if c is None:
        raise RuntimeError("the transport's prepare() has not run: the model's tensor contract is unknown")
    return c


def request_tensors(c: Contract, *, text: str | None, ids: list[int] | None, max_tokens: int, streaming: bool,
                    ignore_eos: bool, exclude_input: bool | None, num_draft_tokens: int = 0,
                    lora_task_id: int | None = None) -> list[tuple[str, str, np.ndarray]]:
    """[(name, Triton datatype, array with the batch dim)] for one request."""
    def i32(v):
        return np.array([[v]], np.int32)

    def flag(v):
        return np.array([[v]], np.bool_)

    out = []
    if c.kind == LLMAPI:
        out += [("text_input", "BYTES", _text_input(c, text)),
                ("sampling_param_max_tokens", "INT32", i32(max_tokens))]
        if "streaming" in c.inputs:
            out.append(("streaming", "BOOL", flag(streaming)))
        # Upstream's helpers default it to False, which would put the prompt in text_output.
        if "sampling_param_exclude_input_from_output" in c.inputs:
            out.append(("sampling_param_exclude_input_from_output", "BOOL", flag(True)))
        if num_draft_tokens and "sampling_param_return_perf_metrics" in c.inputs:
            out.append(("sampling_param_return_perf_metrics", "BOOL", flag(True)))
    elif c.kind == TOKEN_IDS:
        if ids is None:  # Plan(token_ids=transport.token_ids) makes them
            raise ValueError(f"model '{c.model}' takes the prompt as token ids, and it came as text")
        out += [("input_ids", "INT32", np.asarray([ids], np.int32)), ("input_lengths", "INT32", i32(len(ids))),
                ("request_output_len", "INT32", i32(max_tokens))]
        if "streaming" in c.inputs:
            out.append(("streaming", "BOOL", flag(streaming)))
        # Non-streaming responses would echo the prompt; the counts must be the completion only.
        if "exclude_input_in_output" in c.inputs:
            out.append(("exclude_input_in_output", "BOOL", flag(True)))
    else:
        out += [("text_input", "BYTES", _text_input(c, text)),
                ("max_tokens", "INT32", i32(max_tokens))]
        if "stream" in c.inputs:
            out.append(("stream", "BOOL", flag(streaming)))
        if exclude_input is not None and "exclude_input_in_output" in c.inputs:
            out.append(("exclude_input_in_output", "BOOL", flag(exclude_input)))
        if c.server_counts:
            out.append(("return_num_output_tokens", "BOOL", flag(True)))
        if num_draft_tokens and "num_draft_tokens" in c.inputs:  # the BLS's draft-target loop
            out.append(("num_draft_tokens", "INT32", i32(num_draft_tokens)))
            if "return_perf_metrics" in c.inputs:  # for the acceptance figures
                out.append(("return_perf_metrics", "BOOL", flag(True)))
    if ignore_eos:
        # end_id -1 matches no token and min_tokens = max_tokens stops other stop rules: OSL is exact.
        if "end_id" in c.inputs:
            out.append(("end_id", "INT32", i32(-1)))
        if "min_tokens" in c.inputs:
            out.append(("min_tokens", "INT32", i32(max_tokens)))
    if lora_task_id is not None:  # check_lora has seen the input declared
        out.append(("lora_task_id", "UINT64", np.array([[lora_task_id]], np.uint64)))
    if not c.batched:  # max_batch_size 0: the declared dims are the whole shape
        out = [(n, d, a.reshape(a.shape[1:])) for n, d, a in out]
    return out


def _text_input(c: Contract, text: str | None) -> np.ndarray:
    if text is None:  # Plan(token_ids=transport.token_ids) makes a text prompt for a text contract
        raise ValueError(f"model '{c.model}' takes the prompt as text, and it came as token ids")
    return np.array([[text.encode("utf-8")]], np.object_)


DRAFT_OUTPUTS = ("total_draft_tokens", "total_accepted_draft_tokens")


def requested_outputs(c: Contract, speculative: bool = False) -> list[str]:
    if c.kind == TOKEN_IDS:
        return ["output_ids", "sequence_length"]  # the backend insists on both
    out = ["text_output", "num_output_tokens"] if c.server_counts else ["text_output"]
    return out + [n for n in DRAFT_OUTPUTS if n in c.outputs] if speculative else out


def record_drafts(rec, values: dict) -> None:
    """Keep a response's draft-token totals (the last response of a request holds the request's)."""
    if "total_draft_tokens" in values:
        rec.draft_tokens = int(values["total_draft_tokens"])
    if "total_accepted_draft_tokens" in values:
        rec.accepted_draft_tokens = int(values["total_accepted_draft_tokens"])


def ready_or_raise(model: str, url: str, index: list[dict], hint_field: str = "validation.workload.endpoint") -> None:
    """Raise the one-line error for a model that is missing or not ready, given the repository index."""
    states = {m.get("name"): m for m in index}
    if model not in states:
        served = ", ".join(sorted(n for n in states if n)) or "nothing"
        raise ToolchainError(f"model '{model}' not found on the Triton server at {url} (it serves: {served})",
                             f"set {hint_field} to a served model or regenerate the model repository")
    entry = states[model]
    raise ToolchainError(f"model '{model}' is not ready on {url} (state {entry.get('state', '?')}: "
                         f"{entry.get('reason', '')})", "check the tritonserver log for why it failed to load")
