"""A Lightning Trainer on fsdp_bridge's engine, whose one change from Lightning's FSDP strategy
is the strategy's import (from `fsdp_bridge.integrations.lightning`; by name,
`strategy="fsdp_bridge"`). Needs the `lightning` extra. Run it on 2 CPU ranks from the
repository's root:

    torchrun --standalone --nproc_per_node 2 examples/lightning_llama.py [--bf16] [--steps N]

The script is `fsdp_bridge/examples/lightning_llama.py`, shipped with the package beside its
native twin (`fsdp-bridge compare-scripts fsdp_bridge.examples.lightning_llama_native
fsdp_bridge.examples.lightning_llama` compares them, from anywhere); this file runs it from the
repository. `--help` lists its options (checkpoints, resume, generate).
"""

from fsdp_bridge.examples.lightning_llama import main

if __name__ == "__main__":
    main()
