"""Evaluating torch's FSDP1 wrap policies into a list of units, without wrapping anything.

Shared by the front-ends that accept an `auto_wrap_policy` (FSDP1, Zeta, TorchAcc). It runs
torch's own policy code, so the units are exactly FSDP1's:

- `_Policy` objects (`ModuleWrapPolicy`, `CustomPolicy`) through their own `_run_policy`,
  then ordered as FSDP1's `_post_order_apply` visits modules (children first, each shared
  module once). `CustomPolicy` dicts become per-unit overrides.
- Legacy callables (`transformer_auto_wrap_policy`, `lambda_auto_wrap_policy`,
  `size_based_auto_wrap_policy`, `always_wrap_policy`, `_or_policy` partials, user functions)
  through torch's own `_recursive_wrap`, with a wrapper that records instead of wrapping: the
  recursion order and the `nonwrapped_numel` bookkeeping of size-based policies are FSDP1's.

The result never contains the root: the root is always a unit of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable

from torch import nn
from torch.distributed.fsdp.wrap import _Policy, _recursive_wrap

__all__ = ["PolicyUnit", "evaluate_policy", "modules_of_classes", "post_order", "_Policy"]


@dataclasses.dataclass(frozen=True)
class PolicyUnit:
    module: nn.Module
    overrides: dict  # per-module kwargs (CustomPolicy); {} for the root's settings


def post_order(root: nn.Module) -> list[nn.Module]:
    """FSDP1's `_post_order_apply` order: children before parents, shared modules once."""
    visited = {id(root)}
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in visited:
                visited.add(id(child))
                visit(child)
        order.append(module)

    visit(root)
    return order


def evaluate_policy(
    root: nn.Module,
    policy: Callable | _Policy,
    ignored_modules: Iterable[nn.Module] = (),
    ignored_params: Iterable[nn.Parameter] = (),
) -> list[PolicyUnit]:
    """The modules `policy` would wrap in `root` (root excluded), post-order."""
    ignored_modules = set(ignored_modules)
    if isinstance(policy, _Policy):
        targets: dict[nn.Module, dict[str, Any]] = policy._run_policy(root, ignored_modules, {})
        return [
            PolicyUnit(module, dict(targets[module]))
            for module in post_order(root)
            if module is not root and module in targets
        ]
    recorded: list[nn.Module] = []

    def record(module: nn.Module, **_: Any) -> nn.Module:
        recorded.append(module)
        return module  # `_recursive_wrap` sets it back in place: the tree is unchanged

    _recursive_wrap(
        module=root,
        auto_wrap_policy=policy,
        wrapper_cls=record,
        ignored_modules=ignored_modules,
        ignored_params=set(ignored_params),
        only_wrap_children=True,
    )
    return [PolicyUnit(module, {}) for module in recorded if module is not root]


def modules_of_classes(root: nn.Module, classes: tuple[type, ...]) -> list[nn.Module]:
    """Instances of `classes` below `root`, post-order (transformer_auto_wrap_policy's units)."""
    return [m for m in post_order(root) if m is not root and isinstance(m, classes)]
