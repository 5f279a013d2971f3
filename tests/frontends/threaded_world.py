"""Run as `python -m tests.frontends.threaded_world OUT`: two ranks as two threads of this one
process (torch's threaded process group, as torch's own and many other test suites use), each
training two independently `fully_shard`-ed models alternately, with native FSDP2 and with ours.
Writes {rank: {"native": ..., "ours": ...}} or {"error": traceback} to OUT (torch.save).

A separate process: installing the threaded process group replaces torch.distributed's world
with a per-thread one for the rest of the process."""

from __future__ import annotations

import sys
import threading
import traceback

import torch
import torch.distributed as dist

WORLD = 2
STEPS = 3


def _two_models(which: str, rank: int, initial: list) -> dict:
    """`initial`: the two models' starting weights, drawn before the threads start (torch's
    random generator is one per process: threads drawing from it at once get mixed draws)."""
    from tests.frontends import fsdp2_edge_cases as C

    models = []
    for weights in initial:
        model = C.Branchy().to(C.device())
        model.load_state_dict(weights)
        models.append(C._shard(which, model, aux_unit=False))
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in models]
    losses = []
    for step in range(STEPS):
        for model, optim in zip(models, optims):  # alternately, step by step
            loss = model(C._batch(step, rank, WORLD)).pow(2).mean()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.item())
    return {"losses": losses,
            "states": [{n: C._full(p).detach().clone() for n, p in m.named_parameters()}
                       for m in models]}


def main(out: str) -> None:
    from torch.testing._internal.distributed.multi_threaded_pg import (
        ProcessLocalGroup,
        _install_threaded_pg,
    )

    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # as torch's own tests do
    _install_threaded_pg()
    store = dist.HashStore()
    results: dict = {}
    from tests.frontends import fsdp2_edge_cases as C

    first = C._model().state_dict()
    # The second model starts elsewhere, so that the two cannot be confused.
    initial = [first, {name: value * 0.5 for name, value in first.items()}]

    def rank_main(rank: int) -> None:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        try:
            results[rank] = {which: _two_models(which, rank, initial)
                             for which in ("native", "ours")}
        except BaseException as error:  # noqa: BLE001 - reported to the test
            results[rank] = {"error": traceback.format_exc()}
            ProcessLocalGroup.exception_handle(error)  # wake the other rank up
        finally:
            dist.destroy_process_group()

    threads = [threading.Thread(target=rank_main, args=(rank,), daemon=True) for rank in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    if any(thread.is_alive() for thread in threads):
        results["error"] = "a rank thread did not finish within 120 s"
    torch.save(results, out)


if __name__ == "__main__":
    main(sys.argv[1])
