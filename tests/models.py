"""Tiny Hugging Face models built from configs (random weights, no downloads), data made in the
test, and the single-process reference trainer every equivalence test compares against.

Models are initialised on the CPU (the same weights whatever the test device) and then moved to
the test device (`tests.world.device()`); token ids move there in `lm_loss`."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.world import device as test_device

VOCAB = 128
SEQ = 16


class Block(torch.nn.Module):
    """Two square linear layers with a ReLU between (added to the input when `residual`): the
    unit of the memory tests, one block per unit."""

    def __init__(self, width: int, residual: bool = False):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.down = torch.nn.Linear(width, width)
        self.residual = residual

    def forward(self, x):
        out = self.down(torch.relu(self.up(x)))
        return x + out if self.residual else out


def _on_device(model, device):
    """`model` moved to `device` (default: the test device); left alone on meta."""
    if any(p.is_meta for p in model.parameters()):
        return model
    return model.to(test_device() if device is None else device)


def tiny_llama(seed: int = 0, device=None):
    """The tiny Llama, on `device` (default: the test device; "meta" builds it without storage)."""
    from fsdp_bridge.tiny import build_llama, llama_config

    config = llama_config(vocab=VOCAB, hidden=64, intermediate=128, layers=3, heads=4,
                          kv_heads=2, positions=64)
    # Initialised on the CPU (or on meta when asked) whatever `torch.device` context encloses
    # the call: the same weights on every test device.
    model = build_llama(config, seed, device="meta" if str(device) == "meta" else "cpu")
    return _on_device(model, device)


def tiny_gpt2(seed: int = 0, device=None):
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=VOCAB,
        n_embd=64,
        n_layer=3,
        n_head=4,
        n_positions=64,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(seed)
    return _on_device(GPT2LMHeadModel(config), device)


def global_batches(steps: int, global_batch: int, seed: int = 1234) -> torch.Tensor:
    """Token ids of shape (steps, global_batch, SEQ), identical on every rank."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (steps, global_batch, SEQ), generator=generator)


def rank_slice(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per_rank = batch.shape[0] // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def lm_loss(model, ids: torch.Tensor) -> torch.Tensor:
    ids = ids.to(test_device())
    return model(input_ids=ids, labels=ids).loss


def make_adamw(params, lr: float = 1e-3, foreach=None):
    # eps=1e-5: with the default 1e-8, Adam turns rounding-level differences in near-zero
    # gradients into 5e-6 parameter differences, even between two single-process runs that
    # only split the batch differently; at 1e-5 that noise floor is ~1e-7.
    return torch.optim.AdamW(params, lr=lr, eps=1e-5, weight_decay=0.1, foreach=foreach)


def train_reference(model, batches, lr=1e-3, micro_steps=1, clip=None, foreach=None):
    """Single process on the global batch: per-step losses (and grad norms when clipping)."""
    optimizer = make_adamw([p for p in model.parameters() if p.requires_grad], lr, foreach)
    losses, norms = [], []
    for batch in batches:
        micro = batch.chunk(micro_steps)
        total = 0.0
        for ids in micro:
            loss = lm_loss(model, ids) / micro_steps
            loss.backward()
            total += loss.item()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, norms


def global_mean(value: float, group=None) -> float:
    """The mean of a per-rank scalar over the ranks (the global-batch loss)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=test_device())  # NCCL: on the GPU
    dist.all_reduce(tensor, group=group)
    return tensor.item() / dist.get_world_size(group)
