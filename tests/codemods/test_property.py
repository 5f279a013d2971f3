"""Property: for random FSDP1 constructor calls (random argument subsets, value forms, layouts),
every target's output parses and a second pass changes nothing."""

import ast

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_bridge.migrate.driver import transform_source

HEADER = """\
import functools
import torch
from torch.distributed.fsdp import (
    BackwardPrefetch, CPUOffload, FullyShardedDataParallel as FSDP, MixedPrecision, ShardingStrategy,
)
from torch.distributed.fsdp.wrap import ModuleWrapPolicy, transformer_auto_wrap_policy
"""

VALUES = {
    "process_group": ["None", "pg", "(shard_pg, replicate_pg)"],
    "sharding_strategy": ["ShardingStrategy.FULL_SHARD", "ShardingStrategy.SHARD_GRAD_OP",
                          "ShardingStrategy.HYBRID_SHARD", "ShardingStrategy.NO_SHARD", "cfg.strategy", "None"],
    "cpu_offload": ["CPUOffload(offload_params=True)", "CPUOffload(False)", "None", "offload"],
    "auto_wrap_policy": ["ModuleWrapPolicy({Block})", "functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block, Head})",
                         "policy", "None", "ModuleWrapPolicy(classes)"],
    "backward_prefetch": ["BackwardPrefetch.BACKWARD_PRE", "BackwardPrefetch.BACKWARD_POST", "None"],
    "mixed_precision": ["MixedPrecision(param_dtype=torch.bfloat16)", "mp", "None",
                        "MixedPrecision(torch.float16, torch.float32, buffer_dtype=torch.float16)",
                        "MixedPrecision(param_dtype=dtype, cast_forward_inputs=True)"],
    "ignored_modules": ["None", "[model.head]"],
    "device_id": ["torch.device('cpu')", "local_rank", "None"],
    "sync_module_states": ["True", "False", "cfg.sync"],
    "forward_prefetch": ["True", "False"],
    "limit_all_gathers": ["True", "False"],
    "use_orig_params": ["True", "False"],
    "device_mesh": ["mesh", "None"],
}

arguments = st.lists(st.sampled_from(sorted(VALUES)), unique=True, max_size=6).flatmap(
    lambda names: st.tuples(*[st.tuples(st.just(n), st.sampled_from(VALUES[n])) for n in names])
)


@st.composite
def programs(draw):
    args = draw(arguments)
    module = draw(st.sampled_from(["model", "self.model", "build()", "module=model"]))
    comment = draw(st.sampled_from(["", "  # keep me"]))
    multiline = draw(st.booleans())
    splat = draw(st.sampled_from(["", "**extra"]))
    parts = [module] + [f"{name}={value}" for name, value in args] + ([splat] if splat else [])
    if multiline:
        body = "".join(f"    {part},{comment if i == len(parts) - 1 else ''}\n" for i, part in enumerate(parts))
        call = f"FSDP(\n{body})"
    else:
        call = f"FSDP({', '.join(parts)})"
    form = draw(st.sampled_from(["model = {}", "return {}", "{}", "wrapped = [{}]"]))
    line = form.format(call) + ("" if multiline else comment)
    return HEADER + "\n\ndef setup(model, cfg):\n" + "".join(f"    {part}\n" for part in line.splitlines())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(), st.sampled_from(["fsdp2", "yafsdp", "bridge"]))
def test_output_parses_and_second_pass_is_a_no_op(source, target):
    output, _ = transform_source(source, target)
    ast.parse(output)
    again, _ = transform_source(output, target)
    assert again == output
    if "# keep me" in source:
        assert "# keep me" in output, "a comment was lost"
