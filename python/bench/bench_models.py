#!/usr/bin/python3
"""bench_models: a 1 GiB safetensors checkpoint in tensord: load, attach, PSS, first forward.

Usage: /usr/bin/python3 python/bench/bench_models.py [--quick]
(starts its own tensord; see benchlib.py for where it finds the binary and the package).

The checkpoint: a stack of LAYERS nn.Linear(4096, 4096) layers, float32, seeded,
written with tensord.torch.save_safetensors (one file, 2 * LAYERS tensors) and
the same state dict with torch.save (a .pt), both in a fresh directory under
$TMPDIR (else /tmp), removed at the end: 16 layers, 1 GiB of weights and
256 KiB of biases ($TD_BENCH_SCALE, or --quick's 0.2, scales the layers, at
least 2, and the rounds, at least 3; never above 16 layers). Both files are read
once before anything is timed, so every row reads them from the page cache. The
ways are interleaved round by round (each round in a rotated order); torch runs
on one thread (torch.set_num_threads(1)) everywhere.

1. Load (ROUNDS rounds):
  cat                  `cat FILE` with stdout on /dev/null (fork + exec): what
                       reading the file at all costs; the baseline.
  tensorctl load       `tensorctl load FILE --as NAME --force --quiet --json`
                       (fork + exec), its wall time: a new version each round
                       (the previous one, held by nobody, is freed).
  tensorctl (its own)  the same runs, the "seconds" tensorctl reports itself
                       (td_model_load alone, without exec and connect).
  Client.load_model    Client.load_model(FILE, NAME, force=True) in this
                       process: the same load without a process of its own.
  torch.load(.pt)      torch.load of the .pt (every tensor read into private
                       memory of this process), then freed.
  Columns: p50 and p99 in ms (with fewer than 100 samples p99 is the maximum),
  GB/s of the checkpoint's bytes at the p50, and "speed vs cat": cat's p50
  over the row's (2.00: twice as fast as cat, 0.50: half as fast).

2. The N-th worker's attach (the model loaded; ROUNDS rounds, each one
   numpy.fromfile, one mmap + copy and ATTACHES of each attach way):
  numpy.fromfile       numpy.fromfile(FILE, dtype=uint8): the file read into
                       private memory; the baseline.
  mmap + copy          what the safetensors library does in pure Python: mmap
                       the file, parse the header, and per tensor
                       numpy.frombuffer(...).copy() into private memory.
  load_safetensors     tensord.torch.load_safetensors(FILE, name=NAME): finds
                       the model loaded from this file (Client.load_model sees
                       it unchanged) and attaches it (Client.open_model, a torch
                       tensor per tensor), in this process; released (every
                       mapping unmapped) before the next.
  Client.load_model    its first half alone: the unchanged check (the load
                       lock, the manifest read, the file's header read again).
  Client.open_model    its second half alone: the manifest's lookups, every
                       tensor of one version, lazily mapped; released.
  ... fresh process    load_safetensors as the first call of a new process
                       (one of section 3's K spawned workers, its client already
                       connected): median and maximum over the K.
  Columns: p50, p99 in ms, GB/s (copies only), and "vs fromfile":
  numpy.fromfile's p50 over the row's (how many times faster).

3. Memory: K = 4 worker processes (multiprocessing "spawn": nothing inherited
   from this process), for each way K new ones, loading one after another:
  tensord attach       load_safetensors(FILE, name=NAME), the module built
                       under tensord.torch.meta_device() and attach()ed to it.
  private torch.load   the module built normally (Net(): weights of its own),
                       then model.load_state_dict(torch.load(.pt)).
  Then each runs a forward pass (BATCH = 1 row: a decoder's step, every
  weight read once for little compute) and a second one.
  "load ms" is each worker's load (or attach) wall time, median over the K;
  "PSS +load" and "PSS +fwd" the sum over the K of what their Pss
  (/proc/PID/smaps_rollup) grew by from before the load to after it and after
  the forward pass, "/copy" that over the weights' bytes (one copy), "total PSS"
  the sum of the K workers' whole Pss after the forward pass and "/copy" that
  over one copy (interpreter, torch and all).

4. First forward pass (in this process; ROUNDS rounds): the same module and
   input (torch.ones(BATCH, 4096)), built each round as in section 3, after
   one untimed forward pass of a small Linear (torch's one-time set-up):
  attached             load_safetensors + meta_device + attach: the pages are
                       mapped lazily, so the first forward pass faults every
                       page of the weights into this process's page tables.
  attached, populated  Client.open_model(NAME, lazy=False) (each mapping
                       populated, MADV_POPULATE_READ, at its first use: in
                       the attach), a torch tensor per tensor, meta + attach.
  private              Net() + load_state_dict(torch.load(.pt)): the weights
                       written moments before.
  Columns: "load ms" the p50 of the load or attach (load_safetensors;
  open_model + torch tensors; torch.load + load_state_dict), p50 and p99 of
  the first forward pass after it, p50 of the second, "1st / private's" the
  first's p50 over the private way's, and "load + 1st fwd" the p50 of their sum
  (the time to a first output).

Targets (issue 19; reported, not enforced): tensorctl load >= 0.8x cat's speed;
the N-th worker's attach (load_safetensors, p50) <= 10 ms; the K attached
workers' PSS <= 1.2 copies of the weights.
"""

from __future__ import annotations

import gc
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import benchlib

K = 4
WIDTH = 4096
LAYERS = 16
ROUNDS = 7
ATTACHES = 10
BATCH = 1
NAME = "bench-models"


def make_net(layers: int):
    """Returns the module: layers nn.Linear(WIDTH, WIDTH) in an nn.Sequential, in eval mode."""
    import torch

    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)]).eval()


def timed(fn, *args, **kw) -> tuple[float, object]:
    """Returns (seconds fn(*args, **kw) took, its result)."""
    t0 = time.perf_counter()
    r = fn(*args, **kw)
    return time.perf_counter() - t0, r


def rss_shmem() -> int:
    """Returns this process's RssShmem (/proc/self/status) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    return 0


# ---- the ways ----

def cat(path: str) -> None:
    subprocess.run(["cat", path], stdout=subprocess.DEVNULL, check=True)


def tensorctl_load(tensorctl: str, path: str) -> float:
    """Runs tensorctl load --force; returns the seconds it reports."""
    out = subprocess.run([tensorctl, "load", path, "--as", NAME, "--force", "--quiet",
                          "--json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"tensorctl load failed ({out.returncode}): {out.stderr.strip()}")
    r = json.loads(out.stdout)
    if r.get("unchanged"):
        raise RuntimeError(f"tensorctl load --force did not load: {out.stdout.strip()}")
    return float(r["seconds"])


def fromfile(path: str):
    import numpy

    return numpy.fromfile(path, dtype=numpy.uint8)


ST_NUMPY = {"F64": "float64", "F32": "float32", "F16": "float16", "I64": "int64",
            "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def mmap_copy(path: str) -> dict:
    """Reads the checkpoint as the safetensors library does: mmap, header, a copy per tensor."""
    import numpy

    out = {}
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        n = int.from_bytes(mm[:8], "little")
        header = json.loads(mm[8:8 + n])
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            b, end = e["data_offsets"]
            dt = numpy.dtype(ST_NUMPY[e["dtype"]])
            v = numpy.frombuffer(mm, dtype=dt, count=(end - b) // dt.itemsize,
                                 offset=base + b)
            out[name] = v.copy().reshape(e["shape"])
            del v
    finally:
        mm.close()
    return out


def attached_module(tdt, path: str, layers: int, client):
    """Returns (seconds of load_safetensors, the module attached to the model's weights)."""
    dt, w = timed(tdt.load_safetensors, path, name=NAME, client=client)
    with tdt.meta_device():
        model = make_net(layers)
    tdt.attach(model, w)
    return dt, model


def private_module(pt: str, layers: int):
    """Returns (seconds of torch.load + load_state_dict, the module with its own weights)."""
    import torch

    model = make_net(layers)
    t0 = time.perf_counter()
    sd = torch.load(pt)
    model.load_state_dict(sd)
    dt = time.perf_counter() - t0
    del sd
    return dt, model


def forward(model) -> float:
    """Runs model(ones(BATCH, WIDTH)) without grad; returns the seconds it took."""
    import torch

    x = torch.ones(BATCH, WIDTH)
    with torch.no_grad():
        t0 = time.perf_counter()
        model(x)
        return time.perf_counter() - t0


# ---- the workers of section 3 ----

def worker_main(conn, socket_path: str) -> None:
    """A spawned worker: holds the model one way on command, answers its timings."""
    import torch

    torch.set_num_threads(1)
    import tensord
    import tensord.torch as tdt

    client = tensord.connect(socket_path)
    held = []

    def hold(way: str, path: str, pt: str, layers: int) -> dict:
        if way == "attach":
            dt, model = attached_module(tdt, path, layers, client)
        else:
            dt, model = private_module(pt, layers)
        gc.collect()
        held.append(model)
        return dt

    def fwd() -> tuple[float, float]:
        return forward(held[0]), forward(held[0])

    handlers = {"hold": hold, "fwd": fwd}
    gc.collect()
    conn.send(("ok", None))  # ready: the parent reads the baseline Pss now
    try:
        while True:
            cmd = conn.recv()
            if cmd[0] == "quit":
                break
            try:
                conn.send(("ok", handlers[cmd[0]](*cmd[1:])))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        held.clear()
        gc.collect()
        client.close()
    conn.send(("ok", None))


def run_workers(way: str, socket_path: str, path: str, pt: str, layers: int) -> dict:
    """Section 3 for one way: K fresh workers hold the model; returns their numbers."""
    workers: list[benchlib.Child] = []
    try:
        workers = [benchlib.Child(worker_main, socket_path, start="spawn") for _ in range(K)]
        for w in workers:
            w.reply()
        base = [benchlib.pss_bytes(w.pid) for w in workers]
        loads = [w.call("hold", way, path, pt, layers) for w in workers]
        # Each Pss is read after all K hold the model: a page's Pss is divided
        # by the processes that map it at the time it is read.
        pss_load = sum(benchlib.pss_bytes(w.pid) for w in workers)
        fwds = [w.call("fwd") for w in workers]
        pss_fwd = sum(benchlib.pss_bytes(w.pid) for w in workers)
        return {"load": loads, "pss_load": pss_load - sum(base),
                "pss_fwd": pss_fwd - sum(base), "total": pss_fwd,
                "fwd1": [r[0] for r in fwds], "fwd2": [r[1] for r in fwds]}
    finally:
        for w in workers:
            w.close()


# ---- the tables ----

def ms(s: float) -> str:
    return f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"


def row(label: str, samples: list[float], nbytes: int | None,
        base: list[float]) -> list[str]:
    """Returns a table row: label, n, p50, p99, GB/s at the p50 (if nbytes), base p50 / p50."""
    p50 = benchlib.median(samples)
    gbs = f"{nbytes / p50 / 1e9:.2f}" if nbytes else "-"
    return [label, str(len(samples)), ms(p50), ms(benchlib.pct(samples, 99)), gbs,
            benchlib.ratio_str(benchlib.median(base), p50)]


def main() -> int:
    args = benchlib.parse_args("a safetensors checkpoint: load, attach, memory, first forward")
    import torch

    torch.set_num_threads(1)
    tensord, tdt, why = benchlib.import_tensord()
    layers = max(2, min(LAYERS, round(LAYERS * args.scale)))
    rounds = max(3, round(ROUNDS * args.scale))
    wbytes = layers * WIDTH * WIDTH * 4
    # Page cache (2 files), the model in tensord, K private copies, and what
    # this process holds at once at most (torch.load's copy and a module's).
    need = (2 + 1 + K + 2) * wbytes
    avail = benchlib.meminfo("MemAvailable")
    tensorctl = os.path.join(benchlib.build_dir(), "client", "tensorctl")
    t_all = time.monotonic()
    with benchlib.Daemon() as d:
        print(d.header())
        if why:
            print(f"bench_models: skipped: {why}")
            return 1
        if not os.access(tensorctl, os.X_OK):
            print(f"bench_models: skipped: {tensorctl} not built")
            return 1
        if 0 <= avail < need:
            print(f"bench_models: skipped: {benchlib.size_str(avail)} of memory available, "
                  f"needs {benchlib.size_str(need)}")
            return 1
        tmp = tempfile.mkdtemp(prefix="tensord-bench-models.")
        client = None
        try:
            client = tensord.connect(d.socket)
            path = os.path.join(tmp, "model.safetensors")
            pt = os.path.join(tmp, "model.pt")
            torch.manual_seed(42)
            sd = make_net(layers).state_dict()
            tdt.save_safetensors(sd, path)
            torch.save(sd, pt)
            del sd
            gc.collect()
            nbytes = os.path.getsize(path)
            ntensors = 2 * layers
            cat(path)
            cat(pt)
            subprocess.run([tensorctl, "load", path, "--as", NAME, "--quiet"], check=True,
                           stdout=subprocess.DEVNULL)
            timed(torch.load, pt)  # warms torch.load's code; the result is dropped
            gc.collect()
            print(f"\nbench_models: {layers} x Linear({WIDTH}, {WIDTH}), float32, {ntensors} "
                  f"tensors, {benchlib.size_str(wbytes)} of weights; the .safetensors "
                  f"{nbytes / 1e6:.1f} MB, the .pt {os.path.getsize(pt) / 1e6:.1f} MB; "
                  f"{rounds} rounds, torch on 1 thread\n")

            # 1. Load.
            t = {k: [] for k in ("cat", "ctl", "ctl_own", "client", "torch")}

            def do_cat():
                t["cat"].append(timed(cat, path)[0])

            def do_ctl():
                dt, own = timed(tensorctl_load, tensorctl, path)
                t["ctl"].append(dt)
                t["ctl_own"].append(own)

            def do_client():
                dt, r = timed(client.load_model, path, NAME, force=True)
                if r["unchanged"]:
                    raise RuntimeError(f"Client.load_model(force=True) did not load: {r}")
                t["client"].append(dt)

            def do_torch():
                dt, sd = timed(torch.load, pt)
                t["torch"].append(dt)
                del sd
                gc.collect()

            ways = [do_cat, do_ctl, do_client, do_torch]
            for r in range(rounds):
                for fn in ways[r % len(ways):] + ways[:r % len(ways)]:
                    fn()
            print(f"  1. load {benchlib.size_str(wbytes)} of safetensors, from the page cache\n")
            benchlib.print_table(
                ["way", "n", "p50 ms", "p99 ms", "GB/s", "speed vs cat"],
                [row("cat FILE >/dev/null", t["cat"], nbytes, t["cat"]),
                 row("tensorctl load --force", t["ctl"], nbytes, t["cat"]),
                 row("  (tensorctl's own seconds)", t["ctl_own"], nbytes, t["cat"]),
                 row("Client.load_model(force=True)", t["client"], nbytes, t["cat"]),
                 row("torch.load(.pt)", t["torch"], nbytes, t["cat"])])

            # 2. The N-th worker's attach.
            a = {k: [] for k in ("fromfile", "mmap", "lst", "lm", "om")}
            shm0 = rss_shmem()
            leaks = []

            def do_fromfile():
                dt, arr = timed(fromfile, path)
                a["fromfile"].append(dt)
                del arr

            def do_mmap():
                dt, arrs = timed(mmap_copy, path)
                a["mmap"].append(dt)
                del arrs

            def do_attach():
                for _ in range(ATTACHES):
                    dt, w = timed(tdt.load_safetensors, path, name=NAME, client=client)
                    a["lst"].append(dt)
                    del w
                    dt, r = timed(client.load_model, path, NAME)
                    if not r["unchanged"]:
                        raise RuntimeError(f"Client.load_model loaded again: {r}")
                    a["lm"].append(dt)
                    dt, (_, _, items) = timed(client.open_model, NAME)
                    a["om"].append(dt)
                    for _, x in items:
                        x.release()
                    del items
                gc.collect()
                if rss_shmem() > shm0 + (64 << 20):
                    leaks.append(rss_shmem() - shm0)

            ways = [do_fromfile, do_mmap, do_attach]
            for r in range(rounds):
                for fn in ways[r % len(ways):] + ways[:r % len(ways)]:
                    fn()
                gc.collect()

            # 3. Memory (its workers' first call is section 2's fresh-process row).
            mem = {"attach": run_workers("attach", d.socket, path, pt, layers),
                   "private": run_workers("private", d.socket, path, pt, layers)}

            print(f"\n  2. the N-th worker's attach of the loaded model ({ATTACHES} attaches "
                  f"of each kind per round)\n")
            fresh = mem["attach"]["load"]
            benchlib.print_table(
                ["way", "n", "p50 ms", "p99 ms", "GB/s", "vs fromfile"],
                [row("numpy.fromfile(FILE, uint8)", a["fromfile"], nbytes, a["fromfile"]),
                 row("mmap + frombuffer().copy()", a["mmap"], nbytes, a["fromfile"]),
                 row("load_safetensors(FILE, name)", a["lst"], None, a["fromfile"]),
                 row("  Client.load_model (unchanged)", a["lm"], None, a["fromfile"]),
                 row("  Client.open_model", a["om"], None, a["fromfile"]),
                 row("load_safetensors, fresh process", fresh, None, a["fromfile"])])
            if leaks:
                print(f"  (warning: after releasing, this process still mapped "
                      f"{benchlib.size_str(max(leaks))} more shared memory than before)")

            print(f"\n  3. memory: K = {K} worker processes each holding the model; one copy "
                  f"= {benchlib.size_str(wbytes)}\n")
            rows = []
            for way, label in (("attach", "tensord attach (meta + attach)"),
                               ("private", "private (Net() + torch.load)")):
                m = mem[way]
                rows.append([label, str(K), ms(benchlib.median(m["load"])),
                             f"{m['pss_load'] / 1e6:.1f} MB", f"{m['pss_fwd'] / 1e6:.1f} MB",
                             f"{m['pss_fwd'] / wbytes:.2f}", f"{m['total'] / 1e6:.1f} MB",
                             f"{m['total'] / wbytes:.2f}",
                             ms(benchlib.median(m["fwd1"])), ms(benchlib.median(m["fwd2"]))])
            benchlib.print_table(["way", "K", "load ms", "PSS +load", "PSS +fwd", "/copy",
                                  "total PSS", "/copy", "1st fwd ms", "2nd fwd ms"], rows)

            # 4. First forward pass.
            f = {w: {"load": [], "f1": [], "f2": []} for w in ("a", "pop", "p")}
            lazy = []

            def first_forward(way: str, build) -> None:
                dt, model = build()
                gc.collect()
                s0 = rss_shmem()
                f[way]["load"].append(dt)
                f[way]["f1"].append(forward(model))
                if way == "a":
                    lazy.append(rss_shmem() - s0)
                f[way]["f2"].append(forward(model))
                del model
                gc.collect()

            def build_populated():
                t0 = time.perf_counter()
                _, _, items = client.open_model(NAME, lazy=False)
                try:
                    w = {n: x.torch() for n, x in items}
                finally:
                    for _, x in items:
                        x.release()
                    del items
                dt = time.perf_counter() - t0
                with tdt.meta_device():
                    model = make_net(layers)
                tdt.attach(model, w)
                return dt, model

            forward(torch.nn.Linear(WIDTH, 64).eval())
            ways = [lambda: first_forward("a", lambda: attached_module(tdt, path, layers,
                                                                       client)),
                    lambda: first_forward("pop", build_populated),
                    lambda: first_forward("p", lambda: private_module(pt, layers))]
            for r in range(rounds):
                for fn in ways[r % len(ways):] + ways[:r % len(ways)]:
                    fn()
            print(f"\n  4. first forward pass, batch {BATCH}, in this process (attached: "
                  f"{benchlib.median(lazy) / 1e6:.1f} MB of shared pages mapped by the "
                  f"first forward pass, median)\n")
            rows = []
            p1 = benchlib.median(f["p"]["f1"])
            for k, label in (("a", "attached (load_safetensors)"),
                             ("pop", "attached, populated (lazy=False)"),
                             ("p", "private (Net() + torch.load)")):
                s1, s2 = f[k]["f1"], f[k]["f2"]
                both = [x + y for x, y in zip(f[k]["load"], s1)]
                rows.append([label, str(len(s1)), ms(benchlib.median(f[k]["load"])),
                             ms(benchlib.median(s1)), ms(benchlib.pct(s1, 99)),
                             ms(benchlib.median(s2)), benchlib.ratio_str(benchlib.median(s1), p1),
                             ms(benchlib.median(both))])
            benchlib.print_table(["way", "n", "load ms", "1st fwd p50 ms", "p99 ms",
                                  "2nd fwd ms", "1st / private's", "load + 1st fwd ms"], rows)

            print("\n  targets (reported, not enforced):")
            x = benchlib.median(t["cat"]) / benchlib.median(t["ctl"])
            print(f"    tensorctl load >= 0.8x cat's speed (wall, p50): {x:.2f}x -> "
                  f"{'met' if x >= 0.8 else 'MISSED'}")
            x = benchlib.median(t["cat"]) / benchlib.median(t["ctl_own"])
            print(f"    (tensorctl's own seconds: {x:.2f}x -> {'met' if x >= 0.8 else 'MISSED'})")
            x = benchlib.median(a["lst"]) * 1e3
            print(f"    N-th worker's attach <= 10 ms (load_safetensors, p50): {x:.2f} ms -> "
                  f"{'met' if x <= 10 else 'MISSED'}")
            x = benchlib.median(fresh) * 1e3
            print(f"    (in a fresh process, median of {K}: {x:.2f} ms -> "
                  f"{'met' if x <= 10 else 'MISSED'})")
            x = mem["attach"]["pss_fwd"] / wbytes
            print(f"    {K} attached workers' PSS <= 1.2x one copy: {x:.2f}x -> "
                  f"{'met' if x <= 1.2 else 'MISSED'}")
        finally:
            if client is not None:
                try:
                    client.unload_model(NAME)
                except Exception:
                    pass
                client.close()
            shutil.rmtree(tmp, ignore_errors=True)
        print(f"\n  (bench_models.py: {time.monotonic() - t_all:.0f} s)")
    return 1 if d.failed else 0


if __name__ == "__main__":
    sys.exit(main())
