#!/usr/bin/python3
"""profile_handoff: where the time of one bench_handoff.py case (a) round trip goes, step by step.

Usage: /usr/bin/python3 python/bench/profile_handoff.py [--quick] [N_BYTES]
(starts its own tensord; see benchlib.py). Not run by `make bench`: a tool for
reading bench_handoff.py's numbers.

For each path of bench_handoff.py (torch-fd, torch-fs, td-queue, td-raw) it runs
case (a), an already-shared tensor of N bytes (default 4 KiB) sent again, with
the same processes, pinning and consumer as bench_handoff.py, and stamps
CLOCK_MONOTONIC (one clock for every process) at each step on both sides:

  producer   t0 put() / publish() called
  feeder     torch's Queue pickles in a feeder thread: ForkingPickler.dumps
             start and end; inside it, for td-queue, tensord.torch's reducer:
             find() + the view, and the scoped publish (a daemon round trip)
  consumer   get() returns from its wait (the pickle's bytes have arrived),
             ForkingPickler.loads start and end; inside it, for td-queue, the
             one-shot key's lookup(take=True) (a daemon round trip, an fd and a
             mapping) and .torch(); then .numpy() and the two bytes read, the
             drop of what it got, the acknowledgement written
  producer   t1 the acknowledgement read

and prints, per path, the median of each step's duration (between consecutive
stamps), so that the steps sum to about the median round trip.
"""

from __future__ import annotations

import os
import sys
import time

import benchlib
import bench_handoff as bh

STEPS_Q = ["put -> feeder starts pickling", "pickle (dumps)", "dumps -> consumer has bytes",
           "unpickle (loads)", "numpy() + read", "drop", "ack -> producer"]


def instrument(path: str, stamps: list) -> None:
    """Wraps the pickler (and tensord.torch's reducer pieces) to append (name, ns) to stamps."""
    from multiprocessing.reduction import ForkingPickler
    from multiprocessing import queues

    now = time.monotonic_ns
    dumps = ForkingPickler.dumps.__func__
    loads = ForkingPickler.loads

    def dumps_w(cls, obj, protocol=None):
        stamps.append(("dumps0", now()))
        r = dumps(cls, obj, protocol)
        stamps.append(("dumps1", now()))
        return r

    def loads_w(*a, **k):
        stamps.append(("loads0", now()))
        r = loads(*a, **k)
        stamps.append(("loads1", now()))
        return r

    ForkingPickler.dumps = classmethod(dumps_w)
    ForkingPickler.loads = staticmethod(loads_w)
    queues._ForkingPickler = ForkingPickler
    if path == "td-queue":
        import tensord.torch as tdt

        for name in ("_storage_view", "_publish_in_flight"):
            f = getattr(tdt, name)

            def w(*a, _f=f, _n=name, **k):
                stamps.append((_n + "0", now()))
                r = _f(*a, **k)
                stamps.append((_n + "1", now()))
                return r

            setattr(tdt, name, w)
        real_client_for = tdt.client_for

        class Spy:
            """The consumer's client, with its lookup stamped."""

            def __init__(self, c):
                self.c = c

            def lookup(self, *a, **k):
                stamps.append(("lookup0", now()))
                r = self.c.lookup(*a, **k)
                stamps.append(("lookup1", now()))
                return r

        tdt.client_for = lambda p=None: Spy(real_client_for(p))


def consumer(path: str, q, ctl_r: int, ack_w: int, out_w: int, cpu: int, n: int) -> None:
    import pickle

    import torch

    benchlib.pin(cpu)
    torch.set_num_threads(1)
    stamps: list = []
    client = None
    if path.startswith("td-"):
        import tensord
        client = tensord.connect(os.environ["TENSORD_SOCKET"])
        if path == "td-queue":
            import tensord.torch as tdt
            tdt.install(client)
    if path != "td-raw":
        instrument(path, stamps)
    now = time.monotonic_ns
    count = int.from_bytes(os.read(ctl_r, 8), "little")
    rows = []
    for _ in range(count):
        stamps.clear()
        if path == "td-raw":
            t = client.lookup(bh.KEY, take=True)
            stamps.append(("got", now()))
        else:
            t = q.get()
            stamps.append(("got", now()))
        a = t.numpy()
        ok = a[0] != 0 and a[n - 1] != 0
        stamps.append(("read", now()))
        del a
        if path == "td-raw":
            t.release()
        del t
        stamps.append(("dropped", now()))
        os.write(ack_w, b"\0" if ok else b"\1")
        rows.append(list(stamps))
    data = pickle.dumps(rows)
    os.write(out_w, len(data).to_bytes(8, "little"))
    view = memoryview(data)
    while view:
        k = os.write(out_w, view)
        view = view[k:]


def run(path: str, n: int, count: int, cpus: tuple[int, int], conn) -> None:
    """One path's producer (a forked child): runs count handoffs, sends back every stamp."""
    import pickle

    import torch
    import torch.multiprocessing as tmp

    benchlib.pin(cpus[0])
    torch.set_num_threads(1)
    client = None
    if path == "torch-fd":
        tmp.set_sharing_strategy("file_descriptor")
    elif path == "torch-fs":
        tmp.set_sharing_strategy("file_system")
    else:
        import tensord
        client = tensord.connect(os.environ["TENSORD_SOCKET"])
        if path == "td-queue":
            import tensord.torch as tdt
            tdt.install(client)
    stamps: list = []
    if path != "td-raw":
        instrument(path, stamps)
    ctx = tmp.get_context("fork")
    q = ctx.Queue() if path != "td-raw" else None
    ctl_r, ctl_w = os.pipe()
    ack_r, ack_w = os.pipe()
    out_r, out_w = os.pipe()
    p = ctx.Process(target=consumer, args=(path, q, ctl_r, ack_w, out_w, cpus[1], n),
                    daemon=True)
    p.start()
    if path in bh.TORCH_PATHS:
        held = torch.empty(n, dtype=torch.uint8).share_memory_()
    elif path == "td-queue":
        held = client.empty(n, dtype="uint8").torch()
    else:
        held = client.empty(n, dtype="uint8")
    arr = held.numpy()
    os.write(ctl_w, count.to_bytes(8, "little"))
    now = time.monotonic_ns
    rows = []
    for i in range(count):
        stamps.clear()
        arr[0] = arr[n - 1] = i % 255 + 1
        t0 = now()
        if path == "td-raw":
            client.publish(bh.KEY, held)
            stamps.append(("published", now()))
        else:
            q.put(held)
        if os.read(ack_r, 1) != b"\0":
            raise RuntimeError(f"{path}: a bad handoff")
        t1 = now()
        rows.append([("t0", t0)] + list(stamps) + [("t1", t1)])
    size = int.from_bytes(os.read(out_r, 8), "little")
    data = b""
    while len(data) < size:
        data += os.read(out_r, size - len(data))
    p.join()
    if q is not None:
        q.close()
        q.join_thread()
    del arr, held
    conn.send(pickle.dumps((rows, pickle.loads(data))))


def steps_of(prod: list, cons: list) -> list[tuple[str, int]]:
    """Returns one handoff's (step, ns) in time order from both sides' stamps."""
    allst = sorted(prod + cons, key=lambda s: s[1])
    out = []
    for (a, ta), (b, tb) in zip(allst, allst[1:]):
        out.append((f"{a} -> {b}", tb - ta))
    return out


def main() -> int:
    import multiprocessing
    import pickle

    argv = [a for a in sys.argv[1:] if a != "--quick"]
    n = int(argv[0]) if argv else 4096
    count = 300 if "--quick" in sys.argv else 2000
    tensord, tdt, why = benchlib.import_tensord()
    paths = bh.TORCH_PATHS + (bh.TD_PATHS if why is None else [])
    with benchlib.Daemon() as d:
        print(d.header())
        cpus = benchlib.cpu_pair()
        ctx = multiprocessing.get_context("fork")
        for path in paths:
            a, b = ctx.Pipe()
            pr = ctx.Process(target=run, args=(path, n, count, cpus, b))
            pr.start()
            rows, crow = pickle.loads(a.recv())
            pr.join()
            skip = min(50, count // 5)  # warm-up
            per: dict[str, list[int]] = {}
            order: list[str] = []
            totals = []
            for pr_st, co_st in list(zip(rows, crow))[skip:]:
                totals.append(pr_st[-1][1] - pr_st[0][1])
                for name, ns in steps_of(pr_st, co_st):
                    if name not in per:
                        per[name] = []
                        order.append(name)
                    per[name].append(ns)
            print(f"\n{path}: {benchlib.size_str(n)}, {len(totals)} handoffs, round trip p50 "
                  f"{benchlib.median(totals) / 1e3:.1f} us")
            rowsout = [[name, str(len(per[name])), f"{benchlib.median(per[name]) / 1e3:.1f}"]
                       for name in order]
            benchlib.print_table(["step", "n", "p50 us"], rowsout, align="<>>")
    return 0


if __name__ == "__main__":
    sys.exit(main())
