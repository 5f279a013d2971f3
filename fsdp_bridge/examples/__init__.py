"""Runnable training scripts, shipped with the package so that `fsdp-bridge demo` finds them
wherever it is installed. Each one runs under torchrun by path or as a module, e.g.
`python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.yafsdp_llama`.

- `yafsdp_llama`: the FSDP -> YaFSDP migration guide's Llama example, with only the import changed.
- `fsdp1_train_llama`: a realistic FSDP1 training script, the input `fsdp-bridge demo` migrates.
- `hf_trainer_llama`, `accelerate_llama`, `lightning_llama`: a tiny Llama trained by the HF
  Trainer, an accelerate loop and the Lightning Trainer on our engine; each `*_native` twin is
  the same script with the one import line of the framework's own class
  (`fsdp-bridge compare-scripts X_native.py X.py` compares them). `frameworks` holds what they
  share.
"""
