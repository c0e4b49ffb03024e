"""The CPU engine's ranks as separate processes, computing together as TensorRT-LLM's leader mode does.

Under `mpirun` (serving.launch: mpirun) every rank is its own tritonserver and its `tensorrt_llm`
model loads only its own shard: rank = pp_rank * tp + tp_rank, TensorRT-LLM's Mapping. The ranks meet
in torch.distributed over gloo (TCP; the launcher passes the rendezvous address in TOOLCHAIN_RANKS_ADDR)
and run the same `Model.forward`, which calls this module where a single process would loop over the
shards: the row-parallel sums and column-parallel gathers inside a pipeline stage, the hidden states
from one stage to the next, and the logits from the last stage back to the leader.

Rank 0 is the leader, as in TensorRT-LLM: it alone receives requests and owns the scheduler, the KV
block tables and sampling. Before each forward it broadcasts the step (each chunk's tokens, block
table and length, plus the K/V copies the block manager made since the previous step, so every rank's
pool holds the same blocks); the other ranks loop on those broadcasts. Sums are gathered and added in
rank order, the order of the single-process loop, so greedy output is the same token for token.

A rank that dies breaks the group for good (collectives cannot be re-formed without every rank): the
survivors' next collective fails, their in-flight requests end with an error naming the lost peer, and
the model process exits so the launcher sees a dead instance and stops every rank.
"""

from __future__ import annotations

import sys
import threading
import time

import torch

from toolchain.engine.cpu.comm import Comm, RankLost, abort_soon, num_blocks
from toolchain.engine.cpu.config import read_engine_config
from toolchain.engine.cpu.threads import on_passing_thread
from toolchain.engine.cpu.weights import load_own_stage
# The rendered tensorrt_llm model.py (copied verbatim into every repository, so it cannot change) reaches
# the rendezvous through this module: ranks.launched_world() and ranks.ADDR_ENV, which moved to comm.py.
from toolchain.engine.cpu.comm import ADDR_ENV, launched_world  # noqa: F401
from toolchain.engine.cpu.kv_cache import BlockTable, KvCacheConfig, KvCacheManager, capped, pool_reserve_bytes
from toolchain.engine.cpu.model import Chunk, Model


class LeaderModel:
    """The leader's model: broadcasts each step, then runs its own part of it."""

    def __init__(self, model, comm: Comm, kv: KvCacheManager):
        self.model, self.comm, self.d = model, comm, model.d
        kv.copy_log = []  # K/V copies since the last step, replayed by the workers
        self.copies_sent = 0
        self._stop = threading.Event()
        threading.Thread(target=comm.keepalive, args=(self._stop,), name="ranks-keepalive", daemon=True).start()

    def forward(self, chunks, kv: KvCacheManager):
        if any(c.parents is not None or c.want_hidden for c in chunks):
            raise RuntimeError("Medusa trees are not run across rank processes")
        copies, kv.copy_log = kv.copy_log or [], []
        self.copies_sent += len(copies)
        step = {"kind": "step",
                "chunks": [[list(c.table.blocks), c.table.length, list(c.tokens), c.logits] for c in chunks],
                "copies": [[src.tolist(), dst.tolist()] for src, dst in copies]}
        with self.comm._lock:  # the broadcast and the forward's collectives as one unit against keep-alives
            try:
                self.comm._broadcast(step)
                self.comm._last_sent = time.monotonic()
                return self.model.forward(chunks, kv)
            except RankLost:
                abort_soon(self.comm.lost or "a peer rank is gone")
                raise

    def medusa_logits(self, h: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("Medusa trees are not run across rank processes")

    def close(self) -> None:
        self._stop.set()
        self.comm.close()


def worker_loop(model, comm: Comm, kv: KvCacheManager) -> None:
    """A rank other than 0: run each step the leader broadcasts until it says stop."""
    while True:
        try:
            message = comm._broadcast(None)
        except RankLost:
            abort_soon(comm.lost or "lost the leader")
            return
        if message["kind"] == "stop":
            return
        if message["kind"] != "step":
            continue
        for src, dst in message["copies"]:
            kv.copy_pool(torch.tensor(src, dtype=torch.int64), torch.tensor(dst, dtype=torch.int64))
        chunks = []
        for blocks, length, tokens, logits in message["chunks"]:
            table = BlockTable()
            table.blocks, table.length = blocks, length
            chunks.append(Chunk(table, tokens, logits=logits))
        try:
            with torch.no_grad():
                model.forward(chunks, kv)
        except RankLost:
            abort_soon(comm.lost or "a peer rank is gone")
            return
        except Exception as err:
            # The leader hit the same check on the same step (the input is identical), so the group
            # is still in step; say it here too and carry on.
            print(f"tensorrt_llm: rank {comm.rank}: step failed: {type(err).__name__}: {err}", file=sys.stderr)


def load_worker(engine_dir, comm: Comm):
    """A rank other than 0: its own shard and a pool the size of the leader's, ready for worker_loop on another
    thread; loaded on a passing thread, so the caller's keeps no OpenMP pool (threads.py)."""
    return on_passing_thread(_load_worker, engine_dir, comm)


def _load_worker(engine_dir, comm: Comm):
    _, dims, limits = read_engine_config(engine_dir)
    # The leader sizes the pool after every rank has loaded (num_blocks); until then a rank leaves room for the
    # default one (CpuEngine.load's rule) beside its weights.
    default = capped(KvCacheConfig(), limits.max_batch_size, limits.max_seq_len)
    model = Model(dims, load_own_stage(engine_dir, dims, comm.rank, pool_reserve_bytes(dims, default)), comm)
    return model, KvCacheManager(dims, num_blocks(comm, None), limits.tokens_per_block, enable_block_reuse=False)


def run_worker(engine_dir, comm: Comm) -> None:
    """A rank other than 0, start to end: follow the leader's steps until it stops."""
    model, kv = load_worker(engine_dir, comm)
    worker_loop(model, comm, kv)
    comm.close()
