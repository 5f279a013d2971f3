"""Rank 1 hangs before a collective, rank 0 waits in it: a run that never ends. Each rank
first leaves a file in MARKERS so that a test knows the ranks were running.

    torchrun --nproc-per-node 2 hang_rank1.py --markers DIR --tag TAG
"""

import argparse
import os
import time

import torch
import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--markers", required=True)
parser.add_argument("--tag", default="")  # only there to find these processes by name
args = parser.parse_args()
dist.init_process_group("gloo")
rank = dist.get_rank()
open(os.path.join(args.markers, f"rank{rank}.{os.getpid()}"), "w").close()
print("step 1 loss 1.0", flush=True)
if rank == 1:
    time.sleep(3600)
value = torch.ones(1)
dist.all_reduce(value)  # rank 0 waits here for rank 1
