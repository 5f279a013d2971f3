"""Runnable training scripts, shipped with the package so that `fsdp-bridge demo` finds them
wherever it is installed. Each one runs under torchrun by path or as a module, e.g.
`python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.yafsdp_llama`.

- `yafsdp_llama`: the FSDP -> YaFSDP migration guide's Llama example, with only the import changed.
- `fsdp1_train_llama`: a realistic FSDP1 training script, the input `fsdp-bridge demo` migrates.
"""
