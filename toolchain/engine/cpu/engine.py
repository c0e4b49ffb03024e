"""`CpuEngine`: load an engine directory and run requests over its rank shards.

`generate` and the inflight batcher share the same pieces: `start` (validate a
request, give it a sampler), `add` (its context's KV blocks, reusing cached
prefix blocks), `step` (one forward over any mix of context chunks and decoding
requests, then one token each for those that reached their end) and `release`.
A request gets the same tokens alone or batched.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
import os
import threading
from pathlib import Path

import torch

from toolchain.engine.cpu import beams
from toolchain.engine.cpu.config import BuildLimits, ModelDims, read_engine_config
from toolchain.engine.cpu.guided import GuidedDecoder, GuideError
from toolchain.engine.cpu.kv_cache import BlockTable, KvCacheConfig, KvCacheManager, capped, pool_reserve_bytes
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.engine.cpu.lora import LoraCache, load_lora, lora_request_problem
from toolchain.engine.cpu.model import Chunk, Model
from toolchain.engine.cpu.mtp import positions_known
from toolchain.engine.cpu.sampling import Sampler, SamplingParams
from toolchain.engine.cpu.comm import Comm, num_blocks
from toolchain.engine.cpu.ranks import LeaderModel
from toolchain.engine.cpu.threads import on_passing_thread
from toolchain.engine.cpu.weights import load_own_stage, load_stages
from toolchain.errors import ToolchainError

log = logging.getLogger(__name__)


class Sequence:
    """One request in flight: its prompt, output so far, KV blocks and sampler."""

    def __init__(self, prompt: list[int], params: SamplingParams, draft: list[int] | None = None,
                 draft_probs: torch.Tensor | None = None, acceptance_threshold: float | None = None):
        self.prompt = [int(t) for t in prompt]
        self.params = params
        # External draft tokens (draft_input_ids), verified with the end of the context; with
        # draft_logits, by TensorRT-LLM's probability rule instead of token equality.
        self.draft = [int(t) for t in draft or ()]
        self.draft_probs = draft_probs
        self.acceptance_threshold = acceptance_threshold
        self.accepted_draft = 0
        self.drafted = len(self.draft)  # draft tokens offered for verification (total_draft_tokens)
        # The engine's own drafts for the next step: a Medusa tree's tokens in node order, or MTP's (mtp.py).
        self.tree: list[int] = []
        # return_generation_logits: a list the caller owns, extended each step with the logits rows
        # [n, V] its n emitted tokens were chosen from; None (the default) keeps nothing.
        self.generation_logits: list[torch.Tensor] | None = None
        # Log-probs and context logits (logprobs.py): a record the caller owns, filled before it hears of tokens.
        self.logprobs: TokenLogprobs | None = None
        self.picked: list[float] = []  # this step's emitted tokens' log-probs in the sampler's own terms
        self.table = BlockTable()
        self.sampler = Sampler(params)
        self.output: list[int] = []
        self.finished = False
        self.reason: str | None = None  # "length", "end_id", "stop_word", "cancelled", "error"
        self.error: str | None = None

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def pending(self) -> int:
        """Tokens whose K/V are not cached yet: the context (or what is left of it), else 1."""
        return len(self.prompt) + len(self.output) - self.table.length

    @property
    def in_context(self) -> bool:
        """In the context phase: prompt tokens left to compute, or none left (all but the last
        reused from the cache) but no token sampled yet, which the context step does."""
        return self.pending > 1 or not self.output

    def riders(self, n: int) -> list[int]:
        """Draft tokens fed with `n` pending tokens: external drafts ride on the chunk that reaches
        the end of the context (a single token when reused blocks cover the rest), a Medusa tree
        on each generation step."""
        if n != self.pending:
            return []
        if self.draft:
            return self.draft
        return [] if self.in_context else self.tree

    @property
    def wants_context(self) -> bool:
        """Prompt log-probs or context logits asked: every prompt position's logits, so no prefix reuse."""
        return self.logprobs is not None and self.logprobs.wants_context

    @property
    def has_blocks(self) -> bool:
        return bool(self.table.blocks)

    def finish(self, reason: str) -> None:
        self.finished, self.reason = True, reason

    def accept(self, logits: torch.Tensor, argmax: int | None = None) -> list[int]:
        """Sample the next token from `logits` [V]; returns the tokens to emit (empty on end_id). `argmax`: the
        step's batched argmax of these logits (Chunk.argmax), the pick where Sampler.picks_argmax."""
        sampler = self.sampler
        if argmax is not None:
            sampler.last_sampled = 0.0
        token = sampler.pick(logits, len(self.output), self.tokens if sampler.reads_history else None) \
            if argmax is None else argmax
        emitted = self.take(token)
        if emitted:
            mode = self.logprobs.mode if self.logprobs is not None else "raw"
            self.picked.append(sampler.last_processed if mode == "processed" else sampler.last_sampled)
        return emitted

    def take(self, token: int) -> list[int]:
        """Append `token` unless it ends the request; returns the tokens to emit."""
        if self.sampler.is_end(token) or self.sampler.guide_done():
            self.finish("end_id")
            return []
        self.output.append(token)
        if self.sampler.hits_stop(self.output):
            self.finish("stop_word")
        elif len(self.output) >= self.params.max_new_tokens:
            self.finish("length")
        return [token]

    def verify(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """Draft tokens against the target's logits [len(draft) + 1, V], position by position:
        sample the target's token; while it equals the draft's, the draft token is accepted and
        the next position is tried. So every emitted token is the target's own choice given the
        tokens before it: greedy output is unchanged, sampled output keeps its distribution."""
        if self.draft_probs is not None:
            return self._verify_by_logits(logits, draft)
        emitted = []
        for i, row in enumerate(logits):
            emitted += self.accept(row)
            if self.finished or i == len(draft) or emitted[-1] != draft[i]:
                break
            self.accepted_draft += 1
        return emitted

    def _verify_by_logits(self, logits: torch.Tensor, draft: list[int]) -> list[int]:
        """draft_logits as TensorRT-LLM judges them (acceptDraftTokensByLogitsKernel and
        correctAcceptedStatesAndLogits in cpp/tensorrt_llm/kernels/speculativeDecoding/
        externalDraftTokensKernels.cu): position i is rejected
        when any token's target probability p[v] falls below t * q[v] (t = draft_acceptance_threshold,
        or a fresh uniform draw per token without one); an accepted position emits the draft token.
        At the first rejection the target samples from max(p - q, 0), renormalised, written back as
        logits log(c / (1 - c)) the way the kernel does. Not lossless, as upstream's rule is not."""
        emitted = []
        draft_probs = self.draft_probs
        if draft_probs is None:
            raise RuntimeError("verification by draft logits without the draft's logits")
        for i, row in enumerate(logits):
            if i == len(draft):
                emitted += self.accept(row)
                break
            p, q = torch.softmax(row.float(), -1), draft_probs[i]
            t = (self.acceptance_threshold if self.acceptance_threshold is not None
                 else torch.rand(p.shape, generator=self.sampler.generator))
            if not bool((p < t * q).any()):
                taken = self.take(draft[i])
                if taken:  # its log-prob in the target's own distribution
                    self.picked.append(float(torch.log(p[draft[i]])))
                emitted += taken
                if self.finished:
                    break
                self.accepted_draft += 1
                continue
            c = (p - q).clamp(min=0)
            # All corrected mass on one token would make its logit +inf (and sampled softmax NaN).
            c = (c / c.sum().clamp(min=1e-6)).clamp(max=1 - 1e-6)
            emitted += self.accept(torch.log(c / (1 - c)))
            break
        return emitted


def _emitted_rows(rows: torch.Tensor, path: list[int], tree: bool, n: int) -> torch.Tensor:
    """The logits rows the `n` emitted tokens of a step were chosen from: the first n (plain and
    draft verification emit position by position), or the root and the accepted tree nodes. The
    forward's own logits, not the draft-corrected ones a rejection samples from."""
    index = [0, *path][:n] if tree else list(range(n))
    return rows[index].float()  # advanced indexing copies: the step's logits tensor is not kept alive


class MedusaTree:
    """The static draft tree of Medusa decoding (medusa_choices): node i is a path of candidate
    indices, its token head d's path[d]-th most likely token at depth d + 1. Nodes are kept
    parents first; chunk index 0 is the root (the last emitted token), node i sits at i + 1."""

    def __init__(self, paths: list[list[int]], heads: int):
        self.paths = sorted((list(p) for p in paths), key=lambda p: (len(p), p))
        index = {tuple(p): i + 1 for i, p in enumerate(self.paths)}
        self.parents = [index.get(tuple(p[:-1]), 0) for p in self.paths]
        self.depth = max(len(p) for p in self.paths)
        self.top_k = [1 + max((p[d] for p in self.paths if len(p) > d), default=0) for d in range(self.depth)]
        self.children: dict[int, list[int]] = {}
        for i, parent in enumerate(self.parents, start=1):
            self.children.setdefault(parent, []).append(i)
        self.heads = heads

    @classmethod
    def create(cls, choices, dims: ModelDims, limits: BuildLimits) -> "MedusaTree":
        if not choices:
            raise ToolchainError("a Medusa engine needs its draft tree (medusa_choices)",
                                 "set speculative.choices, or use heads written by `toolchain medusa-heads`")
        paths = [list(p) for p in choices]
        seen = {tuple(p) for p in paths}
        for p in paths:
            if not p or any(not isinstance(i, int) or i < 0 for i in p):
                raise ToolchainError(f"medusa_choices: path {p} must be non-empty indices >= 0")
            if len(p) > dims.medusa_heads:
                raise ToolchainError(f"medusa_choices: path {p} is {len(p)} deep but the engine has "
                                     f"{dims.medusa_heads} Medusa heads", "use a tree no deeper than the heads")
            if len(p) > 1 and tuple(p[:-1]) not in seen:
                raise ToolchainError(f"medusa_choices: path {p} has no parent {p[:-1]} in the tree")
            if p[-1] >= dims.vocab_size:
                raise ToolchainError(f"medusa_choices: index {p[-1]} is beyond the vocabulary")
        if len(seen) != len(paths):
            raise ToolchainError("medusa_choices: a path appears twice")
        if len(paths) > limits.max_draft_len:
            raise ToolchainError(f"medusa_choices has {len(paths)} nodes, more than the engine's max_draft_len "
                                 f"{limits.max_draft_len}", "use a smaller tree or rebuild with a larger max_draft_len")
        return cls(paths, dims.medusa_heads)

    def propose(self, head_logits: torch.Tensor) -> list[int]:
        """The tree's tokens from the heads' logits [heads, 1, V] at the last accepted position."""
        top = [head_logits[d, 0].topk(k).indices.tolist() for d, k in enumerate(self.top_k)]
        return [top[len(p) - 1][p[-1]] for p in self.paths]

    def verify(self, seq: "Sequence", rows: torch.Tensor) -> tuple[list[int], list[int]]:
        """Walk the tree from the root: the target samples its token at a node; if a child holds
        that token the child is accepted and the walk goes on. Every emitted token is the
        target's own choice given the tokens before it, as with external drafts. Returns the
        emitted tokens and the accepted nodes' chunk indices."""
        tree, node, emitted, path = seq.tree, 0, [], []
        while True:
            emitted += seq.accept(rows[node])
            if seq.finished:
                break
            child = next((c for c in self.children.get(node, ()) if tree[c - 1] == emitted[-1]), None)
            if child is None:
                break
            path.append(child)
            node = child
        seq.accepted_draft += len(path)
        seq.drafted += self.depth  # the most a step can accept: rates compare with draft-target's
        seq.tree = []
        return emitted, path


class CpuEngine:
    def __init__(self, config: dict, dims: ModelDims, limits: BuildLimits, model: Model | LeaderModel,
                 kv: KvCacheManager, medusa_choices: list[list[int]] | None = None):
        self.config = config
        self.dims = dims
        self.limits = limits
        self.model = model
        self.kv = kv
        # Guided decoding (guided.py): set by whoever knows the tokenizer; None refuses requests with a guide.
        self.guided: GuidedDecoder | None = None
        # LoRA adapters by task id (lora.py); None: built without LoRA. `load` sets it; the model reads it too.
        self.lora: LoraCache | None = None
        self.medusa = MedusaTree.create(medusa_choices, dims, limits) if dims.medusa_heads else None
        # Draft tokens the engine's multi-token-prediction layer adds to each step (mtp.py): one, from the first.
        self.mtp_draft_len = 1 if dims.mtp_layers else 0
        if medusa_choices is not None and not dims.medusa_heads:
            raise ToolchainError("medusa_choices given for an engine without Medusa heads",
                                 "build a MedusaForCausalLM engine (speculative.mode medusa) or drop the choices")
        # The pool and the tables are shared state: generate() on a caller's thread and the
        # batcher's loop must not interleave their steps.
        self.lock = threading.RLock()
        width = limits.max_beam_width  # TRT-LLM: room for one full-length sequence of every beam
        if kv.capacity_tokens < limits.max_seq_len * width:
            raise ToolchainError(
                f"the KV cache holds {kv.capacity_tokens} tokens ({kv.num_blocks} blocks of {kv.tokens_per_block}), "
                f"less than one max_seq_len ({limits.max_seq_len}) sequence" + (f" of {width} beams" if width > 1 else ""),
                "raise max_tokens_in_paged_kv_cache or kv_cache_free_gpu_mem_fraction, or lower max_seq_len")

    @classmethod
    def load(cls, engine_dir: Path | str, *, num_threads: int | None = None,
             kv_cache: KvCacheConfig | None = None, medusa_choices: list[list[int]] | None = None,
             comm: Comm | None = None, unit_kv_scales: bool = False, lora_host_bytes: int | None = None,
             lora_prefetch_dir: Path | None = None) -> "CpuEngine":
        """Load and validate an engine directory.

        `num_threads` sets torch's intra-op threads for the whole process (None
        leaves them, 0 takes every core the host gives the process). `kv_cache`
        sizes the block pool; by default its block size is the engine's
        tokens_per_block and its budget 90% of the memory available once the
        weights are loaded, capped (when kv_cache.max_tokens is unset) at
        CPU_POOL_BATCHES full batches of max_seq_len (kv_cache.py says why). With `comm` this process is rank 0 of rank processes
        (ranks.py): it loads its own shard and leads the others through each step. `unit_kv_scales`
        quantizes an INT8/FP8 KV cache with scale 1.0 instead of the checkpoint's (Model.use_unit_kv_scales).
        An engine built with LoRA gets a cache of `lora_host_bytes` (1 GiB by default) holding `lora_prefetch_dir`'s
        adapters (lora.load_lora).
        """
        if num_threads == 0:  # every core the host lets this process use
            num_threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return on_passing_thread(cls._load, Path(engine_dir), kv_cache, medusa_choices, comm, unit_kv_scales,
                                 lora_host_bytes, lora_prefetch_dir)

    @classmethod
    def _load(cls, engine_dir: Path, kv_cache: KvCacheConfig | None, medusa_choices: list[list[int]] | None,
              comm: Comm | None, unit_kv_scales: bool, lora_host_bytes: int | None,
              lora_prefetch_dir: Path | None) -> "CpuEngine":
        config, dims, limits = read_engine_config(engine_dir)
        if comm is not None and (dims.medusa_heads or dims.mtp_layers):
            raise ToolchainError(f"{'Medusa heads are' if dims.medusa_heads else 'an MTP layer is'} not run across "
                                 "rank processes", "serve this engine in one process (serving.launch: single)")
        lora = load_lora(config, dims, comm is not None, lora_host_bytes, lora_prefetch_dir, str(engine_dir))
        kv_cache = capped(kv_cache or KvCacheConfig(), limits.max_batch_size, limits.max_seq_len)
        reserve = pool_reserve_bytes(dims, kv_cache)
        model = Model(dims, load_own_stage(engine_dir, dims, comm.rank, reserve) if comm
                      else load_stages(engine_dir, dims, reserve), comm)
        model.lora = lora
        if unit_kv_scales:
            model.use_unit_kv_scales()
        if kv_cache.tokens_per_block is None:
            kv_cache = dataclasses.replace(kv_cache, tokens_per_block=limits.tokens_per_block)
        elif kv_cache.tokens_per_block != limits.tokens_per_block:
            raise ToolchainError(f"tokens_per_block {kv_cache.tokens_per_block} differs from the engine's "
                                 f"{limits.tokens_per_block}", "the block size is fixed when the engine is built")
        kv = KvCacheManager.create(dims, kv_cache)
        if comm is None:
            engine = cls(config, dims, limits, model, kv, medusa_choices)
        else:
            num_blocks(comm, kv)
            engine = cls(config, dims, limits, LeaderModel(model, comm, kv), kv, medusa_choices)
        engine.lora = lora
        return engine

    def close(self) -> None:
        """Release the rank processes this engine leads, if any (they leave their step loop)."""
        if isinstance(self.model, LeaderModel):
            self.model.close()

    @property
    def vocab_size(self) -> int:
        return self.dims.vocab_size

    # -- requests ---------------------------------------------------------------

    def _ids_problem(self, ids) -> str | None:
        if isinstance(ids, (str, bytes)) or not hasattr(ids, "__len__"):
            return f"prompt must be a list of token ids, got {type(ids).__name__}"
        if len(ids) == 0:
            return "empty prompt: at least one input token is required"
        for t in ids:  # numpy / torch integer scalars are fine; bools and floats are not
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= int(t) < self.vocab_size:
                return f"token id {t!r} is outside the vocabulary [0, {self.vocab_size})"
        return None

    def request_problem(self, prompt_ids, params: SamplingParams, draft=(), draft_logits=None) -> str | None:
        """Why a request cannot run on this engine (TRT-LLM's limits), or None."""
        problem = self._ids_problem(prompt_ids)
        if problem is None and len(draft):
            problem = self._draft_problem(draft)
        if problem is None and draft_logits is not None:
            shape = tuple(getattr(draft_logits, "shape", ()))
            if shape != (len(draft), self.vocab_size):
                problem = (f"draft_logits must be [{len(draft)} draft tokens, {self.vocab_size} vocab], "
                           f"got {list(shape)}")
        if problem is None and not isinstance(params, SamplingParams):
            problem = f"sampling parameters must be SamplingParams, got {type(params).__name__}"
        if problem is None:
            problem = params.problem(self.vocab_size)
        if problem is None and params.guide is not None:
            problem = self._guide_problem(params, draft)
        if problem is None:
            problem = lora_request_problem(self.lora, params.lora_task_id)
        if problem is not None:
            return problem
        n, lim = len(prompt_ids), self.limits
        if n > lim.max_input_len:
            return f"prompt has {n} tokens, more than the engine's max_input_len {lim.max_input_len}"
        if n + params.max_new_tokens > lim.max_seq_len:
            return (f"prompt ({n} tokens) + max_new_tokens ({params.max_new_tokens}) exceeds the engine's "
                    f"max_seq_len {lim.max_seq_len}; ask for at most {lim.max_seq_len - n} new tokens")
        speculative = ("Medusa heads" if self.medusa is not None else "an MTP layer" if self.mtp_draft_len
                       else "draft tokens" if len(draft) or lim.max_draft_len else None)
        return beams.request_problem(params, lim.max_beam_width, speculative)

    def _guide_problem(self, params: SamplingParams, draft) -> str | None:
        guide = params.guide
        if guide is None:
            return None
        if self.guided is None:
            return ("guided decoding is not enabled for this engine; turn it on (guided_decoding_backend xgrammar "
                    "with the tokenizer's info) or send no guide")
        if len(draft):
            return "guided decoding is not supported with draft_input_ids; send one or the other"
        try:
            self.guided.compile(guide)
        except GuideError as err:
            return f"the {guide.kind} guide is rejected by XGrammar: {err}"
        return None

    def _draft_problem(self, draft) -> str | None:
        limit = self.limits.max_draft_len
        if self.medusa is not None or self.mtp_draft_len:
            return (f"draft_input_ids given to {'a Medusa engine' if self.medusa else 'an engine with an MTP layer'}, "
                    "which drafts with its own; send none")
        if limit == 0:
            return ("draft_input_ids given, but the engine was built without speculative decoding "
                    "(max_draft_len 0); set speculative.mode and max_draft_len and rebuild")
        if len(draft) > limit:
            return f"{len(draft)} draft tokens exceed the engine's max_draft_len {limit}"
        problem = self._ids_problem(draft)
        return None if problem is None else f"draft_input_ids: {problem}"

    def start(self, prompt_ids: list[int], params: SamplingParams, draft=(), draft_logits=None,
              acceptance_threshold: float | None = None, logprobs: TokenLogprobs | None = None) -> Sequence:
        """A validated request, not yet holding any KV blocks. `draft_logits` [len(draft), V] make
        the draft judged by probabilities (TensorRT-LLM's rule) instead of token equality. `logprobs`,
        a record the caller owns, receives what params.logprobs / prompt_logprobs / return_context_logits
        ask for (one is made when they ask and none is given: Sequence.logprobs)."""
        problem = self.request_problem(prompt_ids, params, draft, draft_logits)
        if problem is None and logprobs is not None:
            problem = logprobs.problem()
        if problem is not None:
            raise ToolchainError(problem)  # the message names the limit and what would fit
        if params.beam_width > 1:  # one sequence per beam: beam_search.py's BeamSequence
            raise ToolchainError("a beam search (beam_width > 1) is started by toolchain.engine.cpu.beam_search "
                                 "(start_sequence, generate_sequences)")
        probs = None
        if draft_logits is not None:
            probs = torch.softmax(torch.as_tensor(draft_logits, dtype=torch.float32), -1)
        seq = Sequence(prompt_ids, params, list(draft), probs, acceptance_threshold)
        asked = params.logprobs is not None or params.prompt_logprobs is not None or params.return_context_logits
        if logprobs is not None or asked:
            seq.logprobs = logprobs if logprobs is not None else TokenLogprobs()
            seq.logprobs.configure(params.logprobs, params.prompt_logprobs, params.return_context_logits)
            seq.sampler.wants_processed = seq.logprobs.mode == "processed"
        if params.guide is not None and self.guided is not None:
            seq.sampler.guide = self.guided.matcher(params.guide)
        self.hold_lora(seq)
        return seq

    def hold_lora(self, seq: Sequence) -> None:
        """Keep `seq`'s adapter in the LoRA cache until `release(seq)` (a request in flight pins its task)."""
        if self.lora is not None and seq.params.lora_task_id is not None:
            self.lora.use(seq.params.lora_task_id, seq)

    # -- KV blocks ---------------------------------------------------------------

    def blocks_to_add(self, seq: Sequence) -> int:
        """Free blocks `add` would take for `seq`'s context now (after prefix reuse)."""
        if seq.wants_context:
            return self.kv.blocks_for(len(seq.tokens))
        return self.kv.blocks_to_add(seq.tokens, self.kv.reuse_root(seq.params.lora_task_id))

    def blocks_to_finish(self, seq: Sequence) -> int:
        """Blocks `seq` needs beyond those it holds (or, before `add`, beyond its context's) to
        reach its longest possible length: guaranteed_no_evict's reservation."""
        # The last token is never fed back; draft tokens are written before they are verified.
        # An MTP draft rides on the last fed token too.
        longest = len(seq.prompt) + max(seq.params.max_new_tokens - 1, len(seq.draft)) + self.mtp_draft_len
        if self.medusa is not None:  # the last step's tree is written beyond the last fed token
            longest = len(seq.prompt) + seq.params.max_new_tokens - 1 + len(self.medusa.parents)
        held = len(seq.table.blocks) if seq.has_blocks else self.kv.blocks_for(len(seq.tokens))
        if seq.params.beam_width > 1:  # each beam grows to the longest length, a branching one copies a block
            return seq.params.beam_width * (max(0, self.kv.blocks_for(longest) - held) + 1)
        return max(0, self.kv.blocks_for(longest) - held)

    def add(self, seq: Sequence) -> None:
        """Blocks for the whole context (prompt, plus output when resuming a paused request)."""
        with self.lock:
            self.kv.add_sequence(seq.table, seq.tokens, reuse=not seq.wants_context,
                                 root=self.kv.reuse_root(seq.params.lora_task_id))

    def release(self, seq: Sequence) -> None:
        with self.lock:
            self.kv.release(seq.table)
            if self.lora is not None:
                self.lora.done(seq)

    def needs_block(self, seq: Sequence, n: int) -> bool:
        """Whether feeding `n` more tokens (and the draft riding on them) crosses into a block
        `seq` does not hold yet."""
        return seq.table.length + n + len(seq.riders(n)) > len(seq.table.blocks) * self.kv.tokens_per_block

    # -- one iteration -------------------------------------------------------------

    def step(self, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
        """One forward over `batch` (sequence, tokens to feed) and one sampled token for each
        sequence whose fed tokens reach its end; returns the tokens each emits.

        Raises if the forward fails; no table has advanced then, so the caller may
        retry any subset."""
        with self.lock:
            chunks, drafts, fulls = [], [], []
            medusa = self.medusa
            for seq, n in batch:
                start = seq.table.length
                last = n == seq.pending
                draft = seq.riders(n)
                tree = medusa.parents if draft and medusa is not None and not seq.in_context else None
                every = tree is not None or (seq.wants_context and start < len(seq.prompt))
                self.kv.reserve(seq.table, start + n + len(draft))
                chunks.append(Chunk(seq.table, seq.tokens[start:start + n] + draft,
                                    logits=n + len(draft) if every else 1 + len(draft) if last else 0,
                                    parents=[-1, *tree] if tree is not None else None,
                                    want_hidden=medusa is not None and last, want_states=bool(self.mtp_draft_len),
                                    lora=seq.params.lora_task_id, want_argmax=last and not draft and not every
                                    and seq.sampler.picks_argmax(len(seq.output))))
                drafts.append(draft)
                fulls.append(every and tree is None)  # a context chunk run with every position's logits
            with torch.no_grad():
                logits = self.model.forward(chunks, self.kv)
            emitted, commits = [], []
            for (seq, n), rows, draft, chunk, full in zip(batch, logits, drafts, chunks, fulls, strict=False):
                length = seq.table.length + n
                path: list[int] = []
                tokens: list[int] = []
                seq.picked = []
                try:
                    if rows is not None and full:
                        rows = self._context_rows(seq, rows, n)
                    if rows is None:
                        tokens = []
                    elif chunk.parents is not None and medusa is not None:
                        tokens, path = medusa.verify(seq, rows)
                    elif draft:
                        tokens = seq.verify(rows, draft)
                        if seq.draft:
                            seq.draft = []
                        else:  # the MTP layer's draft (a Medusa tree takes the branch above)
                            seq.drafted += len(draft)
                            seq.tree = []
                    else:
                        tokens = seq.accept(rows[0], chunk.argmax)
                    if seq.generation_logits is not None and tokens and rows is not None:
                        seq.generation_logits.append(_emitted_rows(rows, path, chunk.parents is not None, len(tokens)))
                    if seq.logprobs is not None and seq.params.logprobs is not None and tokens and rows is not None:
                        seq.logprobs.add_tokens(_emitted_rows(rows, path, chunk.parents is not None, len(tokens)),
                                                tokens, seq.picked)
                    if medusa is not None and rows is not None and not seq.finished and chunk.hidden is not None:
                        with torch.no_grad():
                            hidden = chunk.hidden[path[-1] if path else 0 if chunk.parents is not None else -1]
                            seq.tree = medusa.propose(self.model.medusa_logits(hidden[None]))
                except Exception as err:  # one request's sampling failure must not cost the others their step
                    seq.finish("error")
                    seq.error = f"sampling failed: {err}"
                    tokens = []
                if path:
                    # Accepted tree nodes move to the positions after the root; the rest stay beyond the length.
                    self.kv.move(seq.table, [length + node - 1 for node in path], range(length, length + len(path)))
                    accepted = len(path)
                else:
                    # Accepted draft tokens keep their K/V; a rejected one's are left beyond the length.
                    accepted = max(0, min(len(tokens) - 1, len(draft))) if chunk.parents is None else 0
                commits.append((seq, n, length + accepted, rows is not None))
                emitted.append(tokens)
            if self.mtp_draft_len:
                self._mtp_drafts(commits, chunks)
            for seq, _n, end, _sampled in commits:
                self.kv.commit(seq.table, seq.tokens, end)
            return emitted

    @staticmethod
    def _context_rows(seq: Sequence, rows: torch.Tensor, n: int) -> torch.Tensor | None:
        """Record the prompt positions' logits of a chunk run with every position's logits (logprobs.py);
        returns the rows sampling uses: those from the chunk's last fed token on, None short of the end."""
        if seq.logprobs is not None:
            seq.logprobs.add_context(rows[:n], seq.table.length, seq.prompt)
        return rows[n - 1:] if n == seq.pending else None

    def _mtp_drafts(self, commits: list[tuple[Sequence, int, int, bool]], chunks: list[Chunk]) -> None:
        """The MTP layer (mtp.py) over every position of the step whose next token is known now, writing its cache
        there, and each sequence that sampled and goes on drafts its next token from the last (greedy). Before the
        commits: the tables' lengths are still where the step's tokens start. A failure here costs the drafts only."""
        runs: list[Chunk] = []
        drafting: list[Sequence | None] = []
        for (seq, n, end, sampled), chunk in zip(commits, chunks, strict=True):
            start = seq.table.length
            m = positions_known(start, n, end - start - n, len(seq.tokens))
            if m and chunk.states is not None:
                want = sampled and not seq.finished
                runs.append(Chunk(seq.table, seq.tokens[start + 1:start + 1 + m], logits=int(want),
                                  states=chunk.states[:m]))
                drafting.append(seq if want else None)
        if not runs or not isinstance(self.model, Model):  # rank processes are refused an MTP layer (load)
            return
        try:
            with torch.no_grad():
                rows = self.model.mtp_forward(runs, self.kv)
        except Exception:  # the output is the target's either way; the next steps run without a draft
            log.exception("the MTP layer's forward failed; continuing without drafts")
            return
        for drafter, row in zip(drafting, rows, strict=True):
            if drafter is not None and row is not None:
                drafter.tree = [int(row[-1].argmax())]

    # -- synchronous entry points ---------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 logprobs: TokenLogprobs | None = None) -> list[int]:
        """New tokens only, for one request, run to completion (`logprobs` as for `start`)."""
        seq = self.start(prompt_ids, params, logprobs=logprobs)
        with self.lock:
            if self.blocks_to_add(seq) + self.blocks_to_finish(seq) > self.kv.free_blocks:
                self.release(seq)
                raise ToolchainError("the KV cache has no room for this request now", "retry later")
            self.add(seq)
            try:
                while not seq.finished:
                    self.step([(seq, seq.pending)])
            finally:
                self.release(seq)
        if seq.error is not None:
            raise RuntimeError(seq.error)
        return seq.output

    def forward_logits(self, input_ids: list[int], lora_task_id: int | None = None) -> torch.Tensor:
        """Logits [T, vocab_size] (float32) for every position of `input_ids` (under that LoRA adapter)."""
        problem = self._ids_problem(input_ids) or lora_request_problem(self.lora, lora_task_id)
        if problem is not None:
            raise ToolchainError(problem)
        if len(input_ids) > self.limits.max_seq_len:
            raise ToolchainError(f"{len(input_ids)} tokens exceed the engine's max_seq_len {self.limits.max_seq_len}")
        ids = [int(t) for t in input_ids]
        table = BlockTable()
        with self.lock:
            self.kv.add_sequence(table, ids, reuse=False)
            try:
                with torch.no_grad():
                    logits = self.model.forward([Chunk(table, ids, logits=len(ids), lora=lora_task_id)], self.kv)[0]
                if logits is None:
                    raise RuntimeError("the forward pass returned no logits")
                return logits
            finally:
                self.kv.release(table)
