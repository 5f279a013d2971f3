"""Gradient norms and scaling over many tensors at once: one `torch._foreach_*` launch per
(device, dtype) instead of one kernel (and, for gradients on the host under CPU offload, one
device copy) per parameter.

[Note: foreach norms]
`torch._foreach_norm` and `torch._foreach_mul_` (both in every torch this package supports)
compute each tensor's norm and product as `torch.linalg.vector_norm` and `Tensor.mul_` would;
on the CPU they run those very operations, so the results are bitwise the per-parameter ones.
The per-tensor norms are put back in the parameters' order before they are combined, so the
sum runs in the same order too. (On CUDA the foreach kernels reduce in another order: equal
within float rounding.)
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist


def _by_device_and_dtype(tensors: list[torch.Tensor]) -> dict[tuple, list[int]]:
    groups: dict[tuple, list[int]] = defaultdict(list)
    for index, tensor in enumerate(tensors):
        groups[(tensor.device, tensor.dtype)].append(index)
    return groups


def tensor_norms(grads: list[torch.Tensor], norm_type: float,
                 device: torch.device) -> torch.Tensor:
    """Every tensor's `norm_type` norm, computed in float32, stacked on `device` in the order
    given."""
    norms: list = [None] * len(grads)
    for indices in _by_device_and_dtype(grads).values():
        group = [grads[i].float() for i in indices]  # no copy where float32 already
        # One copy to `device` per group, not per tensor (see [Note: foreach norms]).
        on_device = torch.stack(torch._foreach_norm(group, norm_type)).to(device)
        for position, index in enumerate(indices):
            norms[index] = on_device[position]
    return torch.stack(norms)


def scale_(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every tensor in place by the one-element `factor`, copied once per device and
    dtype."""
    for (device, dtype), indices in _by_device_and_dtype(grads).items():
        torch._foreach_mul_([grads[i] for i in indices], factor.to(device, dtype))


def grad_norm_of(sharded, local, norm_type: float, comm, device) -> torch.Tensor:
    """The norm of all gradients: shards combine over the shard group, replicated ones don't."""
    def partial(grads):
        grads = [g for g in grads if g.numel() > 0]  # an empty shard adds nothing
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        # On the compute device: offloaded gradients are on the host, collectives are not.
        norms = tensor_norms(grads, norm_type, device)
        if norm_type == float("inf"):
            return norms.max()
        return norms.pow(norm_type).sum()

    sharded_part = partial(sharded)
    if norm_type == float("inf"):
        comm.all_reduce_shards(sharded_part, op=dist.ReduceOp.MAX)
        return torch.maximum(sharded_part, partial(local))
    comm.all_reduce_shards(sharded_part)
    return (sharded_part + partial(local)).pow(1.0 / norm_type)


# [Note: FSDP1's norm] FSDP1's `clip_grad_norm_` takes each rank's norm of its gradients as the
# norm of their per-tensor norms (`vector_norm` of the stacked `vector_norm`s, in float32),
# raises it to the p-th power, sums that over the shard group, adds the unsharded gradients'
# norm to the p-th power and takes the p-th root. Rounding depends on that order of
# operations and on the order of the tensors, so `fsdp1_grad_norm` does exactly that.


def fsdp1_grad_norm(sharded, local, norm_type: float, comm, device) -> torch.Tensor:
    """The global norm of the gradient shards `sharded` and the whole gradients `local` as
    FSDP1 computes it (see [Note: FSDP1's norm]), in float32 on `device`."""
    def norm_of(grads):
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=device)
        norms = [torch.linalg.vector_norm(g.detach(), norm_type, dtype=torch.float32).to(device)
                 for g in grads]
        return torch.linalg.vector_norm(torch.stack(norms), norm_type, dtype=torch.float32)

    # A parameter with no elements on this rank has no gradient there in FSDP1 (None).
    sharded_norm = norm_of([g for g in sharded if g.numel() > 0])
    if norm_type == float("inf"):
        total = torch.maximum(sharded_norm, norm_of(local)) if local else sharded_norm
        comm.all_reduce_shards(total, op=dist.ReduceOp.MAX)
        return total
    total = sharded_norm ** norm_type
    comm.all_reduce_shards(total)
    if local:
        total += norm_of(local) ** norm_type
    return total ** (1.0 / norm_type)


def clip_coefficient(max_norm: float, total: torch.Tensor) -> torch.Tensor:
    """What gradients are multiplied by to bring their norm `total` within `max_norm`."""
    return torch.clamp(max_norm / (total + 1e-6), max=1.0)
