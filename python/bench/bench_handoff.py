#!/usr/bin/python3
"""bench_handoff: a tensor from a producer process to a consumer process, torch's way and tensord's.

Usage: /usr/bin/python3 python/bench/bench_handoff.py [--quick]
(starts its own tensord; see benchlib.py for where it finds the binary and the package).

What is measured. One handoff is a round trip: the producer takes t0, hands a
uint8 tensor of N bytes to a consumer process (its own child), the consumer
receives it, reads it, drops it and writes one byte of acknowledgement on a pipe;
the producer takes t1 when that byte arrives. The sample is t1 - t0. The
acknowledgement carries the consumer's check of the bytes it read (the producer
writes the handoff's own value into them), so a stale mapping fails the run.

Two cases, for N = 4 KiB, 64 KiB, 1 MiB, 16 MiB, 64 MiB, 256 MiB:
  (a) "again": a tensor already in shared memory, held by the producer, is sent
      again. The producer writes the handoff's value into its first and last
      byte before t0; the consumer reads those two bytes.
  (b) "fresh": after t0 the producer makes a new batch of N bytes in shared
      memory, fills it (every byte), and hands it off; the consumer reads every
      byte (a memcpy into a private buffer it made once) before it acknowledges.

Paths (each a producer process with its own consumer, forked after its set-up):
  torch-fd   torch.multiprocessing.Queue, sharing strategy file_descriptor
             (torch's default). (a): tensor.share_memory_() once. (b): the
             batch is made the way DataLoader workers make theirs, straight in
             shared memory: UntypedStorage._new_shared(N), then fill_.
  torch-fs   the same with the file_system strategy.
  td-queue   the same torch.multiprocessing.Queue after tensord.torch.install()
             in both processes: the tensor crosses as a tensord reference.
             (a): a tensor made once by client.empty(N).torch(). (b):
             client.empty(N, uninit=True).torch(), then fill_.
  td-raw     no queue: tensord's own publish / lookup(take=True). (a): the
             producer publishes the Tensor it holds; (b): client.empty(N,
             uninit=True), fill_ through .torch(), publish, release. The
             consumer looks the key up with take=True and reads through .numpy().
  td-chan    a tensord channel (Client.channel) with two slots of N bytes,
             made for each case and N: the producer loans a slot, writes it
             through .numpy() and sends it; no daemon call, no socket. (a):
             the slots are already in shared memory and the producer writes
             the two bytes the consumer reads (a send hands the slot over, so
             "again" is the next loan of a slot); (b): it fills every byte.
             The consumer receives, reads through .numpy() and releases (the
             slot goes back to the ring).
  msg        the floor, in case (a)'s rounds only: no tensor, the producer writes
             8 bytes (the value) on a pipe, the consumer reads them and
             acknowledges. Two wake-ups of a blocked process, the least any
             round trip here costs; one row for all N.
Every consumer reads through numpy (x.numpy() for torch tensors) and drops what
it got before it acknowledges, so the round trip includes the release.

Noise. The producer is pinned to one CPU and its consumer to another (tensord
is left to the scheduler), as in tests/bench/bench_handoff.c; torch runs one
thread in each. The four paths run round by round, a block of handoffs each in
turn, so that their ratios compare samples taken under the same load.

Columns: n samples, p50 and p99 in microseconds (nearest rank; with fewer than
100 samples p99 is the maximum), and p50 over the p50 of torch's faster strategy
for that N and case ("/torch"; 0.25 is 4x faster), and p50 over msg's p50
("/msg"). Targets (issue 9): (a) >= 4x faster than torch's faster strategy at
every N; (b) >= 2x at N >= 16 MiB; (issue 22) td-chan >= 5x faster than
torch-fs at every N, in both cases. python/bench/profile_handoff.py shows where
case (a)'s time goes, step by step.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import select
import struct
import sys
import time
import traceback

import benchlib

KEY = "bench/handoff"
SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
FLOOR = "msg"
TORCH_PATHS = ["torch-fd", "torch-fs"]
TD_PATHS = ["td-queue", "td-raw", "td-chan"]
CTL = struct.Struct("<BqqI")  # case (0 stop, 1 a, 2 b), N, first seq, count
ACK_TIMEOUT = 60.0


def value_of(seq: int) -> int:
    """Returns the byte written in handoff seq: 1..255, never 0."""
    return seq % 255 + 1


# ---- the consumer (a child of its producer) ----

def consumer_main(path: str, q, ctl_r: int, ack_w: int, data_r: int, cpu: int) -> None:
    """Receives handoffs as the ctl pipe announces them, checks them, acknowledges each."""
    import numpy as np
    import torch

    benchlib.pin(cpu)
    torch.set_num_threads(1)
    client = None
    if path.startswith("td-"):
        import tensord
        client = tensord.connect(os.environ["TENSORD_SOCKET"])
        if path == "td-queue":
            import tensord.torch as tdt
            tdt.install(client)
    dst = np.zeros(0, dtype=np.uint8)
    chan, chan_n = None, 0
    while True:
        head = os.read(ctl_r, CTL.size)
        if len(head) != CTL.size:
            break
        case, n, seq, count = CTL.unpack(head)
        if case == 0:
            break
        if case == 2 and dst.size < n:
            dst = np.ones(n, dtype=np.uint8)  # made once, every page touched
        if path == "td-chan" and chan_n != (case, n):
            if chan is not None:
                chan.close()
            chan = client.channel(chan_name(case, n), side="recv", timeout=60)
            chan_n = (case, n)
        for i in range(count):
            v = value_of(seq + i)
            if path == FLOOR:
                ok = int.from_bytes(os.read(data_r, 8), "little") == v
                os.write(ack_w, b"\0" if ok else b"\1")
                continue
            if path == "td-raw":
                t = client.lookup(KEY, take=True)
                a = t.numpy()
            elif path == "td-chan":
                t = chan.recv()
                a = t.numpy()
            else:
                t = q.get()
                a = t.numpy()
            if case == 1:
                ok = a[0] == v and a[n - 1] == v
            else:
                np.copyto(dst[:n], a)
                ok = dst[0] == v and dst[n - 1] == v and dst[n // 2] == v
            ok = ok and a.size == n
            del a
            if path in ("td-raw", "td-chan"):
                t.release()
            del t
            os.write(ack_w, b"\0" if ok else b"\1")
    if chan is not None:
        chan.close()
    if client is not None:
        client.close()


def chan_name(case: int, n: int) -> str:
    return f"bench/chan/{case}/{n}"


# ---- the producer (a child of the main process) ----

class Producer:
    """One path's producer: sets the path up, forks its consumer, runs handoffs on command."""

    def __init__(self, path: str, cpus: tuple[int, int]) -> None:
        import torch
        import torch.multiprocessing as tmp

        self.path = path
        self.torch = torch
        benchlib.pin(cpus[0])
        torch.set_num_threads(1)
        self.client = None
        self.tensord = None
        if path == "torch-fd":
            tmp.set_sharing_strategy("file_descriptor")
        elif path == "torch-fs":
            tmp.set_sharing_strategy("file_system")
        elif path != FLOOR:
            import tensord
            self.tensord = tensord
            self.client = tensord.connect(os.environ["TENSORD_SOCKET"])
            if path == "td-queue":
                import tensord.torch as tdt
                tdt.install(self.client)
        ctx = tmp.get_context("fork")
        self.q = ctx.Queue() if path in TORCH_PATHS or path == "td-queue" else None
        ctl_r, self.ctl_w = os.pipe()
        self.ack_r, ack_w = os.pipe()
        data_r, self.data_w = os.pipe()
        self.consumer = ctx.Process(target=consumer_main,
                                    args=(path, self.q, ctl_r, ack_w, data_r, cpus[1]),
                                    daemon=True, name=f"consumer {path}")
        self.consumer.start()
        os.close(ctl_r)
        os.close(ack_w)
        os.close(data_r)
        self.seq = 0
        self.chan = None      # td-chan: the channel of the current N
        self.chan_n = 0
        self.held = None      # (a): the shared tensor (torch.Tensor or tensord.Tensor)
        self.held_arr = None  # (a): a numpy view of it, to write the two bytes

    def prep(self, case: int, n: int) -> None:
        """Makes case (a)'s shared tensor of n bytes (case b needs nothing)."""
        torch = self.torch
        self.held = self.held_arr = None
        if self.path == "td-chan" and self.chan_n != (case, n):
            if self.chan is not None:
                self.chan.close()
            self.chan, self.chan_n = None, 0
            if n > 0:
                self.chan = self.client.channel(chan_name(case, n), capacity=4,
                                                slots=2, slot_bytes=n, side="send")
                self.chan_n = (case, n)
        if case != 1 or self.path in (FLOOR, "td-chan"):
            return
        if self.path in TORCH_PATHS:
            self.held = torch.empty(n, dtype=torch.uint8).share_memory_()
            self.held_arr = self.held.numpy()
        elif self.path == "td-queue":
            self.held = self.client.empty(n, dtype="uint8").torch()
            self.held_arr = self.held.numpy()
        else:
            self.held = self.client.empty(n, dtype="uint8")
            self.held_arr = self.held.numpy()

    def wait_ack(self) -> None:
        r, _, _ = select.select([self.ack_r], [], [], ACK_TIMEOUT)
        b = os.read(self.ack_r, 1) if r else b""
        if b != b"\0":
            why = ("no acknowledgement in %.0f s" % ACK_TIMEOUT if not r else
                   "the consumer went away" if not b else
                   "the consumer read bytes other than those written")
            raise RuntimeError(f"{self.path}: handoff {self.seq}: {why}")

    def run(self, case: int, n: int, count: int) -> list[float]:
        """Runs count handoffs of case on n bytes; returns their round trips in ns."""
        torch = self.torch
        os.write(self.ctl_w, CTL.pack(case, n, self.seq, count))
        out = []
        path, q, client = self.path, self.q, self.client
        now = time.monotonic_ns
        for _ in range(count):
            v = value_of(self.seq)
            if path == FLOOR:
                t0 = now()
                os.write(self.data_w, v.to_bytes(8, "little"))
            elif case == 1 and path == "td-chan":
                s = self.chan.loan()
                a = s.numpy()
                a[0] = v
                a[n - 1] = v
                del a
                t0 = now()
                self.chan.send(s)
            elif case == 1:
                a = self.held_arr
                a[0] = v
                a[n - 1] = v
                t0 = now()
                if path == "td-raw":
                    client.publish(KEY, self.held)
                else:
                    q.put(self.held)
            elif path in TORCH_PATHS:
                t0 = now()
                x = torch.empty(0, dtype=torch.uint8).set_(
                    torch.UntypedStorage._new_shared(n))
                x.fill_(v)
                q.put(x)
                del x
            elif path == "td-queue":
                t0 = now()
                x = client.empty(n, dtype="uint8", uninit=True).torch()
                x.fill_(v)
                q.put(x)
                del x
            elif path == "td-chan":
                t0 = now()
                s = self.chan.loan()
                s.numpy().fill(v)
                self.chan.send(s)
            else:
                t0 = now()
                t = client.empty(n, dtype="uint8", uninit=True)
                t.torch().fill_(v)
                client.publish(KEY, t)
                t.release()
            self.wait_ack()
            out.append(now() - t0)
            self.seq += 1
        return out

    def quit(self) -> None:
        self.held = self.held_arr = None
        if self.chan is not None:
            self.chan.close()
            self.chan = None
        try:
            os.write(self.ctl_w, CTL.pack(0, 0, 0, 0))
        except OSError:
            pass
        os.close(self.ctl_w)
        os.close(self.data_w)
        self.consumer.join(10)
        if self.consumer.is_alive():
            self.consumer.kill()
            self.consumer.join()
        if self.q is not None:
            self.q.close()
            self.q.join_thread()
        if self.client is not None:
            self.client.close()


def producer_main(path: str, cpus: tuple[int, int], conn) -> None:
    """Serves the main process's commands over conn until "quit"."""
    try:
        p = Producer(path, cpus)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd = conn.recv()
        try:
            if cmd[0] == "prep":
                p.prep(cmd[1], cmd[2])
                res = None
            elif cmd[0] == "run":
                res = p.run(cmd[1], cmd[2], cmd[3])
            elif cmd[0] == "quit":
                p.quit()
                conn.send(("ok", None))
                return
            else:
                raise ValueError(f"unknown command {cmd!r}")
            conn.send(("ok", res))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
            try:
                p.quit()
            finally:
                return


class Remote:
    """The main process's handle on one path's producer."""

    def __init__(self, path: str, cpus: tuple[int, int]) -> None:
        ctx = multiprocessing.get_context("fork")
        self.path = path
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=producer_main, args=(path, cpus, child),
                                name=f"producer {path}")
        self.proc.start()
        child.close()
        self._reply()

    def _reply(self):
        if not self.conn.poll(300):
            raise RuntimeError(f"{self.path}: the producer did not answer in 300 s")
        status, res = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.path}: the producer failed:\n{res}")
        return res

    def call(self, *cmd):
        self.conn.send(cmd)
        return self._reply()

    def close(self) -> None:
        try:
            if self.proc.is_alive():
                self.call("quit")
        except (RuntimeError, OSError, EOFError) as e:
            print(f"bench_handoff: {e}", file=sys.stderr)
        self.proc.join(20)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()


# ---- budgets, rounds and the table ----

def budget(case: int, n: int, scale: float) -> tuple[int, int, int, float]:
    """Returns (warm-up, min, max samples per path, seconds for all paths) for case on n bytes.

    scale < 1 (--quick) shortens the seconds and lowers the minimum, to 3 at least.
    """
    if case == 1:
        b = (20, 50, 3000, 3.0) if n <= (16 << 20) else (5, 30, 1000, 3.0)
    elif n <= (1 << 20):
        b = (10, 50, 2000, 3.0)
    elif n <= (16 << 20):
        b = (3, 15, 500, 4.0)
    elif n <= (64 << 20):
        b = (2, 8, 200, 6.0)
    else:
        b = (1, 6, 100, 10.0)
    warm, lo, hi, sec = b
    if scale < 1:
        lo = max(3, int(lo * scale * 2))
    return warm, lo, hi, sec * scale


def measure(remotes: list[Remote], case: int, n: int, scale: float) -> dict[str, list[float]]:
    """Runs case on n bytes on every path, round by round; returns samples (ns) per path.

    The floor (msg) runs in case (a) only.
    """
    remotes = [r for r in remotes if case == 1 or r.path != FLOOR]
    warm, lo, hi, seconds = budget(case, n, scale)
    for r in remotes:
        r.call("prep", case, n)
    est: dict[str, float] = {}
    for r in remotes:
        w = r.call("run", case, n, warm)
        est[r.path] = benchlib.median(w) if w else 1e6
    samples: dict[str, list[float]] = {r.path: [] for r in remotes}
    t_start = time.monotonic()
    rnd = 0
    while True:
        done_min = all(len(s) >= lo for s in samples.values())
        if done_min and time.monotonic() - t_start >= seconds:
            break
        if all(len(s) >= hi for s in samples.values()):
            break
        k = len(remotes)
        for j in range(k):
            r = remotes[(rnd + j) % k]
            have = len(samples[r.path])
            if have >= hi:
                continue
            # A block of about 40 ms of handoffs, at least one, at most 64.
            count = max(1, min(64, int(0.04e9 / max(est[r.path], 1.0)), hi - have))
            got = r.call("run", case, n, count)
            samples[r.path] += got
            est[r.path] = benchlib.median(got)
        rnd += 1
    for r in remotes:
        r.call("prep", 0, 0)  # drops (a)'s tensor
    return samples


def us(ns: float) -> str:
    return "-" if math.isnan(ns) else f"{ns / 1e3:.1f}"


def main() -> int:
    args = benchlib.parse_args("tensor handoff between processes: torch.multiprocessing vs tensord")
    tensord, tdt, why = benchlib.import_tensord()
    paths = [FLOOR] + TORCH_PATHS
    if why is None:
        paths += TD_PATHS
    elif tensord is not None:
        paths.append("td-raw")
    sizes = SIZES  # --quick shortens the budgets, not the list
    t_all = time.monotonic()
    with benchlib.Daemon() as d:
        print(d.header())
        if why:
            print(f"bench_handoff: tensord rows skipped or partial: {why}")
        cpus = benchlib.cpu_pair()
        remotes: list[Remote] = []
        results: dict[tuple[int, int], dict[str, list[float]]] = {}
        try:
            for p in paths:
                remotes.append(Remote(p, cpus))
            for n in sizes:
                for case in (1, 2):
                    results[(case, n)] = measure(remotes, case, n, args.scale)
        finally:
            for r in remotes:
                r.close()
        print("\nbench_handoff: producer -> consumer (another process) and an "
              "acknowledgement back\nthrough a pipe; round trip, microseconds")
        if cpus[0] >= 0:
            print(f"(producers on CPU {cpus[0]}, consumers on CPU {cpus[1]}, tensord "
                  "unpinned; paths interleaved\nround by round; torch.set_num_threads(1))")
        msg = [x for n in sizes for x in results[(1, n)].get(FLOOR, [])]
        msg50 = benchlib.pct(msg, 50)
        targets: dict[int, list[str]] = {1: [], 2: []}
        chan_cells: list[str] = []
        chan_met = True
        met = {1: True, 2: True}
        any_td = {1: False, 2: False}
        for case, title in ((1, "(a) an already-shared tensor sent again; the consumer reads "
                                "its first and last byte"),
                            (2, "(b) a fresh batch of N bytes filled and handed off; the "
                                "consumer reads every byte")):
            print(f"\n{title}\n")
            rows = []
            if case == 1 and msg:
                rows.append(["-", FLOOR, str(len(msg)), us(msg50), us(benchlib.pct(msg, 99)),
                             "-", benchlib.ratio_str(msg50, msg50)])
            for n in sizes:
                s = results[(case, n)]
                p50 = {p: benchlib.pct(v, 50) for p, v in s.items()}
                best = min((p50[p] for p in TORCH_PATHS), default=math.nan)
                first = True
                for p in paths:
                    if p not in s:
                        continue
                    rows.append([benchlib.size_str(n) if first else "", p, str(len(s[p])),
                                 us(p50[p]), us(benchlib.pct(s[p], 99)),
                                 benchlib.ratio_str(p50[p], best),
                                 benchlib.ratio_str(p50[p], msg50)])
                    first = False
                cells = []
                for p in TD_PATHS:
                    if p not in p50 or p == "td-chan":
                        continue
                    x = best / p50[p]
                    cells.append(f"{p} {x:.1f}x")
                    want = 4.0 if case == 1 else 2.0
                    if case == 1 or n >= (16 << 20):
                        any_td[case] = True
                        met[case] &= x >= want
                if cells and (case == 1 or n >= (16 << 20)):
                    targets[case].append(f"{benchlib.size_str(n)}: " + ", ".join(cells))
                if "td-chan" in p50 and "torch-fs" in p50:
                    x = p50["torch-fs"] / p50["td-chan"]
                    chan_cells.append(f"({'ab'[case - 1]}) {benchlib.size_str(n)} {x:.1f}x")
                    chan_met &= x >= 5.0
            benchlib.print_table(["N", "path", "n", "p50 us", "p99 us", "/torch", "/msg"], rows)
        print("\n  targets (reported, not enforced): speed-up = torch's faster p50 / tensord p50")
        for case, text in ((1, "(a) >= 4x at every N"), (2, "(b) >= 2x at N >= 16 MiB")):
            verdict = "n/a" if not any_td[case] else "met" if met[case] else "MISSED"
            print(f"    {text} -> {verdict}")
            for line in targets[case]:
                print(f"      {line}")
            if case == 1 and msg:
                best = min(benchlib.pct(results[(1, n)][p], 50) for n in sizes
                           for p in TORCH_PATHS)
                print(f"      (4x torch's fastest p50 of any N is {best / 4e3:.1f} us; the bare "
                      f"msg round trip {msg50 / 1e3:.1f} us)")
        if chan_cells:
            print("    td-chan >= 5x faster than torch-fs (p50), every N, both cases -> "
                  + ("met" if chan_met else "MISSED"))
            for i in range(0, len(chan_cells), 6):
                print("      " + ", ".join(chan_cells[i:i + 6]))
        print(f"\n  (bench_handoff.py: {time.monotonic() - t_all:.0f} s)")
    return 1 if (d.failed or why) else 0


if __name__ == "__main__":
    sys.exit(main())
