"""Hugging Face's Trainer on fsdp_bridge's engine, with FSDP2 in its training arguments, whose
one change from the Trainer's own is the import of `Trainer` (from
`fsdp_bridge.integrations.transformers`). Needs the `hf` extra. Run it on 2 CPU ranks from the
repository's root:

    torchrun --standalone --nproc_per_node 2 examples/hf_trainer_llama.py [--bf16] [--steps N]

The script is `fsdp_bridge/examples/hf_trainer_llama.py`, shipped with the package beside its
native twin (`fsdp-bridge compare-scripts fsdp_bridge.examples.hf_trainer_llama_native
fsdp_bridge.examples.hf_trainer_llama` compares them, from anywhere); this file runs it from the
repository. `--help` lists its options (checkpoints, resume, generate).
"""

from fsdp_bridge.examples.hf_trainer_llama import main

if __name__ == "__main__":
    main()
