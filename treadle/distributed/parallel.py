"""ParallelContext: where one worker sits in the T x P grid and the collectives a step uses.

Built once per worker (``ParallelContext.create`` after ``init_process_group``, or
``ParallelContext.single()`` for one rank, where every collective is a no-op) and handed to
the model and the runner explicitly. Every group is created with a timeout, so a collective
whose peer is gone raises instead of hanging (the executor also notices the dead process).

    all_reduce(x)            sum over the tensor-parallel group (row-parallel outputs, embedding)
    all_reduce_async(x)      the same, returning a handle to ``wait()`` on (overlap)
    gather_logits(part)      [n, V/T] per rank -> [n, V] on the sampling rank, None elsewhere
    broadcast_tokens(t, n)   the sampled tokens, from the sampling rank to every rank
    send_carry / recv_carry  (hidden, residual) from a stage to the same TP rank of the next
"""
from __future__ import annotations

from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist


class StageCarry(NamedTuple):
    hidden: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]


class _Done:
    """The handle of a collective that had nothing to do."""

    def wait(self) -> bool:
        return True


class ParallelContext:
    def __init__(self, tp: int, pp: int, rank: int, vocab_size: int, tp_group: Any = None, world_group: Any = None,
                 skip_collectives: bool = False, device: torch.device | str = "cpu",
                 expert_parallel: bool = False) -> None:
        self.tp_size, self.pp_size, self.rank = tp, pp, rank
        self.tp_rank, self.pp_rank = rank % tp, rank // tp
        self.world_size = tp * pp
        self.vocab_size = vocab_size  # the full vocabulary (gathered logits are cut to it)
        self.tp_group, self.world_group = tp_group, world_group
        self.skip_collectives = skip_collectives  # benchmarks only: measure compute without comm
        self.device = torch.device(device)  # where collective buffers live (NCCL: the rank's GPU)
        self.expert_parallel = expert_parallel  # MoE: the TP ranks split the experts, not each expert

    @staticmethod
    def single(vocab_size: int) -> ParallelContext:
        return ParallelContext(1, 1, 0, vocab_size)

    @staticmethod
    def create(tp: int, pp: int, rank: int, vocab_size: int, timeout_s: float,
               device: torch.device | str = "cpu", expert_parallel: bool = False) -> ParallelContext:
        """Make the groups (every rank must call this, in the same order) after the default
        group is initialized; ``timeout_s`` bounds every collective on them."""
        timeout = timedelta(seconds=timeout_s)
        world = dist.new_group(list(range(tp * pp)), timeout=timeout)
        tp_group = None
        for stage in range(pp):
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), timeout=timeout)
            if stage == rank // tp:
                tp_group = group
        return ParallelContext(tp, pp, rank, vocab_size, tp_group, world, device=device, expert_parallel=expert_parallel)

    # -- where this rank sits -----------------------------------------------------------
    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def sampling_rank(self) -> int:
        return self.world_size - 1

    @property
    def is_sampling_rank(self) -> bool:
        return self.rank == self.sampling_rank

    # -- tensor parallel ----------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1 and not self.skip_collectives:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def all_reduce_async(self, x: torch.Tensor) -> Any:
        if self.tp_size == 1 or self.skip_collectives:
            return _Done()
        return dist.all_reduce(x, group=self.tp_group, async_op=True)

    def gather_logits(self, part: torch.Tensor) -> torch.Tensor | None:
        """part [n, V/T] float32 on every rank of the last stage -> [n, V] on the sampling
        rank (rank order = vocabulary order), None on the others."""
        if self.tp_size == 1:
            return part[:, : self.vocab_size]
        dst = self.sampling_rank
        parts = [torch.empty_like(part) for _ in range(self.tp_size)] if self.is_sampling_rank else None
        if not self.skip_collectives:
            dist.gather(part.contiguous(), parts, dst=dst, group=self.tp_group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, : self.vocab_size]

    # -- every rank -----------------------------------------------------------------------
    def broadcast_tokens(self, tokens: list[int] | None, n: int) -> list[int]:
        """The sampling rank's ``n`` tokens on every rank (the others pass None)."""
        if self.world_size == 1:
            assert tokens is not None
            return tokens
        buf = (torch.tensor(tokens, dtype=torch.int64, device=self.device) if tokens is not None
               else torch.empty(n, dtype=torch.int64, device=self.device))
        dist.broadcast(buf, src=self.sampling_rank, group=self.world_group)
        return buf.tolist()

    # -- pipeline -----------------------------------------------------------------------
    def send_carry(self, carry: StageCarry) -> None:
        peer = self.rank + self.tp_size
        dist.send(carry.hidden.contiguous(), dst=peer, group=self.world_group)
        dist.send(carry.residual.contiguous(), dst=peer, group=self.world_group)

    def recv_carry(self, num_tokens: int, hidden_size: int, dtype: torch.dtype, device: torch.device) -> StageCarry:
        peer = self.rank - self.tp_size
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=device)
        residual = torch.empty_like(hidden)
        dist.recv(hidden, src=peer, group=self.world_group)
        dist.recv(residual, src=peer, group=self.world_group)
        return StageCarry(hidden, residual)
