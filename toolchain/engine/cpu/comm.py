"""The ranks' transport: this rank's place in a torch.distributed group over gloo and the collectives
the CPU engine's forward pass needs (row-parallel sums, column-parallel gathers, stage-to-stage hidden
states, the leader's step broadcasts), and what happens when a peer is lost. ranks.py runs the leader and
worker loops over it; model.py calls it where one process would loop over the shards.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from toolchain.engine.cpu.kv_cache import KvCacheManager
from toolchain.errors import ToolchainError

ADDR_ENV = "TOOLCHAIN_RANKS_ADDR"  # host:port of rank 0's rendezvous store, set by the launcher
# A collective waits at most this long; the leader's keep-alive (below) keeps idle workers inside it.
OP_TIMEOUT = datetime.timedelta(minutes=10)
KEEPALIVE_S = 30.0
ABORT_GRACE_S = 1.0  # after a lost rank: time for the error responses to leave before the process exits


def launched_world() -> tuple[int, int] | None:
    """(rank, world size) when this process descends from an mpirun rank of a job with more than one
    rank (Open MPI's variables, inherited by tritonserver's Python stubs); None otherwise."""
    size = os.environ.get("OMPI_COMM_WORLD_SIZE")
    rank = os.environ.get("OMPI_COMM_WORLD_RANK")
    if size is None or rank is None or int(size) <= 1:
        return None
    return int(rank), int(size)


class RankLost(RuntimeError):
    """A collective failed: a peer rank is gone and the group cannot compute any more."""


class Comm:
    """This rank's place in the group and the collectives the forward pass needs."""

    def __init__(self, rank: int, world: int, tp: int, pp: int, addr: str):
        if world != tp * pp:
            raise ToolchainError(f"mpirun started {world} ranks but the engine is tp {tp} x pp {pp} = {tp * pp}",
                                 "launch one rank per engine rank (toolchain serve does), or rebuild the engine")
        self.rank, self.world, self.tp, self.pp = rank, world, tp, pp
        self.pp_rank, self.tp_rank = divmod(rank, tp)
        self.lost: str | None = None
        self._lock = threading.Lock()  # the leader's step broadcasts and keep-alives never interleave
        self._last_sent = time.monotonic()
        # The ranks of this one's pipeline stage, in TP order.
        self.stage_ranks = [self.pp_rank * tp + t for t in range(tp)]
        try:
            dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=world,
                                    timeout=OP_TIMEOUT)
        except Exception as err:
            raise ToolchainError(f"rank {rank} of {world} could not join the other ranks at {addr}: {err}",
                                 "check that every rank was started by the same mpirun") from None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _guard(self, what: str, op, *args, **kwargs):
        if self.lost is not None:
            raise RankLost(self.lost)
        try:
            return op(*args, **kwargs)
        except Exception as err:
            self.lost = f"rank {self.rank}: {what} failed, a peer rank is gone ({_first_sentence(err)})"
            raise RankLost(self.lost) from None

    # -- inside a stage -------------------------------------------------------------------------------

    def _gather(self, part: torch.Tensor, what: str) -> list[torch.Tensor]:
        """Every stage rank's `part`, in TP order. Point-to-point rather than gloo's all_gather: each
        message between two ranks costs one loopback send, where gloo's collectives measured 0.5-1 ms
        on this host against 0.14 ms for an exchange of sends (benchmarks/README.md, distributed.py)."""
        part = part.contiguous()
        return self._guard(what, self._exchange, part)

    def _exchange(self, part: torch.Tensor) -> list[torch.Tensor]:
        sends = [dist.isend(part, dst=r) for r in self.stage_ranks if r != self.rank]
        parts = []
        for r in self.stage_ranks:
            if r == self.rank:
                parts.append(part)
            else:
                got = torch.empty_like(part)
                dist.recv(got, src=r)
                parts.append(got)
        for send in sends:
            if send is not None:
                send.wait()
        return parts

    def tp_sum(self, part: torch.Tensor) -> torch.Tensor:
        """The all-reduce of a row-parallel output, added in rank order like the single-process loop."""
        if self.tp == 1:
            return part
        parts = self._gather(part, "all-reduce")
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def tp_cat(self, part: torch.Tensor) -> torch.Tensor:
        """The all-gather of a column-parallel output along its last dimension."""
        return part if self.tp == 1 else torch.cat(self._gather(part, "all-gather"), dim=-1)

    # -- between stages -------------------------------------------------------------------------------

    def send_hidden(self, x: torch.Tensor) -> None:
        self._guard("send to the next stage", dist.send, x.contiguous(), dst=self.rank + self.tp)

    def recv_hidden(self, rows: int, width: int) -> torch.Tensor:
        x = torch.empty(rows, width)
        self._guard("receive from the previous stage", dist.recv, x, src=self.rank - self.tp)
        return x

    def logits_to_leader(self, logits: torch.Tensor | None, rows: int, width: int) -> torch.Tensor | None:
        """The last stage's logits at the leader: the last stage's first TP rank sends them when the
        leader sits in an earlier stage. Returns them on the leader and on last-stage ranks."""
        sender = (self.pp - 1) * self.tp
        if self.pp == 1 or rows == 0:
            return logits
        if self.rank == sender and logits is not None:
            self._guard("send logits to rank 0", dist.send, logits.contiguous(), dst=0)
        elif self.leader:
            logits = torch.empty(rows, width)
            self._guard(f"receive logits from rank {sender}", dist.recv, logits, src=sender)
        return logits

    # -- the step broadcast ---------------------------------------------------------------------------

    def _broadcast(self, message: Any) -> Any:
        """The leader's `message` (JSON: lists, numbers, strings) at every rank (the leader passes it, the
        others None): its length, then its bytes, sent to each rank point-to-point (see _gather)."""
        return self._guard("step broadcast", self._send_to_all if self.leader else self._recv_from_leader, message)

    def _send_to_all(self, message: Any) -> Any:
        payload = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        sends = [dist.isend(t, dst=r) for r in range(1, self.world) for t in (size, payload)]
        for send in sends:
            if send is not None:
                send.wait()
        return message

    def _recv_from_leader(self, _: Any) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=0)
        payload = torch.empty(int(size[0]), dtype=torch.uint8)
        dist.recv(payload, src=0)
        return json.loads(payload.numpy().tobytes())

    def send_step(self, message: Any) -> None:
        with self._lock:
            self._broadcast(message)
            self._last_sent = time.monotonic()

    def keepalive(self, stop: threading.Event) -> None:
        """Leader: a no-op step whenever the group has been idle for KEEPALIVE_S, so idle workers'
        waits stay inside OP_TIMEOUT and a dead worker is noticed while no request runs."""
        while not stop.wait(KEEPALIVE_S / 3):
            if time.monotonic() - self._last_sent >= KEEPALIVE_S:
                try:
                    self.send_step({"kind": "noop"})
                except RankLost:
                    abort_soon(self.lost or "a peer rank is gone")
                    return

    def close(self) -> None:
        """Leave the group; the leader first tells the workers to leave their loop (best effort: some
        may already be gone). Without it gloo's threads meet the interpreter's exit and abort it."""
        if self.leader and self.lost is None:
            try:
                self.send_step({"kind": "stop"})
            except RankLost:
                pass
        if self.lost is None and dist.is_initialized():
            dist.destroy_process_group()


def _first_sentence(err: Exception) -> str:
    """gloo's message without its source location and advice: "Connection closed by peer [addr]:port"."""
    text = str(err).split("\n")[0]
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # "[.../gloo/transport/tcp/pair.cc:553] "
    return text.split(". ")[0].rstrip(".") or type(err).__name__


def abort_soon(reason: str) -> None:
    """Exit this process shortly, as MPI_Abort would end a TensorRT-LLM rank: the group is broken and
    the launcher, seeing the instance gone, stops every rank and reports it."""
    print(f"tensorrt_llm: {reason}; this rank exits", file=sys.stderr, flush=True)
    threading.Timer(ABORT_GRACE_S, os._exit, args=(1,)).start()


def num_blocks(comm: Comm, kv: KvCacheManager | None) -> int:
    """The leader's KV pool size at every rank (slots in the steps index into the same pool shape)."""
    return comm._broadcast(kv.num_blocks if comm.leader and kv is not None else None)
