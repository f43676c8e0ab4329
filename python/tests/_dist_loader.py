"""One rank of a training job under torchrun, for test_distributed.py:
tensord.torch.DataLoader with a DistributedSampler.

    torchrun --nnodes 2 --nproc_per_node 2 --node_rank K ... _dist_loader.py OUTDIR

Each rank's workers hand their batches to their rank through the node's
tensord ($TENSORD_SOCKET); the rank checks each batch lies in that tensord
and holds the samples the sampler gave it, and writes what it saw to
OUTDIR/<rank>.json.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import tensord
import tensord.torch as tt


class Samples(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return {"x": torch.full((1024,), float(i)), "i": i}


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo")  # env://, from torchrun
    rank, world = dist.get_rank(), dist.get_world_size()
    res = {"rank": rank, "local_rank": int(os.environ["LOCAL_RANK"])}
    try:
        ds = Samples()
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=3)
        sampler.set_epoch(1)
        loader = tt.DataLoader(ds, batch_size=4, sampler=sampler, num_workers=2)
        mine = tt.client_for(None).instance
        seen, foreign = [], 0
        for b in loader:
            hit = tensord.find(b["x"].data_ptr())
            assert hit is not None, "batch not in tensord"
            if hit[0].instance != mine:
                foreign += 1
            hit[0].release()
            assert torch.equal(b["x"][:, 0], b["i"].float())
            seen += b["i"].tolist()
        res["seen"] = seen
        res["want"] = list(sampler)
        res["foreign"] = foreign
        res["instance"] = mine
        got = [None] * world
        dist.all_gather_object(got, seen)
        res["all"] = sorted(sum(got, []))
        res["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        res["ok"] = False
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(out, "%d.json" % rank), "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
