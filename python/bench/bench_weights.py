#!/usr/bin/python3
"""bench_weights: K processes holding one model's weights, torch.load each vs tensord shared.

Usage: /usr/bin/python3 python/bench/bench_weights.py [--quick]
(starts its own tensord; see benchlib.py for where it finds the binary and the package).

The model: a stack of LAYERS nn.Linear(2048, 2048) layers, float32, seeded:
30 layers, 503.6 MB (--quick: 4 layers, 67.1 MB). A builder process makes it and
hands it on; K = 4 reader processes, forked from the main process before any
model exists (so that they share none of its pages through fork), then load it
one after another:
  torch    the builder torch.save()s the state dict to a file in /tmp (removed
           at the end) and exits; each reader torch.load()s the file.
  tensord  the builder publishes it with tensord.torch.publish_state_dict() and
           exits (the key holds the storage, and the builder's mapping goes
           with it); each reader calls tensord.torch.load_state_dict(client,
           prefix) (readonly=True: copy-on-write mappings).
Every reader then reads every tensor once (a sum over each: every page touched,
as serving the model would) and checks three elements of each against the
builder's, and keeps its state dict while the PSS is read.

Then serving an nn.Module over the shared weights (tensord only; fresh readers
for each way): each reader builds the model as a module, loads the state dict
with load_state_dict(client, prefix), and runs one forward pass (a batch of 8):
  Net() + functional_call     the module built on the CPU (its own randomly
                              initialised weights, never used), run with
                              torch.nn.utils.stateless.functional_call on the
                              shared tensors
  meta + functional_call      the module built on the meta device (shapes, no
                              memory), run the same way: what docs/python.md
                              and docs/examples/shared_weights.py do
  Net() + load_state_dict     the module built on the CPU, then
                              model.load_state_dict(sd): copies the shared
                              tensors into the module's own
  meta + attach               the module built on the meta device, bound to
                              the shared tensors with tensord.torch.attach
                              and called as itself (docs/python.md)
  Net() + attach              the module built on the CPU, then attach():
                              its own weights are freed
"PSS" and "/copy" as above; "total PSS" the sum of the readers' whole Pss.

Columns: "PSS" is the sum over the K readers of (Pss from /proc/PID/smaps_rollup
holding the model - Pss before the first load), and "/copy" that sum over one
copy's bytes. "1st load ms" is the wall time of each reader's first torch.load /
load_state_dict (for tensord: the attach, which maps the storage; no byte read
by the caller), median and maximum over the K readers; "again ms" the median of
LOADS - 1 further load_state_dict calls per reader while it holds the first (its
mapping is then reused); "read ms" the median time of the first pass over the
loaded tensors (a sum over each). Targets (issue 9): tensord's PSS <= 1.2x one
copy, and its attach (the first load_state_dict of a process) <= 10 ms.
"""

from __future__ import annotations

import gc
import os
import sys
import tempfile
import time
import traceback

import benchlib

K = 4
WIDTH = 2048
LOADS = 5
PREFIX = "bench/weights/"


def build_model(layers: int):
    """Returns the seeded state dict of layers Linear(WIDTH, WIDTH) layers."""
    import torch

    torch.manual_seed(42)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    return model.state_dict()


def probes(sd) -> dict[str, tuple]:
    """Returns, per tensor, (dtype, shape, first, middle and last element) to check a copy by."""
    out = {}
    for k, v in sd.items():
        f = v.reshape(-1)
        n = f.numel()
        out[k] = (str(v.dtype), tuple(v.shape), float(f[0]), float(f[n // 2]), float(f[n - 1]))
    return out


def read_all(sd) -> float:
    """Reads every byte of every tensor once (a sum over each); returns the seconds it took."""
    t0 = time.perf_counter()
    for v in sd.values():
        v.sum()
    return time.perf_counter() - t0


# ---- child processes ----

def serve(conn, handlers) -> None:
    """Answers (name, *args) commands on conn with handlers[name](*args) until "quit"."""
    while True:
        cmd = conn.recv()
        if cmd[0] == "quit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", handlers[cmd[0]](*cmd[1:])))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


def builder_main(conn, layers: int, mode: str, path: str) -> None:
    """Builds the model, saves (torch) or publishes (tensord) it, answers its size and exits."""
    import torch

    torch.set_num_threads(1)
    client = None
    try:
        if mode == "tensord":
            import tensord
            import tensord.torch as tdt
            client = tensord.connect(os.environ["TENSORD_SOCKET"])
        sd = build_model(layers)
        nbytes = sum(v.numel() * v.element_size() for v in sd.values())
        info = {"nbytes": nbytes, "ntensors": len(sd), "probes": probes(sd)}
        if mode == "torch":
            torch.save(sd, path)
        else:
            tdt.publish_state_dict(client, PREFIX, sd)
            client.close()
        conn.send(("ok", info))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def reader_main(conn, mode: str) -> None:
    """Loads the model on command; keeps what it loaded until "drop"."""
    import torch

    torch.set_num_threads(1)
    client = tdt = None
    if mode == "tensord":
        import tensord
        import tensord.torch as tdt
        client = tensord.connect(os.environ["TENSORD_SOCKET"])
    held = []

    def load(src: str, keep: bool, want: dict) -> tuple[float, float]:
        gc.collect()
        t0 = time.perf_counter()
        if mode == "torch":
            sd = torch.load(src)
        else:
            sd = tdt.load_state_dict(client, src, readonly=True)
        dt = time.perf_counter() - t0
        rt = read_all(sd)
        got = probes(sd)
        if got != want:
            bad = [k for k in want if got.get(k) != want[k]][:3]
            raise RuntimeError(f"loaded tensors differ from the builder's: {bad} "
                               f"(of {len(want)}; {len(got)} loaded)")
        if keep:
            held.append(sd)
        del sd
        return dt, rt

    def module(how: str, src: str, layers: int) -> None:
        from torch.nn.utils.stateless import functional_call

        device = "meta" if how in ("meta", "attach_meta") else None
        model = torch.nn.Sequential(
            *[torch.nn.Linear(WIDTH, WIDTH, device=device) for _ in range(layers)]
        ).eval()
        sd = tdt.load_state_dict(client, src, readonly=True)
        x = torch.ones(8, WIDTH)
        with torch.no_grad():
            if how == "load_state_dict":
                model.load_state_dict(sd)
                model(x)
            elif how.startswith("attach"):
                tdt.attach(model, sd)
                gc.collect()
                model(x)
            else:
                functional_call(model, sd, (x,))
        held.append((model, sd))

    def drop() -> None:
        held.clear()
        gc.collect()

    gc.collect()
    conn.send(("ok", None))  # ready: the main process reads the baseline Pss now
    serve(conn, {"load": load, "module": module, "drop": drop})
    drop()
    if client is not None:
        client.close()


def run_mode(mode: str, layers: int) -> dict:
    """Measures one mode; returns its numbers."""
    readers: list[benchlib.Child] = []
    builder = None
    fd, path = tempfile.mkstemp(prefix="tensord-bench-weights.", suffix=".pt", dir="/tmp")
    os.close(fd)
    try:
        readers = [benchlib.Child(reader_main, mode) for _ in range(K)]
        for r in readers:
            r.reply()
        base = [benchlib.pss_bytes(r.pid) for r in readers]
        builder = benchlib.Child(builder_main, layers, mode, path)
        info = builder.reply()
        builder.proc.join(60)
        src = path if mode == "torch" else PREFIX
        firsts, again, reads = [], [], []
        for r in readers:
            dt, rt = r.call("load", src, True, info["probes"])
            firsts.append(dt)
            reads.append(rt)
        held = [benchlib.pss_bytes(r.pid) for r in readers]
        grown = sum(h - b for h, b in zip(held, base))
        if mode == "tensord":
            for _ in range(LOADS - 1):
                for r in readers:
                    again.append(r.call("load", src, False, info["probes"])[0])
        for r in readers:
            r.call("drop")
        return {"nbytes": info["nbytes"], "ntensors": info["ntensors"], "pss": grown,
                "firsts": firsts, "again": again, "reads": reads}
    finally:
        for c in readers + ([builder] if builder else []):
            c.close()
        os.unlink(path)


MODULE_WAYS = (
    ("cpu", "Net() + functional_call"),
    ("meta", "meta + functional_call"),
    ("load_state_dict", "Net() + load_state_dict"),
    ("attach_meta", "meta + attach"),
    ("attach_cpu", "Net() + attach"),
)


def run_module(how: str, layers: int) -> dict:
    """Measures one way of serving a module over the published weights."""
    readers: list[benchlib.Child] = []
    builder = None
    try:
        readers = [benchlib.Child(reader_main, "tensord") for _ in range(K)]
        for r in readers:
            r.reply()
        base = [benchlib.pss_bytes(r.pid) for r in readers]
        builder = benchlib.Child(builder_main, layers, "tensord", "")
        info = builder.reply()
        builder.proc.join(60)
        for r in readers:
            r.call("module", how, PREFIX, layers)
        held = [benchlib.pss_bytes(r.pid) for r in readers]
        for r in readers:
            r.call("drop")
        return {"nbytes": info["nbytes"], "pss": sum(held) - sum(base),
                "total": sum(held)}
    finally:
        for c in readers + ([builder] if builder else []):
            c.close()


def main() -> int:
    args = benchlib.parse_args("shared weights: torch.load per process vs tensord")
    import torch  # noqa: F401  (imported once here, before the children fork)

    tensord, tdt, why = benchlib.import_tensord()
    layers = 4 if args.quick else 30
    need = (K + 3) * layers * WIDTH * (WIDTH + 1) * 4
    avail = benchlib.meminfo("MemAvailable")
    t_all = time.monotonic()
    with benchlib.Daemon() as d:
        print(d.header())
        if 0 <= avail < need:
            print(f"bench_weights: skipped: {benchlib.size_str(avail)} of memory available, "
                  f"needs {benchlib.size_str(need)}")
            return 1
        if why:
            print(f"bench_weights: tensord rows skipped: {why}")
        res = {"torch": run_mode("torch", layers)}
        if why is None:
            res["tensord"] = run_mode("tensord", layers)
        nbytes = res["torch"]["nbytes"]
        print(f"\nbench_weights: {layers} x Linear({WIDTH}, {WIDTH}), float32, "
              f"{res['torch']['ntensors']} tensors, {nbytes / 1e6:.1f} MB; "
              f"K = {K} reader processes\n")
        rows = []
        for mode, label in (("torch", "torch.load(file)"), ("tensord", "load_state_dict")):
            r = res.get(mode)
            if r is None:
                continue
            again = (f"{benchlib.median(r['again']) * 1e3:.2f}" if r["again"] else "-")
            rows.append([label, str(K), f"{r['pss'] / 1e6:.1f} MB", f"{r['pss'] / nbytes:.2f}",
                         f"{benchlib.median(r['firsts']) * 1e3:.2f}",
                         f"{max(r['firsts']) * 1e3:.2f}", again,
                         f"{benchlib.median(r['reads']) * 1e3:.1f}"])
        benchlib.print_table(["way", "K", "PSS", "/copy", "1st load ms p50", "max",
                              "again ms", "read ms"], rows)
        print("\n  targets (reported, not enforced):")
        t = res.get("tensord")
        if t is None:
            print("    n/a (no tensord rows)")
        else:
            x = t["pss"] / nbytes
            a = benchlib.median(t["firsts"]) * 1e3
            print(f"    tensord PSS <= 1.2x one copy: {x:.2f}x -> {'met' if x <= 1.2 else 'MISSED'}")
            print(f"    tensord attach <= 10 ms (a process's first load_state_dict, median): "
                  f"{a:.2f} ms -> {'met' if a <= 10 else 'MISSED'}")
        if why is None:
            print(f"\n  serving an nn.Module over the shared weights, K = {K} readers\n")
            rows = []
            for how, label in MODULE_WAYS:
                r = run_module(how, layers)
                rows.append([label, str(K), f"{r['pss'] / 1e6:.1f} MB",
                             f"{r['pss'] / r['nbytes']:.2f}",
                             f"{r['total'] / 1e6:.1f} MB"])
            benchlib.print_table(["way", "K", "PSS", "/copy", "total PSS"], rows)
        print(f"\n  (bench_weights.py: {time.monotonic() - t_all:.0f} s)")
    return 1 if (d.failed or why) else 0


if __name__ == "__main__":
    sys.exit(main())
