"""State dicts of models our engine shards, in the form torch's own tools understand.

A layer between the front-ends and the engine: the front-ends' `state_dict()` /
`load_state_dict()` / optimizer state dicts and `fsdp_bridge.checkpoint` (above the front-ends)
both use it, and it uses only the engine and the Plan.

- `parts`: where a model's sharded modules are, and what every tensor is called;
- `model_state`: model state dicts, sharded values as DTensors chunked by rows (native FSDP2's
  layout), loaded back from full tensors or DTensors of any world size;
- `optim_state`: the same for optimizer state, keyed by parameter name;
- `torch_helpers`: how FSDP1-style models answer torch's `torch.distributed.checkpoint.
  state_dict` helpers without torch being patched.
- `below_root`: how a wrapper of ours that is not the root (held by another module, or under
  torch's `checkpoint_wrapper`) is loaded by the root's `load_state_dict` and named to torch's
  helpers.
"""
