"""Beam search on the CPU engine (`beam_width` W > 1; the request rules and `BeamResult` are in beams.py).

`start_sequence` gives a beam request a `BeamSequence`, which `step_with_beams` steps beside the others (the
batcher calls both for every request). Each step feeds every running beam's last token (one KV block table per beam: a beam that branches off another shares its full blocks and
copies the partly filled last one, KvCacheManager.fork), scores the 2W best continuations over all beams by
cumulative log-probability (log_softmax of the logits after temperature and, below min_tokens, the end_id's
mask: TRT-LLM masks logits before the softmax, HF's processor masks the log-probs after it),
keeps the W best that did not end as the running beams, and admits those ending on end_id, or at
max_new_tokens, among the top W as finished hypotheses scored cum_log_prob / length ** length_penalty (length
counts the generated tokens, the end token included). It stops when W hypotheses have finished
(early_stopping 1) or, with early_stopping 0, also once the best running beam's cum_log_prob / length **
length_penalty cannot beat the worst finished one; the results are the min(num_return_sequences, W) best
hypotheses by score, best first (`BeamResult`). This is the beam search of TensorRT-LLM's beamSearchKernels
(ported from the Hugging Face BeamHypotheses) as transformers 5.25 implements it (generation/utils.py
_beam_search, _update_finished_beams, _check_early_stop_heuristic), which the tests compare against; top-k,
top-p and seeds do not apply. Not with speculative decoding, stop words or generation logits (refused), and
only under guaranteed_no_evict: a beam request reserves W beams' blocks to completion and is never paused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from toolchain.engine.cpu.beams import BeamResult, children
from toolchain.engine.cpu.logprobs import TokenLogprobs
from toolchain.engine.cpu.engine import CpuEngine, Sequence
from toolchain.engine.cpu.kv_cache import BlockTable
from toolchain.engine.cpu.model import Chunk
from toolchain.engine.cpu.sampling import SamplingParams
from toolchain.errors import ToolchainError


@dataclass
class _Beam:
    table: BlockTable
    tokens: list[int]
    cum: float = 0.0
    log_probs: list[float] = field(default_factory=list)


class BeamSequence(Sequence):
    """A beam-search request. To the batcher it is one sequence: its context runs on `table`; from the first
    generated token on, `table` and `output` are the leading running beam's, so it feeds one token per step
    like any other, while `step_with_beams` feeds every beam."""

    def __init__(self, engine: CpuEngine, prompt: list[int], params: SamplingParams):
        super().__init__(prompt, params)
        self.engine = engine
        self.width = params.beam_width
        self.running: list[_Beam] = []
        self.hypotheses: list[BeamResult] = []  # finished, best first, at most `width`
        self.improvable = True  # HF's is_early_stop_heuristic_unsatisfied
        # A list the caller owns (InflightBatcher.submit's beam_results): filled with the returned
        # sequences before the final callback.
        self.results: list[BeamResult] | None = None
        self.beam_results: list[BeamResult] = []

    def finish(self, reason: str) -> None:
        """Also hands back every beam's blocks but `table`'s, which the engine releases as any sequence's."""
        super().finish(reason)
        kv = self.engine.kv
        with self.engine.lock:
            for beam in self.running:
                if beam.table is not self.table:
                    kv.release(beam.table)
            self.running = []

    # -- one step ------------------------------------------------------------------

    def chunks(self, n: int) -> list[Chunk]:
        """The chunks of this step: `n` context tokens, or each running beam's last token."""
        kv = self.engine.kv
        if self.in_context:
            start = self.table.length
            kv.reserve(self.table, start + n)
            return [Chunk(self.table, self.tokens[start:start + n], logits=1 if n == self.pending else 0,
                          lora=self.params.lora_task_id)]
        out = []
        for beam in self.running:
            start = beam.table.length
            kv.reserve(beam.table, start + 1)
            out.append(Chunk(beam.table, [(self.prompt + beam.tokens)[start]], lora=self.params.lora_task_id))
        return out

    def advance(self, chunks: list[Chunk], rows: list[torch.Tensor | None]) -> list[int]:
        """Commit the step's K/V and, when logits came back, choose the next beams; returns the tokens to emit
        (the best sequence's, once the search ends)."""
        kv = self.engine.kv
        if self.in_context:
            end = self.table.length + len(chunks[0].tokens)
            kv.commit(self.table, self.tokens, end)
            if rows[0] is None:
                return []
            self.running = [_Beam(self.table, [])]
        else:
            for beam, chunk in zip(self.running, chunks, strict=True):
                kv.commit(beam.table, self.prompt + beam.tokens, beam.table.length + len(chunk.tokens))
        logits = torch.stack([r[-1] for r in rows if r is not None]).float()
        self._select(logits)
        if self.running and self.improvable and not (len(self.hypotheses) == self.width
                                                     and self.params.early_stopping == 1):
            self.output = self.running[0].tokens
            return []
        return self._conclude()

    def _log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        p = self.params
        if 0 < p.temperature != 1:  # UNVERIFIED: TRT-LLM applies temperature before beam search as before sampling
            logits = logits / p.temperature
        if 0 <= p.end_id and len(self.running[0].tokens) < p.min_tokens:
            logits = logits.clone()
            logits[:, p.end_id] = float("-inf")
        return torch.log_softmax(logits, dim=-1)

    def _select(self, logits: torch.Tensor) -> None:
        """One step of the search over the running beams' last logits [beams, V] (HF's _get_top_k_continuations,
        _get_running_beams_for_next_iteration and _update_finished_beams)."""
        p, width = self.params, self.width
        log_probs = self._log_probs(logits)
        vocab = log_probs.shape[-1]
        cum = torch.tensor([b.cum for b in self.running], dtype=torch.float32)
        scores = (log_probs + cum[:, None]).reshape(-1)
        top, index = torch.topk(scores, min(2 * width, scores.numel()))
        length = len(self.running[0].tokens) + 1  # every running beam has as many tokens
        at_limit = length >= p.max_new_tokens
        full = len(self.hypotheses) == width and p.early_stopping == 1
        admit = self.improvable and not full
        nxt: list[tuple[_Beam, int, float, float]] = []
        for rank, (total, flat) in enumerate(zip(top.tolist(), index.tolist(), strict=True)):
            parent, token = self.running[flat // vocab], flat % vocab
            logp = float(log_probs[flat // vocab, token])
            ends = token == p.end_id and p.end_id >= 0
            if ends or at_limit:
                if rank < width and admit:  # only the top W candidates may finish
                    kept = parent.tokens + ([] if ends else [token])
                    self.hypotheses.append(BeamResult(kept, "end_id" if ends else "length", total,
                                                      total / length ** p.length_penalty,
                                                      parent.log_probs + ([] if ends else [logp])))
            elif len(nxt) < width:
                nxt.append((parent, token, total, logp))
        self.hypotheses.sort(key=lambda h: -(h.score or 0.0))
        del self.hypotheses[width:]
        self._branch(nxt)
        if self.running and len(self.hypotheses) == width:
            # HF's _check_early_stop_heuristic: could the best running beam, scored at its current length,
            # still beat the worst finished one? Once not, nothing more is admitted and the search ends.
            best = self.running[0]
            self.improvable = best.cum / len(best.tokens) ** p.length_penalty > (self.hypotheses[-1].score or 0.0)

    def _branch(self, chosen: list[tuple[_Beam, int, float, float]]) -> None:
        """The next running beams: the first child of a beam takes over its table, the others fork it; the
        beams left without a child give their blocks back. `table` becomes the leading beam's."""
        kv = self.engine.kv
        taken: set[int] = set()
        running: list[_Beam] = []
        forks: list[BlockTable] = []
        try:
            for parent, token, total, logp in chosen:
                if id(parent) in taken:
                    table = kv.fork(parent.table)
                    forks.append(table)
                else:
                    taken.add(id(parent))
                    table = parent.table
                running.append(_Beam(table, parent.tokens + [token], total, parent.log_probs + [logp]))
        except Exception:  # no block for a fork (the reservation should prevent it): undo the others
            for table in forks:
                kv.release(table)
            raise
        for beam in self.running:
            if id(beam) not in taken:
                kv.release(beam.table)
        self.running = running
        self.table = running[0].table if running else BlockTable()

    def _conclude(self) -> list[int]:
        n = self.params.num_return_sequences
        self.beam_results = self.hypotheses[:n] or [BeamResult(b.tokens, "length", b.cum) for b in self.running[:n]]
        if self.results is not None:
            self.results.extend(self.beam_results)
        best = self.beam_results[0]
        self.output = list(best.tokens)
        self.finish(best.reason)
        return list(best.tokens)


def start_sequence(engine: CpuEngine, prompt_ids: list[int], params: SamplingParams, draft=(), draft_logits=None,
                   acceptance_threshold: float | None = None, logprobs: TokenLogprobs | None = None) -> Sequence:
    """CpuEngine.start, a beam search's included (a BeamSequence: its beams carry their own cumulative
    log-probs, so a log-prob record is refused there)."""
    if params.beam_width == 1:
        return engine.start(prompt_ids, params, draft, draft_logits, acceptance_threshold, logprobs=logprobs)
    if logprobs is not None:
        raise ToolchainError("a log-prob record with beam search (beam_width > 1): the beams' log-probs come "
                             "with their BeamResult")
    problem = engine.request_problem(prompt_ids, params, draft, draft_logits)
    if problem is not None:
        raise ToolchainError(problem)
    seq = BeamSequence(engine, prompt_ids, params)
    engine.hold_lora(seq)
    return seq


def step_with_beams(engine: CpuEngine, batch: list[tuple[Sequence, int]]) -> list[list[int]]:
    """CpuEngine.step for a batch that may hold beam searches: the other sequences step first (a failure
    there raises before any table advanced), then one forward over every beam's chunk; a failure there
    finishes the beam searches with the error."""
    if not any(isinstance(seq, BeamSequence) for seq, _ in batch):
        return engine.step(batch)
    plain = [(i, item) for i, item in enumerate(batch) if not isinstance(item[0], BeamSequence)]
    out: list[list[int]] = [[] for _ in batch]
    for (i, _), tokens in zip(plain, engine.step([item for _, item in plain]) if plain else [], strict=True):
        out[i] = tokens
    beams = [(i, seq, n) for i, (seq, n) in enumerate(batch) if isinstance(seq, BeamSequence)]
    with engine.lock:
        try:
            parts = [(i, seq, seq.chunks(n)) for i, seq, n in beams]
            chunks = [c for _, _, cs in parts for c in cs]
            with torch.no_grad():
                rows = engine.model.forward(chunks, engine.kv)
        except Exception as err:
            for _, seq, _ in beams:
                seq.error = f"beam search step failed: {type(err).__name__}: {err}"
                seq.finish("error")
            return out
        at = 0
        for i, seq, cs in parts:
            mine, at = rows[at:at + len(cs)], at + len(cs)
            try:
                out[i] = seq.advance(cs, mine)
            except Exception as err:  # one request's failure must not cost the others their step
                seq.error = f"beam search failed: {type(err).__name__}: {err}"
                seq.finish("error")
    return out


def generate_sequences(engine: CpuEngine, prompt_ids: list[int], params: SamplingParams) -> list[BeamResult]:
    """Every sequence one request returns, each run to completion on its own: the best beams of a beam search,
    or each sampled child's tokens and finish reason (no scores; `children`)."""
    results = []
    for child in children(params):
        seq = start_sequence(engine, prompt_ids, child)
        with engine.lock:
            if engine.blocks_to_add(seq) + engine.blocks_to_finish(seq) > engine.kv.free_blocks:
                engine.release(seq)
                raise RuntimeError("the KV cache has no room for this request now; retry later")
            engine.add(seq)
            try:
                while not seq.finished:
                    step_with_beams(engine, [(seq, seq.pending)])
            finally:
                engine.release(seq)
        if seq.error is not None:
            raise RuntimeError(seq.error)
        if isinstance(seq, BeamSequence):
            return seq.beam_results
        results.append(BeamResult(seq.output, seq.reason or "length"))
    return results
