"""accelerate on fsdp_bridge's engine: an accelerate training loop with an FSDP2 plugin, whose
one change from accelerate's own is the import of `Accelerator` (from
`fsdp_bridge.integrations.accelerate`). Needs the `hf` extra. Run it on 2 CPU ranks from the
repository's root:

    torchrun --standalone --nproc_per_node 2 examples/accelerate_llama.py [--bf16] [--steps N]

The script is `fsdp_bridge/examples/accelerate_llama.py`, shipped with the package beside its
native twin (`fsdp-bridge compare-scripts fsdp_bridge.examples.accelerate_llama_native
fsdp_bridge.examples.accelerate_llama` compares them, from anywhere); this file runs it from the
repository. `--help` lists its options (checkpoints, resume, generate).
"""

from fsdp_bridge.examples.accelerate_llama import main

if __name__ == "__main__":
    main()
