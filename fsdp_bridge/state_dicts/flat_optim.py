"""Optimizers over FSDP1's flat parameters, read as optimizers over the original parameters.

[Note: optimizer state of flat parameters]
With `use_orig_params=False` an optimizer built over `model.parameters()` holds one flat
parameter per unit (see [Note: flat parameters] in engine/flat_params.py) and keeps its state
per element of the flat shard. Native FSDP1's optimizer-state APIs name that state by the
original parameters, with their full shapes, and take it back in that form at any world size.
Ours do the same by reading such an optimizer through a `PieceView`: the optimizer as if it
held the original parameters' pieces (what it holds with `use_orig_params=True`). In each param
group a flat parameter is replaced by its group's pieces, and each per-element state tensor is
cut into the pieces' ranges (views, no copy); other state (`step`) is every piece's. What the
APIs compute for `optim.load_state_dict` is numbered as the view numbers its parameters;
`to_optimizer` numbers it for the optimizer itself, laying the pieces' state back into flat
tensors (zero in the padding, which an optimizer leaves at zero as native FSDP1's does).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from fsdp_bridge import engine

STATE, GROUPS, PARAMS = "state", "param_groups", "params"


class PieceView:
    """An optimizer (or anything with `param_groups` and `state`) read with its flat
    parameters replaced by their pieces (see [Note: optimizer state of flat parameters])."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.refresh()

    def refresh(self) -> None:
        """Read the optimizer again (after it stepped or loaded state)."""
        self.param_groups: list[dict] = []
        self.state: dict[torch.Tensor, dict] = {}
        for param_group in self.optimizer.param_groups:
            params = []
            for param in param_group[PARAMS]:
                group = engine.flat_param_group(param)
                saved = self.optimizer.state.get(param)
                if group is None:
                    params.append(param)
                    if saved is not None:
                        self.state[param] = saved
                    continue
                params.extend(group.local_params)
                if saved:
                    for index, piece in enumerate(group.local_params):
                        self.state[piece] = _piece_state(saved, group, index, param)
            self.param_groups.append(dict(param_group, params=params))

    def to_optimizer(self, loadable: dict) -> dict:
        """`loadable` (numbered as this view numbers its parameters) numbered for the
        optimizer, each flat parameter's state laid out from its pieces'."""
        state: dict[int, dict] = {}
        groups = []
        position = view_position = 0
        for param_group, loaded in zip(self.optimizer.param_groups, loadable[GROUPS]):
            entry = {k: v for k, v in loaded.items() if k != PARAMS}
            entry[PARAMS] = []
            for param in param_group[PARAMS]:
                group = engine.flat_param_group(param)
                if group is None:
                    if view_position in loadable[STATE]:
                        state[position] = loadable[STATE][view_position]
                    view_position += 1
                else:
                    count = len(group.local_params)
                    pieces = [loadable[STATE].get(view_position + i) for i in range(count)]
                    view_position += count
                    merged = _flat_state(pieces, group, param)
                    if merged is not None:
                        state[position] = merged
                entry[PARAMS].append(position)
                position += 1
            groups.append(entry)
        return {STATE: state, GROUPS: groups}


def holds_flat_params(optimizer) -> bool:
    return any(engine.flat_param_group(param) is not None
               for group in optimizer.param_groups for param in group[PARAMS])


def pieces_of(optimizer):
    """`optimizer` as the state-dict functions read it: a `PieceView` when it holds flat
    parameters, else itself."""
    return PieceView(optimizer) if holds_flat_params(optimizer) else optimizer


def real(optimizer):
    """The optimizer behind a `PieceView`, or `optimizer` itself."""
    return optimizer.optimizer if isinstance(optimizer, PieceView) else optimizer


def for_optimizer(optimizer, loadable: dict) -> dict:
    """What `optimizer.load_state_dict` takes from `loadable`, which was computed for
    `pieces_of(optimizer)`."""
    return optimizer.to_optimizer(loadable) if isinstance(optimizer, PieceView) else loadable


def _is_per_element(value: Any, flat: torch.Tensor) -> bool:
    return torch.is_tensor(value) and value.dim() > 0 and value.shape == flat.shape


def _piece_state(saved: dict, group, index: int, flat: torch.Tensor) -> dict:
    lo, hi = group.local_range(index)
    return {key: value[lo:hi] if _is_per_element(value, flat) else value
            for key, value in saved.items()}


def _flat_state(pieces: list[Optional[dict]], group, flat: torch.Tensor) -> Optional[dict]:
    given = [(index, piece) for index, piece in enumerate(pieces) if piece]
    if not given:
        return None
    out: dict[str, Any] = {}
    for key in given[0][1]:
        values = [(index, piece[key]) for index, piece in given if key in piece]
        sample = values[0][1]
        if not (torch.is_tensor(sample) and sample.dim() > 0):
            out[key] = sample  # `step` and other per-parameter scalars: the same for all
            continue
        whole = torch.zeros(flat.shape, dtype=sample.dtype, device=flat.device)
        for index, value in values:
            lo, hi = group.local_range(index)
            whole[lo:hi] = value.reshape(-1)
        out[key] = whole
    return out
