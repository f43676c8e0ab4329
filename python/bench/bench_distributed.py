#!/usr/bin/python3
"""bench_distributed: a 1 GiB state dict from rank 0 to 2 simulated nodes x 2 ranks.

Usage: /usr/bin/python3 python/bench/bench_distributed.py [--quick]
(starts two private tensords, one per simulated node; see benchlib.py for where
it finds the binary and the package).

The world: 4 processes, ranks 0 and 1 on "node 0" (the first tensord), ranks 2
and 3 on "node 1" (the second), torch.distributed over Gloo on 127.0.0.1. Rank
0's state dict: 16 float32 tensors of 64 MiB, 1 GiB ($TD_BENCH_SCALE, or
--quick's 0.2, scales the tensors, at least 2, and the rounds, at least 3).
The two ways alternate round by round; every round starts after a barrier, and
its time is the slowest rank's (each rank's wall time from the barrier until it
holds every tensor):

  plain broadcast       every rank makes its own tensors (torch.empty) and
                        torch.distributed.broadcast(t, src=0) each, one call per
                        tensor, over the world: what a job does without
                        tensord; the baseline.
  broadcast_state_dict  tensord.distributed.broadcast_state_dict(sd, NAME):
                        node 0's leader (rank 0) copies the state dict into its
                        tensord, the leaders (ranks 0 and 2) broadcast it in
                        buckets of 256 MiB into node 1's tensord, each leader
                        publishes it, and every rank attaches its node's copy
                        (a new version each round; the previous one freed).

Columns: p50 and p99 in ms (with fewer than 100 samples p99 is the maximum),
GB/s (the state dict's bytes over the p50), and "vs plain": plain's p50 over the
row's. Then memory per node after each way: bytes in tensord (stat()'s
bytes_used, measured) and the ranks' own copies (their tensors' bytes); and the
bytes each node receives: with G ranks per node, G x the model for plain
broadcast, 1 x the model for broadcast_state_dict (a model of the traffic; here
it all crosses the loopback).
"""

from __future__ import annotations

import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

import benchlib

NAME = "bench/weights"


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def worker(out: str, ntensors: int, elems: int, rounds: int) -> None:
    """One rank (RANK, WORLD_SIZE, MASTER_PORT, TENSORD_SOCKET from the
    environment); rank 0 writes the results to out."""
    import torch
    import torch.distributed as dist

    from tensord import distributed as tdd

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    dist.init_process_group(
        "gloo", init_method="tcp://127.0.0.1:%s" % os.environ["MASTER_PORT"],
        rank=rank, world_size=int(os.environ["WORLD_SIZE"]),
        timeout=datetime.timedelta(seconds=600))
    tdd.node_groups()
    client = tdd._tt.client_for(None)
    sd = None
    if rank == 0:
        sd = {"layer%d.weight" % i: torch.full((elems,), float(i))
              for i in range(ntensors)}
    times = {"plain": [], "tensord": []}
    mem = {}

    def slowest(t0: float) -> float:
        got = [None] * dist.get_world_size()
        dist.all_gather_object(got, time.perf_counter() - t0)
        return max(got)

    for r in range(rounds):
        for way in (("plain", "tensord") if r % 2 == 0 else ("tensord", "plain")):
            dist.barrier()
            t0 = time.perf_counter()
            if way == "plain":
                mine = sd if rank == 0 else {
                    "layer%d.weight" % i: torch.empty(elems)
                    for i in range(ntensors)}
                for k in sorted(mine):
                    dist.broadcast(mine[k], src=0)
                times[way].append(slowest(t0))
                own = sum(t.numel() * t.element_size() for t in mine.values())
                got = [None] * dist.get_world_size()
                dist.all_gather_object(got, own if rank else 0)
                mem["plain"] = got
                del mine
            else:
                w = tdd.broadcast_state_dict(sd, NAME)
                times[way].append(slowest(t0))
                got = [None] * dist.get_world_size()
                dist.all_gather_object(got, client.stat()["bytes_used"])
                mem["tensord"] = got
                del w
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"times": times, "mem": mem}, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    args = benchlib.parse_args(__doc__.splitlines()[1])
    tensord, tdt, why = benchlib.import_tensord()
    if why:
        print("bench_distributed: skipped: " + why)
        return 0
    ntensors = max(2, min(16, round(16 * args.scale)))
    rounds = max(3, round(5 * args.scale))
    elems = 16 << 20  # 64 MiB of float32
    total = ntensors * elems * 4
    with benchlib.Daemon() as a, benchlib.Daemon() as b:
        print(a.header())
        print("bench_distributed: %s state dict (%d tensors of 64 MiB) from rank 0 "
              "to 2 nodes x 2 ranks (two tensords: %s, %s), Gloo on 127.0.0.1; "
              "%d rounds" % (benchlib.size_str(total), ntensors, a.socket,
                              b.socket, rounds))
        out = tempfile.mktemp(prefix="tensord-bench-dist.", suffix=".json")
        port = free_port()
        procs = []
        for r, d in enumerate((a, a, b, b)):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="4",
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo",
                       TENSORD_SOCKET=d.socket, OMP_NUM_THREADS="1")
            procs.append(subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--worker", out,
                 str(ntensors), str(elems), str(rounds)], env=env))
        codes = [p.wait() for p in procs]
        if codes != [0, 0, 0, 0] or not os.path.exists(out):
            print("bench_distributed: a rank failed: exit codes %s" % codes,
                  file=sys.stderr)
            return 1
        with open(out) as f:
            res = json.load(f)
        os.unlink(out)
        failed = a.failed or b.failed
    base = benchlib.median(res["times"]["plain"])
    rows = []
    for way, label in (("plain", "plain broadcast"),
                       ("tensord", "broadcast_state_dict")):
        s = res["times"][way]
        p50 = benchlib.median(s)
        rows.append([label, "%d" % len(s), "%.0f" % (p50 * 1e3),
                     "%.0f" % (benchlib.pct(s, 99) * 1e3),
                     "%.2f" % (total / p50 / 1e9), benchlib.ratio_str(base, p50)])
    print()
    print("1. Wall time until every rank holds the state dict (the slowest rank)")
    benchlib.print_table(["way", "n", "p50 ms", "p99 ms", "GB/s", "vs plain"], rows)
    print()
    print("2. Memory per node, and the bytes each node receives (G = 2 ranks per node)")
    m = res["mem"]
    rows = []
    for node, ranks in ((0, (0, 1)), (1, (2, 3))):
        own = sum(m["plain"][r] for r in ranks)
        recv = len([r for r in ranks if r != 0])  # rank 0 is the source
        rows.append(["plain broadcast", "%d" % node, "0",
                     benchlib.size_str(own), "%.2f" % (own / total), "%d" % recv])
        held = m["tensord"][ranks[0]]
        rows.append(["broadcast_state_dict", "%d" % node, benchlib.size_str(held),
                     "0", "%.2f" % (held / total), "%d" % (1 if node else 0)])
    benchlib.print_table(["way", "node", "in tensord", "ranks' own", "copies",
                          "received /model"], rows)
    print("  (node 0's rank 0 holds the source state dict itself in both ways, not "
          "counted; on real nodes \"received\" is network bytes: G x the model "
          "for plain broadcast, 1 x for broadcast_state_dict)")
    print()
    print("targets (reported, not enforced): one copy per node (copies 1.00), and "
          "broadcast_state_dict no slower than plain broadcast (vs plain >= 1.00)")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        benchlib.add_package_path()
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        sys.exit(0)
    sys.exit(main())
