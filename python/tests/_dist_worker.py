"""One rank of a simulated multi-node job, for test_distributed.py.

    _dist_worker.py SCENARIO OUTDIR

The environment gives RANK, WORLD_SIZE, MASTER_PORT and TENSORD_SOCKET (its
"node"'s tensord); Gloo runs on 127.0.0.1 only. Each rank writes what it saw
to OUTDIR/<rank>.json; with TDT_HOLD it then holds its weights until
OUTDIR/release exists (for the test to read its Pss).
"""

from __future__ import annotations

import datetime
import gc
import json
import os
import signal
import sys
import time
import traceback

import torch
import torch.distributed as dist

import tensord
import tensord.torch as tt
from tensord import distributed as tdd

BUCKET = 1 << 20


def model(seed: int) -> dict:
    """A state dict every rank can rebuild: 40 tensors of several dtypes,
    about 6 MiB, with a tied pair and a strided view."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for i in range(36):
        n = 1000 + 4000 * (i % 9)
        sd["layer%d.weight" % i] = torch.randn(n, 8, generator=g)
    sd["emb"] = torch.randn(300, 16, generator=g).half()
    sd["head"] = sd["emb"]  # tied: one storage
    sd["ids"] = torch.randint(-(2**40), 2**40, (513,), generator=g)
    sd["t"] = torch.randn(64, 32, generator=g)[::2, 3:].t()  # strided view
    return sd


def same(got: dict, want: dict, layout: bool = True) -> None:
    """got equals want bit for bit; with layout, strides and storage
    offsets too."""
    assert list(got) == list(want), (list(got)[:5], list(want)[:5])
    for k, w in want.items():
        g = got[k]
        assert (g.dtype, g.shape) == (w.dtype, w.shape), k
        if layout:
            assert (g.stride(), g.storage_offset()) == (
                w.stride(), w.storage_offset()), k
        # bit for bit
        assert torch.equal(g.contiguous().view(torch.uint8),
                           w.contiguous().view(torch.uint8)), k
    if "head" in got:
        assert got["head"].data_ptr() == got["emb"].data_ptr()


def segment_maps() -> list:
    """This process's mappings of tensord segments: [name, size, Pss]."""
    maps = []
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(None, 1)[0]
            if "-" in first and ":" not in first:
                on = "/dev/shm/tensord." in line
                if on:
                    lo, hi = (int(x, 16) for x in first.split("-"))
                    maps.append([line.split()[-1], hi - lo, 0])
            elif on and line.startswith("Pss:"):
                maps[-1][2] = int(line.split()[1]) * 1024
    return maps


class Counting:
    """Counts torch.distributed.broadcast calls; can SIGKILL this process
    at the Nth."""

    def __init__(self, die_at: int = 0) -> None:
        self.calls = 0
        self.die_at = die_at
        self.real = dist.broadcast
        dist.broadcast = self

    def __call__(self, *a, **kw):
        self.calls += 1
        if self.calls == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return self.real(*a, **kw)

    def undo(self) -> None:
        dist.broadcast = self.real


def try_call(fn) -> dict:
    t0 = time.monotonic()
    try:
        fn()
        return {"error": None, "s": time.monotonic() - t0}
    except Exception as e:  # noqa: BLE001 - reported to the test
        return {"error": "%s: %s" % (type(e).__name__, e),
                "s": time.monotonic() - t0}


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    timeout = float(os.environ.get("TDT_DIST_TIMEOUT", "30"))
    dist.init_process_group(
        "gloo", init_method="tcp://127.0.0.1:%s" % os.environ["MASTER_PORT"],
        rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=timeout))
    res: dict = {"rank": rank}
    hold = []
    try:
        if scenario == "broadcast":
            local, leaders, lead = tdd.node_groups(timeout=timeout)
            res["is_leader"] = lead
            res["local"] = dist.get_process_group_ranks(local)
            res["leaders"] = dist.get_process_group_ranks(leaders)
            # src not its node's leader: the leader stages, src fills
            w = tdd.broadcast_state_dict(model(1) if rank == 1 else None, "a",
                                         src=1, bucket_bytes=BUCKET)
            same(w, model(1))
            del w
            dist.barrier()
            if lead:
                tt.client_for(None).unpublish("a")
            dist.barrier()
            cnt = Counting()
            w = tdd.broadcast_state_dict(model(2) if rank == 0 else None, "w",
                                         bucket_bytes=BUCKET)
            cnt.undo()
            same(w, model(2))
            res["calls"] = cnt.calls
            res["tensors"] = len(w)
            res["version"] = w.version
            res["nbytes"] = sum(s["nbytes"] for s in tt.client_for(None).ls())
            res["model_bytes"] = sum(
                tt._untyped_storage(t).nbytes() for k, t in model(2).items()
                if k != "head")
            for t in w.values():  # every page mapped
                t.sum()
            gc.collect()
            res["maps"] = segment_maps()
            seg = ".%d-" % w.storage_ids[0]  # tensord.<instance>.<id>-<random>
            res["pss"] = sum(m[2] for m in res["maps"] if seg in m[0])
            hold.append(w)
        elif scenario == "kill":
            tdd.node_groups(timeout=timeout)
            cnt = Counting(die_at=3 if rank == 2 else 0)
            res.update(try_call(lambda: tdd.broadcast_state_dict(
                model(3) if rank == 0 else None, "w", bucket_bytes=BUCKET)))
        elif scenario == "misuse":
            sd = model(4)
            res["src_none"] = try_call(lambda: tdd.broadcast_state_dict(
                None, "w"))
            res["extra_dict"] = try_call(lambda: tdd.broadcast_state_dict(
                sd if rank in (0, 3) else None, "w"))
            res["names"] = try_call(lambda: tdd.broadcast_state_dict(
                sd if rank == 0 else None, "w" if rank != 2 else "v"))
            res["not_tensor"] = try_call(lambda: tdd.broadcast_state_dict(
                {"x": [1, 2]} if rank == 0 else None, "w"))
            # the same world goes on after wrong use
            path = os.environ.get("TDT_SAFETENSORS")
            w = tdd.load_safetensors_distributed(
                path if rank == 0 else None, "st", bucket_bytes=BUCKET)
            want = {k: v.contiguous() for k, v in sd.items() if k != "t"}
            want.pop("head")
            same({k: w[k] for k in sorted(w)}, {k: want[k] for k in sorted(want)},
                 layout=False)
            res["metadata"] = w.metadata
            res["bad_file"] = try_call(lambda: tdd.load_safetensors_distributed(
                "/nonexistent.safetensors" if rank == 0 else None, "st2"))
        elif scenario == "nodaemon":
            res.update(try_call(lambda: tdd.broadcast_state_dict(
                model(5) if rank == 0 else None, "w")))
        else:
            raise SystemExit("unknown scenario %r" % scenario)
        res["ok"] = True
    except Exception:  # noqa: BLE001 - reported to the test
        res["ok"] = False
        res["traceback"] = traceback.format_exc()
    with open(os.path.join(out, "%d.json.tmp" % rank), "w") as f:
        json.dump(res, f)
    os.rename(os.path.join(out, "%d.json.tmp" % rank),
              os.path.join(out, "%d.json" % rank))
    if os.environ.get("TDT_HOLD"):
        while not os.path.exists(os.path.join(out, "release")):
            time.sleep(0.05)
    hold.clear()
    if scenario != "kill":
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
