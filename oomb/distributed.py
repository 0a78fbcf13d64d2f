"""Data parallelism over ranks started by ``torchrun``: one sequence per rank per step.

Without sharding (``train.shard='none'``) every rank holds the whole model, its gradients and optimizer states,
and the gradients are summed with ONE all-reduce per step (:func:`all_reduce_gradients`), not per chunk: a
chunk-recurrent step runs every layer 3N - 1 times (Stage 1 and Stage 2 over N chunks), and a reduction per
chunk would move N times the bytes. With LoRA that all-reduce is a few MB. Models whose weights, gradients and
states do not fit one GPU are sharded with FSDP2 instead (:mod:`oomb.engine.sharding`, docs/design.md §8);
:func:`clip_grad_norm` then takes the norm over every rank's shards.

The loss is normalised by the GLOBAL number of valid tokens: each rank divides
its token-loss sum by the total over all ranks, so summing gradients across
ranks gives exactly the mean over every valid token of the global batch.

Failure handling: :func:`agree_ok` is a collective every rank reaches, whether
its own step succeeded or raised, so one rank's bad data stops every rank with
the same error instead of leaving the others blocked in the gradient
all-reduce.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["DistributedContext", "RankFailedError", "agree_ok", "all_reduce_gradients", "clip_grad_norm", "global_any",
           "global_sum", "init_from_env"]


class RankFailedError(RuntimeError):
    """Another rank failed during the step; this rank stops too."""


class DistributedContext:
    """Rank, world size and device of this process (world size 1 when not launched by torchrun)."""

    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0, initialized_here: bool = False):
        self.rank = rank
        self.world_size = world_size
        self.local_rank = local_rank
        self.initialized_here = initialized_here

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def close(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def init_from_env(device_type: str, timeout_s: float = 1800.0) -> DistributedContext:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK...).

    Uses NCCL for CUDA and gloo for CPU. Without torchrun's variables, returns a world of one.

    Args:
        device_type: 'cuda' or 'cpu'.
        timeout_s: collective timeout in seconds: a rank that never arrives fails the others
            after this long instead of hanging forever.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistributedContext()
    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    initialized_here = False
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        if device_type == "cuda":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s))
        initialized_here = True
    return DistributedContext(rank, world_size, local_rank, initialized_here)


def global_sum(value: int | float, device: torch.device) -> float:
    """Sum of a Python number over all ranks (the number itself when not distributed)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.item()


def global_any(flags, device: torch.device) -> list[bool]:
    """For each of ``flags`` (a sequence of bools), whether it is true on any rank: one all-reduce of
    ``len(flags)`` numbers, which every rank calls at the same point with as many flags (``flags`` as they are
    when not distributed)."""
    flags = [bool(f) for f in flags]
    if not (dist.is_available() and dist.is_initialized()):
        return flags
    t = torch.tensor([1.0 if f else 0.0 for f in flags], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [v > 0 for v in t.tolist()]


def agree_ok(ok: bool, device: torch.device, message: str = "") -> None:
    """Collective check: raise :class:`RankFailedError` on every rank if any rank passed ``ok=False``.

    Every rank must call this at the same point whether or not its own work failed.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    t = torch.tensor([0.0 if ok else 1.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if t.item() > 0 and ok:
        raise RankFailedError(
            "another rank failed during this step (see its error above); all ranks stop" + (f": {message}" if message else "")
        )


def all_reduce_gradients(params, bucket_bytes: int = 256 << 20) -> None:
    """Sum ``.grad`` of ``params`` over all ranks in flattened buckets (one pass per step).

    Parameters without a gradient on this rank contribute zeros, so every rank issues the
    same collectives in the same order.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = [p for p in params if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0

    def flush():
        nonlocal bucket, size
        if not bucket:
            return
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        bucket, size = [], 0

    for p in params:
        g = p.grad
        if bucket and (g.dtype != bucket[0].dtype or size + g.numel() * g.element_size() > bucket_bytes):
            flush()
        bucket.append(g)
        size += g.numel() * g.element_size()
    flush()


def clip_grad_norm(params, max_norm: float) -> float:
    """Scale the gradients of ``params`` in place so that their total 2-norm is at most ``max_norm`` (``inf``: no
    clipping); return the norm before clipping.

    Gradients that are ``DTensor`` shards (FSDP2: :mod:`oomb.engine.sharding`) count with the norm over every
    rank's shards, the norm of the whole gradient, so every rank clips by the same factor (a collective: every
    rank must call it). Other gradients: as ``torch.nn.utils.clip_grad_norm_``.
    """
    from torch.distributed.tensor import DTensor

    params = [p for p in params if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in params):
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()  # the sum of the squared shard norms over the ranks
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)
