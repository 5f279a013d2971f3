"""An accelerate training loop on a tiny Llama with an FSDP2 plugin, on fsdp_bridge's engine:
the one change from the same script on torch's FSDP2 (`accelerate_llama_native.py`) is the
Accelerator's import. Random weights and random tokens, nothing downloaded. Run it on 2 CPU
ranks:

    python -m torch.distributed.run --nproc_per_node 2 -m fsdp_bridge.examples.accelerate_llama

Rank 0 prints `step N loss X` (the mean over the global batch) after each optimizer step. With
`--out DIR` it saves its state after step 2 (`save_state`: sharded model, optimizer and the step
count); `--resume DIR` loads it (`load_state`) and trains on to `--steps`. `--generate` prints
a few greedily generated tokens at the end, and the devices of the parameters.
"""

import torch

from fsdp_bridge.examples import frameworks as F
from fsdp_bridge.integrations.accelerate import Accelerator


def main():
    args = F.parse_args(__doc__.splitlines()[0])
    F.require_torchrun(__file__)
    accelerator = F.fsdp_accelerator(Accelerator, "bf16" if args.bf16 else "no")
    model = F.tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = F.Progress()
    accelerator.register_for_checkpointing(progress)
    if args.resume:
        accelerator.load_state(args.resume)
    rank, world = accelerator.process_index, accelerator.num_processes
    batches = F.token_rows(args.steps).view(args.steps, world, F.PER_DEVICE, F.SEQ)
    for step in range(progress.step, args.steps):
        ids = batches[step, rank].to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        mean = F.global_mean(loss)
        if accelerator.is_main_process:
            print(f"step {step + 1} loss {mean:.6f}", flush=True)
        progress.step = step + 1
        if args.out and progress.step == F.SAVE_STEP:
            accelerator.save_state(args.out)
    if args.generate:
        F.print_generated(F.generate(model, F.prompt(accelerator.device)), model)
    accelerator.end_training()


if __name__ == "__main__":
    main()
