#!/usr/bin/python3
"""bench_dataloader: batches per second, torch.utils.data.DataLoader against tensord.torch.DataLoader.

Usage: /usr/bin/python3 python/bench/bench_dataloader.py [--quick]
(starts its own tensord; see benchlib.py for where it finds the binary and the package).

The dataset: POOL synthetic images, 3x224x224 uint8, made once with torch.randint;
sample i is (image i % POOL, label i). Two kinds of per-sample work:
  trivial  the sample is the image as it is (a view of the pool);
  heavy    per-sample arithmetic on it in float32 (brightness, contrast, a
           square and its root, twice over), back to uint8 and flipped: about
           half a millisecond a sample on an idle CPU here.
Both loaders get the same arguments: batch_size 64, num_workers 2, shuffle off,
the default collate (a batch is a uint8 tensor [64, 3, 224, 224], 9.2 MiB, and an
int64 tensor of 64 labels), torch's default sharing strategy (file_descriptor)
for torch's.

The consumer (the main process, torch.set_num_threads(1)) touches every batch
the same way on both sides: the float mean of every 8th row and column of the
images (which reads from nearly every page) plus the sum of the labels.

Three tensord.torch.DataLoader paths are compared with torch's: "tensord", the
default, whose workers collate each batch into a slot of a channel
(tensord.Channel) that the main process receives without a daemon call or a
pipe; and "td-queue" (channel=False), the path before channels, each tensor a
storage of its own whose key travels through torch's result queue. Each work
kind runs with workers started afresh each epoch (as torch's default) and the
trivial one also with persistent_workers=True (every loader), where no epoch
pays for starting workers and mapping their memory.

An epoch is 80 batches with trivial work, 30 with heavy work (--quick: 20 and
8), after one warm-up epoch each; epochs of the loaders alternate, so that
all see the same load. Columns: "b/s" is the steady rate of an epoch, (batches
- 1) / (time of the last batch - time of the first), the median and the minimum
over the epochs; "first ms" is the median time from iter() to the first batch
(worker start); "epoch b/s" is batches / the whole epoch, start included,
median. "/torch" and "/td-queue" are ratios of the steady medians. Targets (issue 9):
trivial work >= 2x torch's rate; heavy work never slower (>= 1x); (issue 22)
the channel path >= 1.2x td-queue's rate with trivial work.
"""

from __future__ import annotations

import sys
import time

import benchlib

BATCH = 64
WORKERS = 2
POOL = 256


def make_dataset(n: int, heavy: bool):
    """Returns the synthetic dataset of n samples (see the module's docstring)."""
    import torch

    class Images(torch.utils.data.Dataset):
        """POOL random 3x224x224 uint8 images, indexed modulo POOL, with the index as label."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(1234)
            self.pool = torch.randint(0, 256, (POOL, 3, 224, 224), dtype=torch.uint8,
                                      generator=g)

        def __len__(self) -> int:
            return n

        def __getitem__(self, i: int):
            x = self.pool[i % POOL]
            if heavy:
                y = x.float()
                for _ in range(2):
                    y = y.mul_(1 / 255).sub_(0.5).mul_(1.2).add_(0.5).clamp_(0, 1)
                    y = (y * y).sqrt_().mul_(255)
                x = y.to(torch.uint8).flip(-1)
            return x, i

    return Images()


def touch(batch) -> float:
    """Reads the batch as the training loop would, a little: returns a number from it."""
    images, labels = batch
    if images.shape != (BATCH, 3, 224, 224):
        raise RuntimeError(f"a batch of shape {tuple(images.shape)}")
    return float(images[:, :, ::8, ::8].float().mean()) + float(labels.sum())


def epoch(loader) -> tuple[float, float, float]:
    """Runs one epoch; returns (steady batches/s, ms to the first batch, batches/s whole)."""
    t0 = time.perf_counter()
    first = last = t0
    n = 0
    for b in loader:
        touch(b)
        last = time.perf_counter()
        if n == 0:
            first = last
        n += 1
        del b
    steady = (n - 1) / (last - first) if n > 1 and last > first else float("nan")
    return steady, (first - t0) * 1e3, n / (last - t0)


# (work, persistent_workers): the rows of the table.
CONFIGS = [("trivial", False), ("heavy", False), ("trivial", True)]
LOADERS = ["torch", "tensord", "td-queue"]


def label(work: str, persistent: bool) -> str:
    return work + (", persistent" if persistent else "")


def main() -> int:
    args = benchlib.parse_args("DataLoader throughput: torch's vs tensord's")
    import torch
    import torch.utils.data

    tensord, tdt, why = benchlib.import_tensord()
    nbatches = {"trivial": 20, "heavy": 8} if args.quick else {"trivial": 80, "heavy": 30}
    epochs = 3 if args.quick else 7
    t_all = time.monotonic()
    torch.set_num_threads(1)
    with benchlib.Daemon() as d:
        print(d.header())
        if why:
            print(f"bench_dataloader: tensord rows skipped: {why}")
        results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
        for work, persistent in CONFIGS:
            ds = make_dataset(nbatches[work] * BATCH, work == "heavy")
            kw = dict(batch_size=BATCH, num_workers=WORKERS, shuffle=False,
                      persistent_workers=persistent)
            loaders = {"torch": torch.utils.data.DataLoader(ds, **kw)}
            if tdt is not None:
                loaders["tensord"] = tdt.DataLoader(ds, **kw)
                loaders["td-queue"] = tdt.DataLoader(ds, channel=False, **kw)
            names = list(loaders)
            row = label(work, persistent)
            for name in names:
                results[(row, name)] = []
                epoch(loaders[name])  # warm-up: not recorded
            for e in range(epochs):
                for j in range(len(names)):
                    name = names[(e + j) % len(names)]
                    results[(row, name)].append(epoch(loaders[name]))
            del loaders, ds
        print(f"\nbench_dataloader: {POOL} synthetic 3x224x224 uint8 images, batch {BATCH} "
              f"(9.2 MiB + 64 labels),\nnum_workers {WORKERS}; {epochs} epochs per loader of "
              f"{nbatches['trivial']} (trivial) or {nbatches['heavy']} (heavy) batches, "
              "alternating; batches/s.\ntensord: the channel path (the default); td-queue: "
              "DataLoader(channel=False),\nbatches as keys through torch's result queue\n")
        rows = []
        ratios: dict[tuple[str, str], float] = {}
        for work, persistent in CONFIGS:
            row = label(work, persistent)
            med = {name: benchlib.median([x[0] for x in results[(row, name)]])
                   for name in LOADERS if results.get((row, name))}
            for i, name in enumerate(LOADERS):
                r = results.get((row, name))
                if not r:
                    continue
                steady = [x[0] for x in r]
                rows.append([row if i == 0 else "", name, str(len(r)), f"{med[name]:.1f}",
                             f"{min(steady):.1f}",
                             f"{benchlib.median([x[1] for x in r]):.0f}",
                             f"{benchlib.median([x[2] for x in r]):.1f}",
                             benchlib.ratio_str(med[name], med["torch"]),
                             benchlib.ratio_str(med[name], med["td-queue"])
                             if "td-queue" in med else "-"])
            if "tensord" in med:
                ratios[(row, "torch")] = med["tensord"] / med["torch"]
                ratios[(row, "queue")] = med["tensord"] / med["td-queue"]
        benchlib.print_table(["work", "loader", "epochs", "b/s p50", "b/s min", "first ms",
                              "epoch b/s", "/torch", "/td-queue"], rows)
        print("\n  targets (reported, not enforced):")
        for key, want, text in (
                (("trivial", "torch"), 2.0, "trivial work: tensord >= 2x torch"),
                (("heavy", "torch"), 1.0, "heavy work: tensord never slower (>= 1x)"),
                (("trivial", "queue"), 1.2, "trivial work: channel >= 1.2x td-queue"),
                (("trivial, persistent", "queue"), 1.2,
                 "trivial work, persistent workers: channel >= 1.2x td-queue")):
            x = ratios.get(key)
            verdict = "n/a" if x is None else f"{x:.2f}x -> {'met' if x >= want else 'MISSED'}"
            print(f"    {text}: {verdict}")
        print(f"\n  (bench_dataloader.py: {time.monotonic() - t_all:.0f} s)")
    return 1 if (d.failed or why) else 0


if __name__ == "__main__":
    sys.exit(main())
