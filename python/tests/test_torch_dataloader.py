"""tensord.torch.DataLoader: torch's batches, collated into tensord storages."""

import collections
import gc
import os
import signal
import time

import numpy as np
import pytest
import torch
import torch.utils.data

import tensord.torch as tdt
from tensord import _tensord
from conftest import nothing_left, wait_until

Point = collections.namedtuple("Point", ["x", "y"])


class Nested(torch.utils.data.Dataset):
    """Nested samples of every kind default_collate handles. Uses the
    worker's global RNG too, so equal batches need equal worker seeding.
    With kill_at, worker 1 SIGKILLs itself on any index >= kill_at, once
    the main process has received a batch (received, an Event the test
    sets: without it, on a loaded machine the worker could die before any
    batch arrived)."""

    def __init__(self, n, kill_at=None, received=None):
        self.n = n
        self.kill_at = kill_at
        self.received = received

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.kill_at is not None and i >= self.kill_at:
            info = torch.utils.data.get_worker_info()
            if info is not None and info.id == 1:
                if self.received is not None:
                    self.received.wait(60)
                time.sleep(0.3)  # let the batches already put reach the pipe
                os.kill(os.getpid(), signal.SIGKILL)
        g = torch.Generator().manual_seed(i)
        return {
            "img": torch.rand(3, 4, generator=g) + torch.rand(()),
            "label": i % 3,
            "meta": (np.arange(4, dtype=np.int16) * i, i / 2, "s%d" % i),
            "lst": [torch.tensor([i, -i]), np.float32(i) / 4, np.random.randint(100)],
            "flag": torch.tensor(i % 2 == 0),
            "pt": Point(x=torch.full((2,), i, dtype=torch.bfloat16), y=[i, i + 1]),
        }


def pairs_collate(batch):
    """A user collate_fn: its tensors are torch's own, not tensord's."""
    return torch.stack([b["img"] for b in batch]), [b["label"] for b in batch]


def assert_same(a, b, where="batch"):
    assert type(a) is type(b), "%s: %s vs %s" % (where, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            assert_same(a[k], b[k], "%s[%r]" % (where, k))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, "%s[%d]" % (where, i))
    else:
        assert a == b, where


def tensors_in(batch):
    if isinstance(batch, torch.Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from tensors_in(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from tensors_in(v)


def in_tensord(x):
    hit = _tensord.find(x.data_ptr())
    if hit is None:
        return False
    hit[0].release()
    return True


def storage_of(x):
    t, _ = _tensord.find(x.data_ptr())
    t.release()
    return t.storage_id




@pytest.fixture
def clean(client):
    tdt.uninstall()
    yield client
    tdt.uninstall()
    gc.collect()
    wait_until(lambda: nothing_left(client), "no storage and no key left")


def epoch(loader):
    """All the loader's batches, from the same global RNG state each time
    (with num_workers=0 the dataset draws from the main process's RNGs)."""
    torch.manual_seed(0)
    np.random.seed(0)
    return list(loader)


def loaders(client, dataset, channel=True, **kw):
    """torch's DataLoader and tensord's, with equal seeds."""
    mine = tdt.DataLoader(
        dataset, client=client, generator=torch.Generator().manual_seed(7),
        channel=channel, **kw
    )
    theirs = torch.utils.data.DataLoader(
        dataset, generator=torch.Generator().manual_seed(7), **kw
    )
    return mine, theirs


@pytest.mark.parametrize(
    "num_workers,channel", [(0, True), (2, True), (2, False)],
    ids=["main", "channel", "queue"],
)
def test_same_batches_as_torch_and_nothing_left(clean, num_workers, channel):
    c = clean
    mine, theirs = loaders(
        c, Nested(30), channel=channel, batch_size=4, shuffle=True,
        num_workers=num_workers,
    )
    want = epoch(theirs)
    got = epoch(mine)
    assert len(got) == len(want) == 8
    for i, (g, w) in enumerate(zip(got, want)):
        assert_same(g, w, "batch %d" % i)
        assert all(in_tensord(x) for x in tensors_in(g))
    ntensors = sum(len(list(tensors_in(b))) for b in got)
    if num_workers and channel:
        # Batches collated into a slot (or a storage of a slot's size) hold
        # one storage each; the first ones, sent before the slots existed,
        # one per tensor.
        whole = [len({storage_of(x) for x in tensors_in(b)}) == 1 for b in got]
        assert whole[-1] and sum(whole) >= 3, whole
        assert len(c.ls()) < ntensors
    else:
        # Each tensor of each batch has a storage of its own, alive while held.
        assert len(c.ls()) == ntensors > 8
    assert c.stat()["keys"] == 0  # every batch taken by this process
    del got


def test_user_collate_fn_result_passes_through(clean):
    mine, theirs = loaders(
        clean, Nested(12), batch_size=3, num_workers=2, collate_fn=pairs_collate
    )
    want, got = epoch(theirs), epoch(mine)
    assert len(got) == 4
    for g, w in zip(got, want):
        assert_same(g, w)
        assert in_tensord(g[0])  # copied once into tensord by the reducer
    del got


def test_persistent_workers_two_epochs(clean):
    mine, theirs = loaders(
        clean, Nested(10), batch_size=4, shuffle=True, num_workers=2,
        persistent_workers=True,
    )
    for n in range(2):
        assert_same(epoch(mine), epoch(theirs), "epoch %d" % n)
    del mine  # its iterator, and the scope, go with it


def test_spawned_workers(clean):
    mine = tdt.DataLoader(
        Nested(8), batch_size=4, num_workers=2, multiprocessing_context="spawn",
        client=clean, generator=torch.Generator().manual_seed(7),
    )
    # Worker seeds do not depend on the start method: compare with fork.
    theirs = torch.utils.data.DataLoader(
        Nested(8), batch_size=4, num_workers=2,
        generator=torch.Generator().manual_seed(7),
    )
    got = epoch(mine)
    assert_same(got, epoch(theirs))
    assert all(in_tensord(x) for x in tensors_in(got))
    del got


def test_worker_killed_mid_epoch_raises_like_torch_and_leaks_nothing(clean):
    received = torch.multiprocessing.get_context("fork").Event()
    # Worker 1's second batch: indices 12..15 (the workers are forked).
    ds = Nested(40, kill_at=12, received=received)
    mine, theirs = loaders(clean, ds, batch_size=4, num_workers=2)

    def consume(loader):
        torch.manual_seed(0)
        np.random.seed(0)
        received.clear()
        got = []
        it = iter(loader)
        try:
            for b in it:
                got.append(b)
                received.set()
        except RuntimeError as e:
            error = str(e)
        else:
            pytest.fail("no error from a loader whose worker was killed")
        del it  # no traceback keeps it: its workers are shut down now
        return got, error

    want, their_error = consume(theirs)
    got, my_error = consume(mine)
    assert "DataLoader worker (pid" in their_error
    assert "DataLoader worker (pid" in my_error
    # The batches before the dead worker's, as torch's (how many arrive
    # before the SIGCHLD handler raises depends on timing, for torch too).
    assert 1 <= len(got) <= 3 and 1 <= len(want) <= 3
    for g, w in zip(got, want):
        assert_same(g, w)
    # Worker 0 had prefetched batches into the scope: gone with it.
    assert clean.stat()["keys"] == 0
    del got


def in_flight(c):
    """Batches sent and not received: keys of the scope, entries of the
    channels."""
    return c.stat()["keys"] + sum(ch["depth"] for ch in c.channels())


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "queue"])
def test_iterator_dropped_mid_epoch_frees_batches_in_flight(clean, channel):
    c = clean
    loader = tdt.DataLoader(
        Nested(40), batch_size=4, num_workers=2, client=c, channel=channel
    )
    it = iter(loader)
    first = next(it)
    # The workers prefetch: batches wait in the pipe as keys of the scope,
    # or in the channel, held by no process.
    wait_until(lambda: in_flight(c) > 0, "a prefetched batch in flight")
    del it  # closes the scope and the channels: what was in flight goes
    wait_until(lambda: in_flight(c) == 0, "the batches in flight dropped")
    assert all(in_tensord(x) for x in tensors_in(first))
    del first, loader  # the loader kept its slots for the next epoch
    wait_until(lambda: not c.channels(), "the channels gone")


class Images(torch.utils.data.Dataset):
    """Samples big enough (48 KiB, 192 KiB a batch) for the daemon to pool."""

    def __len__(self):
        return 24

    def __getitem__(self, i):
        return torch.full((3, 64, 64), float(i))


def test_dropped_batches_are_recycled(clean):
    c = clean
    hits = c.stat()["pool"]["hits"]
    n = 0
    for b in tdt.DataLoader(Images(), batch_size=4, client=c):
        assert float(b[3, 0, 0, 0]) == 4 * n + 3
        n += 1
    assert n == 6
    # Batch k is dropped before batch k + 2 is made: its segment serves it.
    assert c.stat()["pool"]["hits"] - hits >= 4


class Stream(torch.utils.data.IterableDataset):
    """An iterable dataset split between the workers by their ids."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        first, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(first, 21, step):
            yield {"x": torch.full((2,), i), "i": i}


def test_iterable_dataset(clean):
    mine, theirs = loaders(clean, Stream(), batch_size=3, num_workers=2)
    got, want = epoch(mine), epoch(theirs)
    assert len(got) == len(want) == 8  # 11 and 10 samples: 4 + 4 batches
    assert_same(got, want)
    assert all(in_tensord(x) for x in tensors_in(got))
    del got


class HoldInWorkers(torch.utils.data.Dataset):
    """Each sample makes a storage in the worker that fetches it and keeps
    it (until the worker exits), and says who made it: worker id, pid,
    storage id, and the name of the worker's client."""

    held = []  # per process: the worker's storages

    def __init__(self, sock, n):
        self.sock = sock
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        info = torch.utils.data.get_worker_info()
        c = tdt.client_for(self.sock)
        t = c.empty((16,), "uint8")
        HoldInWorkers.held.append(t)
        return {"wid": info.id, "pid": os.getpid(), "sid": t.storage_id,
                "name": c.name}


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_workers_are_named_program_worker_n(clean, daemon, start):
    """A worker's connection is '<program> worker <id>' in tensorctl ls and
    in Client.ls(); the main process keeps the program's name."""
    from test_client import tensorctl_json

    c = clean
    main = c.name
    assert main and main not in ("python3", "python"), main
    loader = tdt.DataLoader(
        HoldInWorkers(daemon, 2), batch_size=1, num_workers=2, client=c,
        persistent_workers=True, multiprocessing_context=start,
    )
    batches = list(loader)  # the workers live on (persistent) and hold
    assert sorted(int(b["wid"]) for b in batches) == [0, 1]
    listed = {s["id"]: s for s in tensorctl_json(daemon, "ls")["storages"]}
    ours = {s["id"]: s for s in c.ls()}
    for b in batches:
        wid, pid, sid = int(b["wid"]), int(b["pid"]), int(b["sid"])
        want = "%s worker %d" % (main, wid)
        assert b["name"] == [want]  # Client.name in the worker
        for where, ls in (("tensorctl ls --json", listed), ("Client.ls()", ours)):
            holders = ls[sid]["holders"]
            assert {"pid": pid, "name": want} in [
                {"pid": h["pid"], "name": h["name"]} for h in holders
            ], (where, holders)
    ctl = tensorctl_json(daemon, "metrics")["clients"]
    names = {(x["pid"], x["name"]) for x in ctl}
    for b in batches:
        assert (int(b["pid"][0]), "%s worker %d" % (main, int(b["wid"]))) in names
    assert (os.getpid(), main) in names
    del batches, loader  # the workers exit, and their storages go


def chan_d(c):
    """The slots' channel of the one loader alive (its '/d' channel)."""
    ds = [ch for ch in c.channels() if ch["name"].endswith("/d")]
    assert len(ds) == 1, c.channels()
    return ds[0]


def test_channel_batches_come_in_slots(clean):
    c = clean
    loader = tdt.DataLoader(Images(), batch_size=4, num_workers=2, client=c)
    want = [float(4 * k + 3) for k in range(6)]
    for n in range(2):  # the second epoch's workers find the slots at once
        it = iter(loader)
        # torch's result queue is the channels': no pipe carries batches.
        assert isinstance(it._worker_result_queue, tdt._ChanQueue)
        got, sids = [], []
        for b in it:
            got.append(float(b[3, 0, 0, 0]))
            sids.append(storage_of(b))
            b.add_(1)  # a received batch is writable, as torch's
            del b
        del it
        assert got == want, n
    d = chan_d(c)
    assert d["slot_bytes"] >= 4 * 3 * 64 * 64 * 4  # sized from a batch
    assert set(sids) <= set(d["slot_ids"])  # every batch of epoch 2 in a slot
    assert d["slots_free"] == d["slots"] and d["depth"] == 0
    del loader
    wait_until(lambda: not c.channels(), "the slots gone with the loader")


class Growing(torch.utils.data.Dataset):
    """Batches (of 2) that grow: later ones outgrow the slots the first sized."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((20000 * (i // 2 + 1),), i, dtype=torch.int32), str(i)


def test_channel_batches_that_do_not_fit_go_by_storage(clean):
    mine, theirs = loaders(clean, Growing(), batch_size=2, num_workers=2)
    for n in range(2):
        got, want = epoch(mine), epoch(theirs)
        assert_same(got, want, "epoch %d" % n)
        assert all(in_tensord(x) for x in tensors_in(got))
        del got
    assert chan_d(clean)["slot_bytes"] < 6 * 20000 * 4 * 2  # the last batch
    del mine


class Failing(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == 9:
            raise ValueError("sample %d is broken" % i)
        return torch.tensor([i])


@pytest.mark.parametrize("channel", [True, False], ids=["channel", "queue"])
def test_worker_error_raises_in_the_main_process(clean, channel):
    loader = tdt.DataLoader(
        Failing(), batch_size=2, num_workers=2, client=clean, channel=channel
    )
    got = []
    with pytest.raises(ValueError, match="sample 9 is broken") as e:
        for b in loader:
            got.append(int(b[0]))
    assert "Caught ValueError in DataLoader worker process" in str(e.value)
    assert got == [0, 2, 4, 6]  # in order, up to the broken batch
    del e, loader


def unpicklable_collate(batch):
    return lambda: batch


def test_channel_batch_that_cannot_be_sent_raises(clean):
    loader = tdt.DataLoader(
        Failing(), batch_size=2, num_workers=1, client=clean,
        collate_fn=unpicklable_collate,
    )
    with pytest.raises(Exception, match="sending a batch"):
        next(iter(loader))
    del loader


def test_worker_side_finds_the_slots_once_the_bootstrap_is_gone(clean, daemon):
    """A worker whose first result comes after the main process has left the
    bootstrap channel (every other worker having moved to the slots) sends it
    on the slots' channel: nothing is dropped."""
    c = clean
    d = c.channel("t/d", capacity=4, slots=2, slot_bytes=1 << 16, create=True)
    w = tdt._ChanWorker(daemon, "t/b", "t/d")  # "t/b" is gone (never made)
    try:
        w.put((7, {"x": torch.arange(4), "s": "seven"}))
        w.put((8, None))
        got = [tdt._decode(d.recv(timeout=5))[0] for _ in range(2)]
    finally:
        w.close()
    assert got[0][0] == 7 and got[0][1]["s"] == "seven"
    assert got[0][1]["x"].tolist() == [0, 1, 2, 3]
    assert in_tensord(got[0][1]["x"])  # copied into a slot by the pickler
    assert got[1] == (8, None)
    del got
    d.close()
