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
for torch's. Workers start afresh each epoch (no persistent_workers), in both.

The consumer (the main process, torch.set_num_threads(1)) touches every batch
the same way on both sides: the float mean of every 8th row and column of the
images (which reads from nearly every page) plus the sum of the labels.

An epoch is 80 batches with trivial work, 30 with heavy work (--quick: 20 and
8), after one warm-up epoch each; epochs of the two loaders alternate, so that
both see the same load. Columns: "b/s" is the steady rate of an epoch, (batches
- 1) / (time of the last batch - time of the first), the median and the minimum
over the epochs; "first ms" is the median time from iter() to the first batch
(worker start); "epoch b/s" is batches / the whole epoch, start included,
median. "/torch" is the ratio of the steady medians. Targets (issue 9): trivial
work >= 2x torch's rate; heavy work never slower (>= 1x).
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
        for work in ("trivial", "heavy"):
            ds = make_dataset(nbatches[work] * BATCH, work == "heavy")
            loaders = {"torch": torch.utils.data.DataLoader(
                ds, batch_size=BATCH, num_workers=WORKERS, shuffle=False)}
            if tdt is not None:
                loaders["tensord"] = tdt.DataLoader(
                    ds, batch_size=BATCH, num_workers=WORKERS, shuffle=False)
                loaders["td-queue"] = tdt.DataLoader(
                    ds, batch_size=BATCH, num_workers=WORKERS, shuffle=False,
                    channel=False)
            names = list(loaders)
            for name in names:
                results[(work, name)] = []
                epoch(loaders[name])  # warm-up: not recorded
            for e in range(epochs):
                for j in range(len(names)):
                    name = names[(e + j) % len(names)]
                    results[(work, name)].append(epoch(loaders[name]))
            del loaders, ds
        print(f"\nbench_dataloader: {POOL} synthetic 3x224x224 uint8 images, batch {BATCH} "
              f"(9.2 MiB + 64 labels),\nnum_workers {WORKERS}; {epochs} epochs per loader of "
              f"{nbatches['trivial']} (trivial) or {nbatches['heavy']} (heavy) batches, "
              "alternating; batches/s\n")
        rows = []
        ratios: dict[str, float] = {}
        for work in ("trivial", "heavy"):
            base = None
            for i, name in enumerate(("torch", "tensord", "td-queue")):
                r = results.get((work, name))
                if not r:
                    continue
                steady = [x[0] for x in r]
                med = benchlib.median(steady)
                if name == "torch":
                    base = med
                elif name == "tensord":
                    ratios[work] = med / base
                    chan = med
                else:
                    ratios[work + " queue"] = chan / med
                rows.append([work if i == 0 else "", name, str(len(r)), f"{med:.1f}",
                             f"{min(steady):.1f}",
                             f"{benchlib.median([x[1] for x in r]):.0f}",
                             f"{benchlib.median([x[2] for x in r]):.1f}",
                             benchlib.ratio_str(med, base)])
        benchlib.print_table(["work", "loader", "epochs", "b/s p50", "b/s min", "first ms",
                              "epoch b/s", "/torch"], rows)
        print("\n  targets (reported, not enforced):")
        for work, want, text in (("trivial", 2.0, "trivial work: tensord >= 2x torch"),
                                 ("heavy", 1.0, "heavy work: tensord never slower (>= 1x)")):
            x = ratios.get(work)
            verdict = "n/a" if x is None else f"{x:.2f}x -> {'met' if x >= want else 'MISSED'}"
            print(f"    {text}: {verdict}")
        print(f"\n  (bench_dataloader.py: {time.monotonic() - t_all:.0f} s)")
    return 1 if (d.failed or why) else 0


if __name__ == "__main__":
    sys.exit(main())
