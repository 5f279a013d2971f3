"""Trains 6 steps under torchrun, checkpointing every 2 steps; with KILL_AT, rank 1 kills
itself (SIGKILL) after that step on the first attempt, and the restarted workers resume from
the latest complete checkpoint. Rank 0 writes the final full state to OUT/final.pt.

    torchrun --standalone --nproc-per-node 2 --max-restarts 1 resume_train.py OUT KILL_AT
"""

import os
import signal
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from fsdp_bridge.harness.teardown import leave_world  # noqa: E402

STEPS, EVERY = 6, 2


def main():
    out, kill_at = sys.argv[1], int(sys.argv[2])
    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    # torchrun keeps its store across restarts: without a per-attempt prefix, gloo's
    # rendezvous of a restarted worker can read a dead peer's address from the first attempt
    # (measured: "Connection refused" or a hang in init_process_group, 2 runs in 4).
    from datetime import timedelta
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore(f"attempt_{attempt}", store),
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    from fsdp_bridge import checkpoint
    from tests.checkpoint import cases as C

    rank = dist.get_rank()
    model = C.build("fsdp2")
    optimizer = C.optimizer_for(model)
    manager = checkpoint.CheckpointManager(os.path.join(out, "checkpoints"), keep=2)
    start = manager.load_latest(model, optimizer) or 0
    for step in range(start, STEPS):
        C.train_steps(model, optimizer, 1, start=step)
        if (step + 1) % EVERY == 0:
            manager.save(step + 1, model, optimizer)
        if step + 1 == kill_at and rank == 1 and attempt == 0:
            os.kill(os.getpid(), signal.SIGKILL)
    params, optim = C.truth(model, optimizer)
    if rank == 0:
        torch.save({"params": params, "optim": optim, "attempt": attempt, "resumed_from": start},
                   os.path.join(out, "final.pt"))
    dist.barrier()
    leave_world()  # final.pt is written; see [Note: gloo teardown abort]


if __name__ == "__main__":
    main()
