"""The matrix's model and recipe: small enough for dozens of cells a minute, shaped to meet what
the axes exercise.

- `Block` (the sharding unit and the checkpointed module): LayerNorm, up and down projections
  and a floating-point buffer (`gain`) that scales its output, so a buffer dtype changes the
  numbers; `reset_parameters` re-creates the buffer, for initialisation from meta.
- a final LayerNorm (YaFSDP's norm group), an embedding and an output head (tied to the
  embedding with `tied`), a side module (`side`, left out of sharding with `ignored`).
- element counts no world of 2-4 ranks divides (a block is 4h^2 + 7h + 1 = 883 elements), so
  every world shards unevenly.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from fsdp_bridge.harness.recipes import Recipe

VOCAB, HIDDEN, LAYERS, SEQ = 37, 14, 2, 6
ROWS_PER_MICRO_BATCH = 2  # rows each rank trains per micro-step
STEPS = 4  # resume happens after step STEPS // 2
LR = 0.05
MAX_NORM = 0.3  # clip_grad_norm_'s bound: small enough to bite at every step
BUFFER_SUFFIXES = (".gain",)  # the state-dict keys of the model's floating-point buffers


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, 2 * hidden + 1)
        self.down = nn.Linear(2 * hidden + 1, hidden)
        self.register_buffer("gain", torch.empty(hidden))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The buffer (children reset their own parameters)."""
        with torch.no_grad():
            self.gain.copy_(torch.linspace(0.5, 1.5, self.gain.numel()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x)))) * self.gain.to(x.dtype)


class MatrixModel(nn.Module):
    def __init__(self, tied: bool = False, vocab: int = VOCAB, hidden: int = HIDDEN,
                 layers: int = LAYERS):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(layers))
        self.side = nn.Linear(hidden, hidden)
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        # The side module may be left out of sharding, and so of mixed precision: it runs in
        # its own dtype.
        x = x + 0.1 * self.side(x.to(self.side.weight.dtype)).to(x.dtype)
        return self.head(self.norm(x))


def make_model(tied: bool, frozen: bool) -> MatrixModel:
    model = MatrixModel(tied=tied)
    if frozen:
        model.blocks[0].up.weight.requires_grad_(False)
    return model


def make_batch(global_batch: int, step: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, VOCAB, (global_batch, SEQ + 1), generator=generator)


def next_token_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                       tokens[:, 1:].reshape(-1))


def param_init_fn(module: nn.Module) -> None:
    """FSDP1's / YaFSDP's `param_init_fn`: storage on the CPU for this module's own tensors,
    then its `reset_parameters` (called for every module of a unit)."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    reset = getattr(module, "reset_parameters", None)
    if callable(reset):
        reset()


def matrix_recipe(world: int, micro: int, tied: bool, frozen: bool, clip: bool,
                  seed: int = 0) -> Recipe:
    """The recipe of a cell: SGD with momentum (a wrong clip coefficient or gradient scale shows
    in its update, where Adam's would normalise it away), STEPS steps."""
    global_batch = world * micro * ROWS_PER_MICRO_BATCH
    return Recipe(
        name="matrix",
        make_model=functools.partial(make_model, tied, frozen),
        make_batch=functools.partial(make_batch, global_batch),
        loss_fn=next_token_loss,
        unit_classes=(Block,),
        norm_classes=(nn.LayerNorm,),
        global_batch=global_batch,
        micro_batches=micro,
        steps=STEPS,
        seed=seed,
        optimizer="sgd",
        lr=LR,
        max_grad_norm=MAX_NORM if clip else None,
    )
