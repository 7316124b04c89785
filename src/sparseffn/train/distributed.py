"""Process-group set-up for `torchrun` (DDP, or FSDP2 `fully_shard`) and the reductions the loop needs.

Single process unless WORLD_SIZE > 1 in the environment (torchrun sets RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT). Backend: NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def dist_from_env() -> DistInfo:
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as err:
        raise ValueError(f"RANK / LOCAL_RANK / WORLD_SIZE must be integers: {err}") from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"bad distributed environment: RANK={rank}, WORLD_SIZE={world}")
    return DistInfo(rank, local, world)


def init_process_group(info: DistInfo, device: torch.device) -> bool:
    """Initialise the default group when needed; True if this call created it (the caller destroys it)."""
    if not info.enabled or dist.is_initialized():
        return False
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        dist.init_process_group(backend, device_id=device)
    else:
        dist.init_process_group(backend)
    return True


def make_reduce(info: DistInfo):
    """reduce(tensor, "sum" | "max" | "mean") across processes, in place; identity on one process."""
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}

    def reduce(t: torch.Tensor, op: str) -> torch.Tensor:
        if not info.enabled:
            return t
        if op == "mean":
            dist.all_reduce(t, dist.ReduceOp.SUM)
            return t.div_(info.world_size)
        dist.all_reduce(t, ops[op])
        return t

    return reduce


def barrier(info: DistInfo) -> None:
    if info.enabled:
        dist.barrier()


def broadcast_object(obj, info: DistInfo):
    if not info.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj, info: DistInfo) -> list:
    """[obj of rank 0, obj of rank 1, ...] on every rank ([obj] without distribution)."""
    if not info.enabled:
        return [obj]
    out = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def check_replicas_identical(model: torch.nn.Module, info: DistInfo) -> None:
    """Raise RuntimeError if the DDP replicas' parameters differ (sum and sum of squares per tensor)."""
    if not info.enabled:
        return
    digest = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for p in model.parameters()])
    device = next(model.parameters()).device if dist.get_backend() == "nccl" else torch.device("cpu")
    digest = digest.flatten().to(device)
    gathered = [torch.empty_like(digest) for _ in range(info.world_size)]
    dist.all_gather(gathered, digest)
    gathered = [g.cpu() for g in gathered]
    bad = [r for r, g in enumerate(gathered) if not torch.equal(g, gathered[0])]
    if bad:
        raise RuntimeError(f"DDP replicas diverged: the parameters of ranks {bad} differ from rank 0's")
