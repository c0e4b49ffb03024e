"""Checks for speculative decoding: build combinations trtllm-build rejects
(TensorRT-LLM tensorrt_llm/commands/build.py, tensorrt_llm/builder.py, the
examples/{draft_target_model,lookahead,ngram}/README.md pages) and the
Triton-side limits of each method (TensorRT-LLM triton_backend
all_models/inflight_batcher_llm/tensorrt_llm_bls, tensorrtllm_backend issues #710, #711)."""

from __future__ import annotations

import functools

from toolchain.checks.registry import ENGINE, ENGINE_PATH, FAIL, PASS, SERVING, WARN, Context, check
from toolchain.errors import ToolchainError
from toolchain.speculative import DRAFT_ENGINE, mode_of, refusal
from toolchain.targets import target_of

OFF = (PASS, "no speculative decoding")


def lookahead_draft_len(w: int, n: int, g: int) -> int:
    """Draft tokens a lookahead (W, N, G) configuration produces per step (TensorRT-LLM
    examples/lookahead/README.md)."""
    return (0 if n == 1 else n - 2) + (w - 1 + g) * (n - 1)


@check("spec.mode-runnable", ENGINE + SERVING, "the speculative mode must speculate once deployed", paths=ENGINE_PATH)
def _mode_runnable(ctx: Context):
    mode = ctx.spec.speculative.mode
    refused = refusal(mode, target_of(ctx.spec))
    if refused:
        return FAIL, refused
    return (PASS, f"{mode} runs end to end") if mode != "none" else OFF


def of_mode(mode: str, other_modes: str):
    """A check of one mode's own settings or networks (its tree, its window, its heads): it passes with the
    message `other_modes` for every other mode. The checks of what modes share read the mode's row instead."""
    def wrap(fn):
        @functools.wraps(fn)
        def checked(ctx: Context):
            return fn(ctx) if ctx.spec.speculative.mode == mode else (PASS, other_modes)
        return checked
    return wrap


@check("spec.medusa-heads", ENGINE + SERVING,
       "Medusa needs heads matching the target and a draft tree they can fill "
       "(TensorRT-LLM tensorrt_llm/models/medusa/, examples/medusa/README.md)", paths=ENGINE_PATH)
@of_mode("medusa", "not Medusa")
def _medusa(ctx: Context):
    sp = ctx.spec.speculative
    from toolchain.checkpoint.medusa import medusa_tree, read_heads

    if ctx.spec.parallelism.pp > 1:
        return FAIL, (f"Medusa with parallelism.pp={ctx.spec.parallelism.pp} is not supported; set parallelism.pp "
                      "to 1 (use tp for more GPUs)")
    if sp.heads is None:
        return FAIL, ("speculative.mode=medusa needs speculative.heads; train them with "
                      "`toolchain medusa-heads MODEL_DIR OUT_DIR`")
    params = ctx.model.params if ctx.model is not None else None
    try:
        heads = read_heads(sp.heads, hidden_size=params.hidden_size if params else None,
                           vocab_size=params.vocab_size if params else None)
        tree = medusa_tree(ctx.spec, heads)
    except ToolchainError as err:
        return FAIL, str(err)
    limit = sp.max_draft_len or len(tree)
    if len(tree) > limit:
        return FAIL, (f"the Medusa tree has {len(tree)} nodes but speculative.max_draft_len is {limit}; set it to "
                      f"{len(tree)} (or 0 to take the tree's size)")
    depth = max(len(p) for p in tree)
    return PASS, (f"{heads.num_heads} heads for hidden size {heads.hidden_size}; tree of {len(tree)} nodes, "
                  f"{depth} deep")


# At model-repo and serve too: without a draft the repository would still say decoding_mode eagle and,
# with no eagle_choices, the backend would fall back to its 63-node default tree (as spec.medusa-heads).
@check("spec.eagle-draft", ENGINE + SERVING,
       "EAGLE needs a draft fitting the target, a Llama target, no quantization and a tree it can fill "
       "(TensorRT-LLM tensorrt_llm/models/eagle/, examples/eagle/README.md)", paths=ENGINE_PATH)
@of_mode("eagle", "not EAGLE")
def _eagle_draft(ctx: Context):
    sp = ctx.spec.speculative
    from toolchain.checkpoint.eagle import eagle_shape, eagle_tree, read_draft, refuse_unsupported

    model = ctx.model
    params = model.params if model is not None else None
    try:
        refuse_unsupported(ctx.spec, params.architecture if params else None,
                           quantized=ctx.quant.active or (model is not None
                                                          and model.hf_config.get("quantization_config") is not None))
        tree = eagle_tree(ctx.spec)
        shape = eagle_shape(ctx.spec, tree)
        layers = f"a {read_draft(sp.heads, params).params.num_hidden_layers}-layer draft, " if (
            params and sp.heads is not None) else ""
    except ToolchainError as err:
        return FAIL, str(err)
    return PASS, (f"{layers}{shape.num_eagle_layers} EagleNets for a tree of {len(tree)} nodes "
                  f"(max_draft_len {shape.max_draft_len}, max_non_leaves_per_layer {shape.max_non_leaves_per_layer})")


@check("spec.draft-len", ENGINE, "a draft length is needed and must stay below max_seq_len", paths=ENGINE_PATH)
def _draft_len(ctx: Context):
    sp, lim = ctx.spec.speculative, ctx.spec.limits
    if sp.mode == "none":
        return OFF
    if mode_of(sp.mode).needs_draft_len and sp.max_draft_len == 0:
        return FAIL, f"speculative.mode={sp.mode} needs speculative.max_draft_len > 0 (the draft tokens per step)"
    if sp.max_draft_len >= lim.max_seq_len:
        return FAIL, (f"speculative.max_draft_len ({sp.max_draft_len}) must be below limits.max_seq_len "
                      f"({lim.max_seq_len})")
    return PASS, f"{sp.mode}, up to {sp.max_draft_len or 'the checkpoint'} draft tokens per step"


@check("spec.gather-context-logits", ENGINE,
       "gather_context_logits with max_draft_len > 0 is an error (TensorRT-LLM build.py)", paths=ENGINE_PATH)
def _gather(ctx: Context):
    if ctx.spec.speculative.mode == "none":
        return OFF
    if ctx.spec.build.gather_context_logits:
        return FAIL, "build.gather_context_logits cannot be combined with speculative decoding; turn it off"
    return PASS, "no context logits gathered"


@check("spec.beam-search", ENGINE,
       "beam search is not supported with speculative decoding (TensorRT-LLM speculative-decoding.md)", paths=ENGINE_PATH)
def _beam(ctx: Context):
    if ctx.spec.speculative.mode == "none":
        return OFF
    if ctx.spec.build.max_beam_width > 1:
        return FAIL, (f"build.max_beam_width={ctx.spec.build.max_beam_width} cannot be combined with "
                      "speculative decoding; set it to 1")
    return PASS, "beam width 1"


@check("spec.eagle-limits", ENGINE,
       "EAGLE needs pp 1, max_batch_size <= 512, max_draft_len <= 256 (TensorRT-LLM builder.py)", paths=ENGINE_PATH)
@of_mode("eagle", "not EAGLE")
def _eagle(ctx: Context):
    sp = ctx.spec.speculative
    bad = []
    if ctx.spec.parallelism.pp > 1:
        bad.append(f"parallelism.pp={ctx.spec.parallelism.pp} (must be 1)")
    if ctx.spec.limits.max_batch_size > 512:
        bad.append(f"limits.max_batch_size={ctx.spec.limits.max_batch_size} (at most 512)")
    if sp.max_draft_len > 256:
        bad.append(f"speculative.max_draft_len={sp.max_draft_len} (at most 256)")
    if bad:
        return FAIL, f"EAGLE cannot be built with {', '.join(bad)}"
    return PASS, "EAGLE limits met"


@check("spec.lookahead-draft-len", ENGINE + SERVING,
       "lookahead needs W, N, G and max_draft_len >= D (TensorRT-LLM lookahead README)", paths=ENGINE_PATH)
@of_mode("lookahead", "not lookahead")
def _lookahead(ctx: Context):
    sp = ctx.spec.speculative
    w, n, g = sp.lookahead_window_size, sp.lookahead_ngram_size, sp.lookahead_verification_set_size
    if w < 1 or n < 1:
        return FAIL, ("lookahead needs speculative.lookahead_window_size and lookahead_ngram_size >= 1 "
                      "(Triton refuses to start without all three lookahead parameters)")
    d = lookahead_draft_len(w, n, g)
    if sp.max_draft_len < d:
        return FAIL, (f"lookahead (W={w}, N={n}, G={g}) drafts {d} tokens per step but speculative.max_draft_len "
                      f"is {sp.max_draft_len}; set max_draft_len to {d}")
    return PASS, f"(W={w}, N={n}, G={g}) drafts {d} <= max_draft_len {sp.max_draft_len}"


@check("spec.draft-model", ENGINE + SERVING,
       "draft_target needs a readable draft checkpoint (TensorRT-LLM draft_target_model README)")
def _draft_model(ctx: Context):
    sp = ctx.spec.speculative
    if mode_of(sp.mode).adds != DRAFT_ENGINE:
        return PASS, "no draft model needed"
    if sp.draft_model is None:
        return FAIL, "speculative.mode=draft_target needs speculative.draft_model (an HF checkpoint directory)"
    if ctx.draft is None:
        return FAIL, f"draft model: {ctx.draft_error}"
    dp = ctx.draft.params
    if ctx.model is not None and dp.vocab_size > ctx.model.params.vocab_size:
        return FAIL, (f"draft vocab_size {dp.vocab_size} exceeds the target's {ctx.model.params.vocab_size}: "
                      "the draft must share the target's tokenizer")
    mismatch = tokenizer_mismatch(ctx.spec.model.tokenizer_dir, sp.draft_model)
    if mismatch:
        return FAIL, (f"the draft's tokenizer differs from the target's ({mismatch}): draft token ids would mean "
                      "other text; use a draft trained with the target's tokenizer")
    return PASS, f"draft {dp.architecture} with {dp.num_hidden_layers} layers at {sp.draft_model}"


def _vocabulary(directory) -> dict | None:
    """token -> id of a tokenizer.json (model vocab plus added tokens), or None without one."""
    import json
    from pathlib import Path

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        tok = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    vocab = (tok.get("model") or {}).get("vocab")
    if isinstance(vocab, list):  # unigram: [[piece, score], ...]
        vocab = {entry[0]: i for i, entry in enumerate(vocab) if entry}
    if not isinstance(vocab, dict):
        return None
    out = dict(vocab)
    for entry in tok.get("added_tokens") or []:
        if isinstance(entry, dict) and isinstance(entry.get("content"), str):
            out[entry["content"]] = entry.get("id")
    return out


def tokenizer_mismatch(target_dir, draft_dir) -> str | None:
    """The first token the two tokenizers map differently ("'x' is 5 in the target, 7 in the
    draft"), or None when they agree or either has no tokenizer.json to compare."""
    target, draft = _vocabulary(target_dir), _vocabulary(draft_dir)
    if target is None or draft is None:
        return None
    for token, tid in target.items():
        if draft.get(token, tid) != tid:
            return f"{token!r} is {tid} in the target, {draft[token]} in the draft"
    extra = sorted(set(draft) - set(target))
    if extra:
        return f"{extra[0]!r} (id {draft[extra[0]]}) is only in the draft's vocabulary"
    missing = sorted(set(target) - set(draft))
    if missing:
        return f"{missing[0]!r} (id {target[missing[0]]}) is missing from the draft's vocabulary"
    return None


@check("spec.draft-target-reuse", ENGINE,
       "draft-target needs KV-cache reuse and paged context FMHA (TensorRT-LLM draft_target_model README)", paths=ENGINE_PATH)
def _draft_reuse(ctx: Context):
    if not mode_of(ctx.spec.speculative.mode).external_drafts:
        return PASS, "not draft-target"
    b = ctx.spec.build
    if not (b.kv_cache_reuse and b.use_paged_context_fmha):
        return FAIL, (f"speculative.mode={ctx.spec.speculative.mode} relies on KV-cache reuse; set "
                      "build.kv_cache_reuse=true and build.use_paged_context_fmha=true")
    return PASS, "KV-cache reuse on"


@check("spec.draft-target-grpc-port", SERVING,
       "upstream's BLS reaches the models' configs through localhost:8001 (tensorrt_llm_bls/1/model.py)", paths=ENGINE_PATH)
def _draft_port(ctx: Context):
    if mode_of(ctx.spec.speculative.mode).adds != DRAFT_ENGINE:
        return PASS, "not draft-target"
    if ctx.spec.serving.grpc_port != 8001:
        # The toolchain's own BLS calls the models in process (BLS exec); only NVIDIA's model.py, rendered
        # with `model-repo --python-models`, asks the server on the fixed port.
        return WARN, (f"serving.grpc_port is {ctx.spec.serving.grpc_port}: fine for the toolchain's BLS, but "
                      "upstream's (model-repo --python-models) calls localhost:8001; set serving.grpc_port=8001 "
                      "for it")
    return PASS, "gRPC on 8001"


@check("spec.draft-target-decoupled", SERVING,
       "speculation through the BLS cannot stream (tensorrt_llm_bls/1/lib/decode.py)", paths=ENGINE_PATH)
def _draft_stream(ctx: Context):
    mode = ctx.spec.speculative.mode
    if not mode_of(mode).external_drafts:
        return PASS, "not draft-target"
    if ctx.spec.serving.streaming:
        return FAIL, (f"speculative.mode={mode} runs through the BLS, which neither streams nor accepts decoupled "
                      "models; set serving.streaming=false")
    return PASS, "not decoupled"


@check("spec.ngram-no-triton", SERVING,
       "n-gram drafts come from the toolchain's BLS; the 1.2 engine backend has no n-gram mode "
       "(TensorRT-LLM examples/ngram/README.md)", paths=ENGINE_PATH)
def _ngram(ctx: Context):
    if not mode_of(ctx.spec.speculative.mode).prompt_lookup:
        return PASS, "not n-gram"
    # The target takes external draft tokens (draft_tokens_external); the toolchain's BLS makes them by
    # prompt lookup. NVIDIA's BLS (model-repo --python-models) only knows a draft model.
    return WARN, ("speculative.mode=ngram: the toolchain's BLS drafts by prompt lookup and the engine verifies "
                  "them as external draft tokens; upstream's BLS (model-repo --python-models) does not draft n-grams")
