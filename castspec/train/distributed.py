"""Training on several processes with torch.distributed (launched by `torchrun`).

torchrun starts one process per rank and tells each its place through the environment (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT); `join()` turns that into a process group. The trainer reads the group through
`Ranks.current()`, so `train()` is the same function on one process and on many: without a group it is
rank 0 of 1 and nothing here does anything.
"""
from __future__ import annotations

import os
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Ranks:
    rank: int = 0
    world: int = 1

    @staticmethod
    def current() -> "Ranks":
        if dist.is_available() and dist.is_initialized():
            return Ranks(dist.get_rank(), dist.get_world_size())
        return Ranks()

    @property
    def main(self) -> bool:
        """The rank that writes files (checkpoints, exports, reports)."""
        return self.rank == 0

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """DistributedDataParallel over the group (averages gradients across ranks in backward)."""
        if self.world == 1:
            return module
        from torch.nn.parallel import DistributedDataParallel

        # the only buffers are RoPE tables, identical on every rank: no need to broadcast them each forward
        return DistributedDataParallel(module, broadcast_buffers=False)

    def local_backward(self, model: torch.nn.Module, last: bool):
        """The context for one backward: gradients stay local except at a rank's last one in a step."""
        if self.world == 1 or last:
            return nullcontext()
        return model.no_sync()

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum of `values` over all ranks (every rank gets the result)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def launched() -> bool:
    """True in a process that torchrun (or another launcher with its environment) started as one of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join() -> Ranks:
    """Join the launcher's process group (gloo: the trainer's tensors live on the CPU); rank 0 of 1 if not launched."""
    if launched() and not dist.is_initialized():
        dist.init_process_group(backend="gloo")
    return Ranks.current()


def leave() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def launcher_part() -> tuple[int, int]:
    """(rank, world size) from the launcher's environment, without a process group: make-data's workers need none."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
