"""Multi-process training for ``torchrun --nproc_per_node=N -m fla train``.

* :func:`setup` reads torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``),
  joins the process group (NCCL on GPUs, gloo on the CPU) and picks the device.
* :func:`shard` wraps the model with FSDP2 (``torch.distributed.fsdp.fully_shard``): each
  block first, then the root (embeddings, final norm, head). Parameters stay float32
  (gathered and reduced in float32) and the training loop's bf16 autocast picks the
  compute precision, exactly as in one process: the N-process run then computes what the
  one-process run computes. (bf16 parameters under FSDP's mixed-precision policy would
  halve the traffic, but they also round the norm weights and the decay parameters to
  bf16: on the 2-GPU check that cost a steady 4-5% in loss against the one-process run.)
* :func:`model_state` / :func:`optimizer_state` gather full (unsharded) state dicts on
  CPU through the distributed state-dict API (``torch.distributed.checkpoint.state_dict``)
  for a rank-0 save; :func:`load_optimizer_state` scatters a saved one back.
* The data is sharded by :class:`fla.cli.data.WindowSampler` (rank ``r`` of ``N`` takes
  every N-th window of the global batch, like ``DistributedSampler``).

Without torchrun every function degrades to the single-process case, so the training
loop has one code path.
"""
from __future__ import annotations

import datetime as _dt
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    launched: bool = False       # started by torchrun (even with one process)
    backend: str | None = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.launched:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.launched and self.world > 1:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def close(self) -> None:
        if self.launched and dist.is_initialized():
            dist.destroy_process_group()


def launched_by_torchrun() -> bool:
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def setup(device_kind: str) -> Dist:
    """Join the process group when torchrun started us; ``device_kind`` is 'cuda' or
    'cpu' (already validated by the caller)."""
    if not launched_by_torchrun():
        return Dist()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if device_kind == "cuda":
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        kwargs = {"timeout": _dt.timedelta(minutes=10)}
        if device_kind == "cuda":
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend=backend, rank=rank, world_size=world, **kwargs)
    return Dist(rank=rank, world=world, local_rank=local_rank, launched=True, backend=backend)


def device_for(d: Dist, device_kind: str) -> torch.device:
    if device_kind == "cuda":
        return torch.device("cuda", d.local_rank if d.launched else torch.cuda.current_device())
    return torch.device("cpu")


def shard(model: torch.nn.Module, d: Dist) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` each block of ``model.model.layers``, then the root
    (float32 parameters; the caller's autocast sets the compute precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if d.backend == "nccl" else "cpu", (d.world,))
    kwargs = {"mesh": mesh}
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None:
        for i, block in enumerate(layers):
            # The last block's parameters are needed by the root's backward right away:
            # keep them gathered after the forward.
            fully_shard(block, reshard_after_forward=i < len(layers) - 1, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _options(d: Dist, full: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=full, cpu_offload=d.launched)


def model_state(model: torch.nn.Module, d: Dist) -> dict:
    """The full model state dict (on rank 0; other ranks get an empty dict when
    distributed). Collective: every rank must call it."""
    if not d.launched:
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    return get_model_state_dict(model, options=_options(d, True))


def optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, d: Dist) -> dict:
    """The full optimizer state keyed by parameter names (collective, like
    :func:`model_state`)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
    return get_optimizer_state_dict(model, optimizer, options=_options(d, True))


def load_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                         state: dict, d: Dist) -> None:
    """Load a state saved by :func:`optimizer_state` (every rank holds the full dict;
    each keeps its shard)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state,
                             options=StateDictOptions(full_state_dict=True))


def clip_grad_norm(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm (over all shards); the norm before clipping, as a
    plain tensor on the device (no host sync here)."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):        # a DTensor under FSDP2
        norm = norm.full_tensor()
    return norm
