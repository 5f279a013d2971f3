"""The one autograd function of the engine.

[Note: post-backward without hooks]
A unit's full parameters are produced by `Unflatten.apply(gate, group, runtime)`, whose inputs
are a zero-size leaf that requires grad and the group. Autograd runs its backward exactly once
per backward pass, after the gradients of *all* uses of *all* of the group's parameters have
been summed (tied weights used twice included), which is precisely when the unit's gradient
is complete. So the backward is the post-backward hook: it lays the gradients into a reused
flat buffer and starts the reduction. Unused parameters arrive as None (no zero tensors are
materialised by autograd).
"""

from __future__ import annotations

import torch


class Unflatten(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, group, runtime):
        ctx.group = group
        ctx.runtime = runtime
        ctx.set_materialize_grads(False)
        return tuple(group.full_views())

    @staticmethod
    def backward(ctx, *grads):
        ctx.runtime.post_backward(ctx.group, ctx.group.grads_to_reduce(grads))
        return None, None, None
