"""The harness can fail: real bugs injected into native FSDP are reported as non-equivalent,
at the right first step; native FSDP1 and FSDP2 are reported equivalent to the reference.

Every case trains in one spawned gloo world of 2 ranks (tests/world.py); the verdicts are
computed in the parent from rank 0's records.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from fsdp_bridge.harness.backends import RankEnv, TorchFSDP1Backend, TorchFSDP2Backend
from fsdp_bridge.harness.compare import tolerance_for
from fsdp_bridge.harness.equivalence import judge
from fsdp_bridge.harness.launcher import run_on_rank
from fsdp_bridge.harness.recipes import Size, builtin_recipe
from tests.world import run_world

FAULT_STEP = 3


class SkippedReduction(TorchFSDP2Backend):
    """At one step, the first block's gradients are never reduce-scattered."""

    name = "bug-skipped-reduction"

    step = 0

    def before_step(self, model, step, env):
        self.step = step
        self._skip(model)

    @contextlib.contextmanager
    def no_sync(self, model):
        with super().no_sync(model):  # re-enables sync everywhere on exit...
            yield
        self._skip(model)  # ...so the bug must be re-applied for the last micro-batch

    def _skip(self, model):
        model.blocks[0].set_requires_gradient_sync(self.step != FAULT_STEP, recurse=False)


class WrongLearningRateOnRank1(TorchFSDP1Backend):
    """Rank 1 builds its optimizer with twice the learning rate."""

    name = "bug-wrong-lr-rank1"

    def build_optimizer(self, model, recipe, env):
        lr = recipe.lr * (2 if env.rank == 1 else 1)
        return recipe.replace(lr=lr).build_optimizer(model.parameters())


class UnsynchronisedParameter(TorchFSDP2Backend):
    """The head's bias is left out of sharding: its gradient is never averaged over ranks."""

    name = "bug-unsynchronised-param"

    def wrap(self, model, recipe, env):
        fsdp = self.dialect()
        kwargs = dict(mesh=self.mesh(recipe, env), ignored_params={model.head.bias})
        for block in model.blocks:
            fsdp.fully_shard(block, **kwargs)
        fsdp.fully_shard(model, **kwargs)
        return model


MLP = builtin_recipe("mlp", Size(layers=2, hidden=16, batch=8), steps=5, micro_batches=2)
GPT2 = builtin_recipe("tiny-gpt2", Size(layers=2, hidden=32, vocab=64, seq=8, batch=4), steps=3)
LLAMA_BF16 = builtin_recipe("tiny-llama", Size(layers=1, hidden=32, vocab=64, seq=8, batch=4),
                            steps=3, mp="bf16")

CASES = {
    "mlp": (MLP, ["reference", "torch-fsdp1", "torch-fsdp2", SkippedReduction(),
                  WrongLearningRateOnRank1(), UnsynchronisedParameter()]),
    "gpt2-tied": (GPT2, ["torch-fsdp1", "torch-fsdp2", "reference"]),
    "llama-bf16": (LLAMA_BF16, ["reference", "torch-fsdp2", "torch-fsdp1"]),
}


def _all_cases(rank, world_size):
    env = RankEnv(rank, world_size, torch.device("cpu"))
    return {name: run_on_rank(recipe, backends, env) for name, (recipe, backends) in CASES.items()}


@pytest.fixture(scope="module")
def verdicts():
    records = run_world(_all_cases, 2)[0]
    out = {}
    for name, runs in records.items():
        for run in runs:
            assert run.error is None, f"{name}/{run.backend}:\n{run.error}"
        tolerance = tolerance_for(CASES[name][0].mp)
        out[name] = {c.candidate: c for c in judge(runs, tolerance)}
    return out


def test_native_fsdp1_and_fsdp2_match_the_reference(verdicts):
    for name, candidate in [("mlp", "torch-fsdp1"), ("mlp", "torch-fsdp2"),
                            ("gpt2-tied", "torch-fsdp2"), ("gpt2-tied", "reference"),
                            ("llama-bf16", "torch-fsdp2"), ("llama-bf16", "torch-fsdp1")]:
        comparison = verdicts[name][candidate]
        assert comparison.ok, (name, comparison.summary())
        assert comparison.steps and comparison.params


def test_fp32_agreement_is_far_inside_the_tolerance(verdicts):
    # Equivalent fp32 runs agree to ~1e-7; near the tolerance would be a bug.
    for candidate in ("torch-fsdp1", "torch-fsdp2"):
        comparison = verdicts["mlp"][candidate]
        worst = max([c.ratio for c in comparison.steps] + [p.ratio for p in comparison.params])
        assert worst < 0.5, (candidate, worst)


def test_tied_embeddings_stay_tied(verdicts):
    comparison = verdicts["gpt2-tied"]["torch-fsdp2"]
    names = {diff.name for diff in comparison.params}
    assert {"transformer.wte.weight", "lm_head.weight"} <= names


@pytest.mark.parametrize("bug, first_step", [
    ("bug-skipped-reduction", FAULT_STEP),
    ("bug-wrong-lr-rank1", 1),
    ("bug-unsynchronised-param", 1),
])
def test_injected_bug_is_reported_at_its_first_step(verdicts, bug, first_step):
    comparison = verdicts["mlp"][bug]
    assert not comparison.ok
    assert comparison.first_diverging_step == first_step, comparison.summary()
    assert comparison.diverging_params, "the final state dict should differ too"
    assert f"first diverging step {first_step}" in comparison.summary()


def test_unsynchronised_parameter_is_named_among_the_most_different(verdicts):
    comparison = verdicts["mlp"]["bug-unsynchronised-param"]
    top = [diff.name for diff in comparison.params[:3]]
    assert "head.bias" in top, top
