"""`YaFSDP`: YaFSDP's v1 wrapper interface (`ya_fsdp.ya_fsdp.YaFSDP`) over our engine.

Differences from YaFSDP that users can see, all in the direction of torch's conventions:
`named_parameters()` yields the original parameters (sharded, under their original names) rather
than two flat tensors, so name-based optimizer groups work, and they are the very Parameter
objects the model had, so an optimizer built before wrapping trains too; `state_dict()` returns
the full fp32 state dict on every rank (`rank0_only=True` for YaFSDP's "local rank 0 only"), and
`load_state_dict` accepts one; `zero_grad(set_to_none=True)` is allowed.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fsdp_bridge import devices, engine
from fsdp_bridge.mixed_dialects import refuse_other_dialects, refuse_taken_over
from fsdp_bridge.state_dicts import below_root, model_state
from fsdp_bridge.state_dicts.torch_helpers import called_by_torch_helpers
from fsdp_bridge.translation import bad_argument, check_param_init_fn
from fsdp_bridge.wrapper import hidden_child_names, placed, shard_flat
from fsdp_bridge.ya_fsdp._translate import FRONTEND, build_plan, ignored_notes


def _check_group(group) -> None:
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise bad_argument(FRONTEND, "data_parallel_process_group", group, "None (the default "
                           "world group) or a torch.distributed.ProcessGroup", "Leave it None "
                           "to use every rank, or pass dist.new_group(ranks).", exc=TypeError)


# [Note: stepping inside an accumulation cycle]
# With gradient_accumulation_steps=N, gradients are reduced, divided and exposed only after
# the N-th backward. An optimizer step after an earlier micro-step would apply last cycle's
# gradients (or none): training drifts with no error. A global optimizer step pre-hook (torch's
# public `register_optimizer_step_pre_hook`) refuses such a step, by name.
_ACCUMULATING: "weakref.WeakSet[YaFSDP]" = weakref.WeakSet()
_HOOK: list = []


def _refuse_step_mid_cycle(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    for model in list(_ACCUMULATING):
        micro_step = getattr(model._sharded, "micro_step", 0)
        if micro_step == 0:
            continue
        mine = {id(p) for p in model._module.parameters()}
        if any(id(p) in mine for group in optimizer.param_groups for p in group["params"]):
            steps = model.plan.gradient_accumulation_steps
            raise RuntimeError(
                f"{FRONTEND}(gradient_accumulation_steps={steps}): optimizer.step() was called "
                f"after micro-step {micro_step} of {steps}; gradients are reduced and exposed "
                f"only after backward number {steps} of each cycle, so this step would use stale "
                "gradients. "
                f"Call optimizer.step() (and zero_grad()) once every {steps} backward passes, "
                "or pass gradient_accumulation_steps=1 to step after every backward."
            )


def _watch_accumulation(model: "YaFSDP") -> None:
    if model.plan.gradient_accumulation_steps == 1:
        return
    _ACCUMULATING.add(model)
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse_step_mid_cycle))


class YaFSDP(nn.Module):
    _frontend = FRONTEND  # see fsdp_bridge/mixed_dialects.py
    _hidden_child = "_module"  # the inner attribute state-dict names leave out

    def __init__(
        self,
        module: nn.Module,
        zero_stage: int,
        # YaFSDP requires the next four; we accept their omission (None: the parameters' own
        # dtype; no units besides the root; no norm group; no declared accumulation).
        param_dtype: Optional[torch.dtype] = None,
        modules_to_wrap_with_names: list[tuple[nn.Module, str]] = (),
        layer_norm_module_cls: Optional[type] = None,
        gradient_accumulation_steps: int = 1,
        data_parallel_process_group: Optional[dist.ProcessGroup] = None,
        intra_node_data_parallel_process_group: Optional[dist.ProcessGroup] = None,
        model_parallel_process_group: Optional[dist.ProcessGroup] = None,
        all_reduce_grads_across_model_parallel_group: bool = False,
        bit16_reduce_scatter: bool = False,
        bit32_acc_for_bit16_reduce_scatter: bool = False,
        hpz_first_layers_num: int = 0,
        rogue_layer_norm_modules_with_names: Optional[dict[nn.Module, str]] = None,
        sync_module_states: bool = False,
        param_init_fn: Optional[Callable[[nn.Module], None]] = None,
        device_id: Optional[Union[int, torch.device]] = None,
        is_trainable: bool = True,
        use_yccl: bool = False,
        use_yccl_padding: bool = False,
        yccl_intra_inter_expr=None,
        yccl_all_gather_stages=None,
        profile: bool = False,
    ):
        super().__init__()
        # Everything is checked before the model is touched.
        refuse_other_dialects(FRONTEND, module)
        device = devices.resolve_device(FRONTEND, device_id)
        _check_group(data_parallel_process_group)
        check_param_init_fn(FRONTEND, param_init_fn)
        notes = ignored_notes(
            {
                "intra_node_data_parallel_process_group": intra_node_data_parallel_process_group,
                "model_parallel_process_group": model_parallel_process_group,
                "all_reduce_grads_across_model_parallel_group": all_reduce_grads_across_model_parallel_group,
                "bit32_acc_for_bit16_reduce_scatter": bit32_acc_for_bit16_reduce_scatter,
                "hpz_first_layers_num": hpz_first_layers_num,
                "is_trainable": is_trainable,
                "use_yccl": use_yccl,
                "use_yccl_padding": use_yccl_padding,
                "yccl_intra_inter_expr": yccl_intra_inter_expr,
                "yccl_all_gather_stages": yccl_all_gather_stages,
                "profile": profile,
            }
        )
        plan = build_plan(
            module,
            zero_stage=zero_stage,
            param_dtype=param_dtype,
            modules_to_wrap_with_names=modules_to_wrap_with_names,
            layer_norm_module_cls=layer_norm_module_cls,
            gradient_accumulation_steps=gradient_accumulation_steps,
            rogue_layer_norm_modules_with_names=rogue_layer_norm_modules_with_names,
            bit16_reduce_scatter=bit16_reduce_scatter,
            sync_module_states=sync_module_states,
            notes=notes,
        )
        self._module = module
        self._sharded = shard_flat(
            module,
            plan,
            shard_group=data_parallel_process_group,
            device=device,
            param_init_fn=param_init_fn,
        )
        _watch_accumulation(self)
        below_root.hook_into_parent_loads(self)

    # -- the wrapped model --------------------------------------------------------------------

    def forward(self, *args, **kwargs):
        refuse_taken_over(FRONTEND, self._sharded)
        return self._module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["_module"], name)

    @property
    def plan(self):
        return self._sharded.plan

    # Parameters and buffers under their original names (no "_module." prefix).
    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._module.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self._module.named_buffers(prefix, recurse, remove_duplicate)

    # -- YaFSDP's methods ---------------------------------------------------------------------

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        return self._sharded.clip_grad_norm_(max_norm, norm_type)

    def state_dict(self, *args, rank0_only: bool = False, destination=None, prefix: str = "",
                   **kwargs):
        if called_by_torch_helpers():  # see [Note: answering torch's state-dict helpers]
            result = model_state.get_model_state_dict(self)
        else:
            result = engine.full_state_dict(self._sharded, rank0_only=rank0_only)
        return placed(result, destination, prefix)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        if called_by_torch_helpers():
            return model_state.set_model_state_dict(self, state_dict, strict=strict)
        engine.load_full_state_dict(self._sharded, state_dict, strict=strict)
        return nn.modules.module._IncompatibleKeys([], [])

    def _fqn_modifiers(self) -> dict:
        return hidden_child_names(self._modules["_module"], "_module")

    # Held by another module, or under torch's checkpoint_wrapper: see
    # fsdp_bridge/state_dicts/below_root.py.
    def _load_overlap(self, state_dict: dict) -> tuple[list, list]:
        return below_root.load_overlap(self, state_dict)

    def named_modules(self, memo=None, prefix: str = "", remove_duplicate: bool = True):
        clean = below_root.named_modules(self, memo, prefix, remove_duplicate)
        return clean if clean is not None else super().named_modules(memo, prefix,
                                                                     remove_duplicate)

    # FSDP-style accumulation also works on top of the declared steps.
    def no_sync(self):
        return self._sharded.no_sync()
