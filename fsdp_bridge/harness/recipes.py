"""Recipes: what to train, independent of how it is sharded.

A `Recipe` holds a model factory, a data factory, an optimizer factory and the schedule (steps,
micro-batches, seed). Every backend builds the model from the same seeded factory, so every
backend starts from the same weights, and draws the same global batches.

Recipes travel to spawned ranks by pickling, so a user recipe's factories must be importable
module-level callables (or `functools.partial` of them), not lambdas.

[Note: batches and micro-batches]
`make_batch(step, generator)` returns the *global* batch of one optimizer step: a tensor or a
dict of tensors whose first dimension is the global batch size. Rank r of a world of N trains on
rows [r*B/N, (r+1)*B/N); within those rows, micro-batch m is the m-th of `micro_batches` equal
chunks. The reference trains on the whole global batch, micro-batch m being the union over ranks
of their m-th chunks, so both compute the same mean gradient when `loss_fn` is a mean over
equally sized rows.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, Optional

import torch
from torch import nn

from fsdp_bridge.harness.names import OPTIMIZERS, SIZE_DEFAULTS, STRATEGIES  # noqa: F401

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclasses.dataclass(frozen=True)
class Recipe:
    """One training job to run under several backends."""

    name: str
    make_model: Callable[[], nn.Module]  # called under torch.manual_seed(seed)
    make_batch: Callable[[int, torch.Generator], Any]  # (step, generator) -> global batch
    loss_fn: Callable[[nn.Module, Any], torch.Tensor]  # (model, micro-batch) -> mean loss
    # Module classes that become their own sharding unit (FSDP1 transformer_auto_wrap_policy,
    # FSDP2 per-module fully_shard, YaFSDP modules_to_wrap_with_names); the root is always one.
    unit_classes: tuple[type, ...] = ()
    norm_classes: tuple[type, ...] = ()  # YaFSDP's layer_norm_module_cls (first one is used)
    global_batch: int = 8
    micro_batches: int = 1
    steps: int = 5
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    mp: str = "fp32"  # compute dtype: "fp32", or "bf16"/"fp16" gathered params, fp32 reduction
    strategy: str = "full_shard"
    # clip_grad_norm_(max_grad_norm) before every optimizer step (None: no clipping), through
    # the backend's own clip (FSDP1's method, torch's function on FSDP2's DTensors, ...).
    max_grad_norm: Optional[float] = None

    def __post_init__(self) -> None:
        _check_choice("mp", self.mp, tuple(DTYPES))
        _check_choice("strategy", self.strategy, STRATEGIES)
        _check_choice("optimizer", self.optimizer, OPTIMIZERS)
        for field in ("global_batch", "micro_batches", "steps"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"Recipe {field}={value!r}: expected a positive int.")
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) \
                or not math.isfinite(self.lr) or self.lr < 0:
            raise ValueError(f"Recipe lr={self.lr!r}: expected a finite learning rate >= 0, "
                             "e.g. 1e-3.")
        if self.max_grad_norm is not None and (
                isinstance(self.max_grad_norm, bool)
                or not isinstance(self.max_grad_norm, (int, float))
                or not math.isfinite(self.max_grad_norm) or self.max_grad_norm <= 0):
            raise ValueError(f"Recipe max_grad_norm={self.max_grad_norm!r}: expected None or a "
                             "finite number > 0, e.g. 1.0.")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise ValueError(f"Recipe seed={self.seed!r}: expected an int >= 0.")

    @property
    def compute_dtype(self) -> torch.dtype:
        return DTYPES[self.mp]

    def check_world(self, world_size: int) -> None:
        """Each rank must get whole, equal micro-batches of the global batch."""
        per_micro = world_size * self.micro_batches
        if self.global_batch % per_micro:
            raise ValueError(
                f"global_batch={self.global_batch} cannot be split over world size "
                f"{world_size} x micro_batches {self.micro_batches}: use a global batch that is "
                f"a multiple of {per_micro}."
            )

    def build_model(self) -> nn.Module:
        torch.manual_seed(self.seed)
        return self.make_model()

    def batch(self, step: int) -> Any:
        generator = torch.Generator().manual_seed(self.seed * 100_003 + step)
        return self.make_batch(step, generator)

    def build_optimizer(self, params) -> torch.optim.Optimizer:
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9)
        return torch.optim.AdamW(params, lr=self.lr, weight_decay=0.01)

    def replace(self, **changes) -> "Recipe":
        return dataclasses.replace(self, **changes)


def _check_choice(name: str, value: str, accepted: tuple[str, ...]) -> None:
    if value not in accepted:
        raise ValueError(f"{name}={value!r} is not supported: use one of {', '.join(accepted)}.")


# --- slicing one global batch ---------------------------------------------------------------


def take_rows(batch: Any, rows: slice) -> Any:
    """Rows of a batch (a tensor, or a dict / tuple / list of tensors)."""
    if isinstance(batch, torch.Tensor):
        return batch[rows]
    if isinstance(batch, dict):
        return {key: take_rows(value, rows) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(take_rows(value, rows) for value in batch)
    raise TypeError(f"a batch must be a tensor or a dict/tuple/list of tensors, got {type(batch)}")


def cat_rows(parts: list) -> Any:
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, dict):
        return {key: cat_rows([part[key] for part in parts]) for key in first}
    return type(first)(cat_rows(list(group)) for group in zip(*parts))


def micro_batches(recipe: Recipe, batch: Any, rank: int, world_size: int) -> list:
    """The micro-batches that rank `rank` of `world_size` ranks trains on."""
    local = recipe.global_batch // world_size
    micro = local // recipe.micro_batches
    start = rank * local
    return [take_rows(batch, slice(start + m * micro, start + (m + 1) * micro))
            for m in range(recipe.micro_batches)]


def reference_micro_batches(recipe: Recipe, batch: Any, shards: int) -> list:
    """The reference's micro-batch m: the union of every rank's m-th micro-batch."""
    per_rank = [micro_batches(recipe, batch, rank, shards) for rank in range(shards)]
    return [cat_rows([per_rank[r][m] for r in range(shards)]) for m in range(recipe.micro_batches)]


# --- built-in recipes -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Size:
    """Options that size a built-in recipe (`fsdp-bridge compare --layers ... --hidden ...`)."""

    layers: int = SIZE_DEFAULTS["layers"]
    hidden: int = SIZE_DEFAULTS["hidden"]
    vocab: int = SIZE_DEFAULTS["vocab"]
    seq: int = SIZE_DEFAULTS["seq"]
    batch: int = SIZE_DEFAULTS["batch"]  # global batch
    heads: int = SIZE_DEFAULTS["heads"]

    def check(self, recipe: str) -> None:
        """Refuse sizes the recipe's model cannot be built with, naming the option."""
        for field in ("layers", "hidden", "vocab", "seq", "batch", "heads"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"--{field} {value!r}: expected an int >= 1.")
        if recipe == "mlp":
            return
        if self.vocab < 2:
            raise ValueError(f"--vocab {self.vocab}: a language model needs at least 2 tokens.")
        if self.hidden % self.heads:
            raise ValueError(f"--hidden {self.hidden} is not divisible by --heads {self.heads}: "
                             "attention splits the hidden size evenly over the heads. Use a "
                             f"multiple of {self.heads}, e.g. --hidden "
                             f"{self.heads * max(1, round(self.hidden / self.heads))}.")
        if recipe == "tiny-llama":
            kv_heads = max(1, self.heads // 2)
            if self.heads % kv_heads:
                raise ValueError(f"--heads {self.heads}: tiny-llama uses {kv_heads} key/value "
                                 "heads (half the heads), which must divide the heads; use an "
                                 "even number of heads (or 1 or 3).")
            if (self.hidden // self.heads) % 2:
                raise ValueError(f"--hidden {self.hidden} / --heads {self.heads} = "
                                 f"{self.hidden // self.heads} per head: rotary embeddings "
                                 "need an even head size; e.g. --hidden "
                                 f"{self.heads * (self.hidden // self.heads + 1)}.")


def _llama(size: Size) -> nn.Module:
    from fsdp_bridge.tiny import build_llama, llama_config

    config = llama_config(
        vocab=size.vocab, hidden=size.hidden, intermediate=2 * size.hidden, layers=size.layers,
        heads=size.heads, kv_heads=max(1, size.heads // 2), positions=max(64, size.seq),
        attention="eager",
    )
    return build_llama(config, seed=None)  # Recipe.build_model has seeded already


def _gpt2(size: Size) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=size.vocab, n_embd=size.hidden, n_layer=size.layers, n_head=size.heads,
        n_positions=max(64, size.seq), tie_word_embeddings=True,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )
    config._attn_implementation = "eager"
    return GPT2LMHeadModel(config)


class MLP(nn.Module):
    """A small residual MLP stack: enough structure for several units and a norm."""

    def __init__(self, hidden: int, layers: int):
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MLPBlock(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.up = nn.Linear(hidden, 4 * hidden)
        self.down = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


def _tokens(size: Size, step: int, generator: torch.Generator) -> torch.Tensor:
    return torch.randint(0, size.vocab, (size.batch, size.seq), generator=generator)


def _regression(size: Size, step: int, generator: torch.Generator) -> tuple:
    x = torch.randn(size.batch, size.hidden, generator=generator)
    return x, x.sum(dim=1, keepdim=True).sin()


def lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(input_ids=tokens, labels=tokens).loss


def mse_loss(model: nn.Module, batch: tuple) -> torch.Tensor:
    x, y = batch
    return torch.nn.functional.mse_loss(model(x).float(), y)


def _mlp(size: Size) -> nn.Module:
    return MLP(size.hidden, size.layers)


def _mlp_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    return (MLPBlock,), (nn.LayerNorm,)


def _llama_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    return (LlamaDecoderLayer,), (LlamaRMSNorm,)


def _gpt2_classes() -> tuple[tuple[type, ...], tuple[type, ...]]:
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    return (GPT2Block,), (nn.LayerNorm,)


BUILTIN = {
    "tiny-llama": (_llama, _tokens, lm_loss, _llama_classes),
    "tiny-gpt2": (_gpt2, _tokens, lm_loss, _gpt2_classes),
    "mlp": (_mlp, _regression, mse_loss, _mlp_classes),
}


def builtin_recipe(name: str, size: Optional[Size] = None, **schedule) -> Recipe:
    """A built-in recipe sized by `size`; `schedule` sets Recipe fields (steps, mp, lr, ...)."""
    if name not in BUILTIN:
        raise ValueError(f"recipe={name!r} is not a built-in recipe: use one of "
                         f"{', '.join(BUILTIN)}, or build a Recipe for your own model.")
    size = size or Size()
    size.check(name)
    make_model, make_batch, loss_fn, classes = BUILTIN[name]
    unit_classes, norm_classes = classes()
    return Recipe(
        name=name,
        make_model=functools.partial(make_model, size),
        make_batch=functools.partial(make_batch, size),
        loss_fn=loss_fn,
        unit_classes=unit_classes,
        norm_classes=norm_classes,
        global_batch=size.batch,
        **schedule,
    )
