"""YaFSDP on fsdp_bridge's engine: the FSDP -> YaFSDP migration guide's Llama example, with the
import of `ya_fsdp` changed to `fsdp_bridge.ya_fsdp` (bf16 parameters, fp32 reduction). Run it
on 2 CPU ranks from the repository's root:

    torchrun --standalone --nproc_per_node 2 examples/yafsdp_llama.py --steps 5

The script is `fsdp_bridge/examples/yafsdp_llama.py`, shipped with the package (`fsdp-bridge
demo` trains it; `torchrun -m fsdp_bridge.examples.yafsdp_llama` runs it from an install); this
file runs it from the repository.
"""

from fsdp_bridge.examples.yafsdp_llama import main

if __name__ == "__main__":
    main()
