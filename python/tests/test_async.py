"""alookup: waits in a thread, cancellable, loses nothing."""

import asyncio
import sys
import time

import pytest

import tensord

from conftest import wait_storages


def run(coro):
    return asyncio.run(coro)


def test_alookup_returns_when_published(client):
    async def main():
        task = asyncio.ensure_future(client.alookup("async", timeout=5))
        await asyncio.sleep(0.1)
        assert not task.done()
        t = client.share(b"hello", key="async")
        u = await task
        return t, u

    t, u = run(main())
    assert u.storage_id == t.storage_id and u.key == "async"
    assert bytes(u.numpy()) == b"hello"
    client.unpublish("async")
    t.release()
    u.release()


def test_alookup_errors_and_options(client):
    async def main():
        with pytest.raises(tensord.NotFound):
            await client.alookup("none", timeout=0)
        with pytest.raises(tensord.Timeout):
            await client.alookup("none", timeout=0.1)
        client.share(b"ro", key="aro").release()
        r = await client.alookup("aro", readonly=True, take=True)
        assert r.readonly
        with pytest.raises(tensord.NotFound):
            await client.alookup("aro", timeout=0)
        r.release()

    run(main())


def test_cancel_cancels_the_wait(daemon, client):
    rc = sys.getrefcount(client)

    async def main():
        t0 = time.monotonic()
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(client.alookup("late", take=True), 0.1)
        return time.monotonic() - t0

    took = run(main())
    assert took < 2.0
    # The thread's wait ends within a slice; then nothing waits on the key.
    assert wait_storages(daemon, lambda ls: True) is not None
    deadline = time.monotonic() + 2
    while client.stat()["waiters"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.stat()["waiters"] == 0
    # Published now, the key stays: the cancelled take took nothing.
    t = client.share(b"late", key="late")
    time.sleep(0.1)
    u = client.lookup("late", timeout=0)
    assert u.storage_id == t.storage_id
    client.unpublish("late")
    t.release()
    u.release()
    del t, u  # Tensors hold their Client; nothing else may
    assert sys.getrefcount(client) == rc


def test_cancel_after_the_take_succeeded_gives_the_key_back(daemon, client):
    """The race: the thread took the key, but the task is cancelled before it
    sees the result. The key must be published again, the Tensor released."""
    t = client.share(b"taken", key="race")
    sid = t.storage_id
    t.release()

    async def main():
        task = asyncio.ensure_future(client.alookup("race", take=True))
        await asyncio.sleep(0)  # the lookup starts in its thread
        time.sleep(0.3)  # blocks the loop: the take completes meanwhile
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(main())
    u = client.lookup("race", timeout=1)
    assert u.storage_id == sid and bytes(u.numpy()) == b"taken"
    client.unpublish("race")
    u.release()
    # No Tensor of the race is left holding the storage.
    assert wait_storages(daemon, lambda ls: not ls) == []


def test_cancelled_take_does_not_clobber_a_newer_value(daemon, client):
    t = client.share(b"old", key="race2")
    t.release()

    async def main():
        task = asyncio.ensure_future(client.alookup("race2", take=True))
        await asyncio.sleep(0)
        time.sleep(0.3)  # the take completes meanwhile...
        newer = client.share(b"new", key="race2")  # ...and a new value comes
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return newer

    newer = run(main())
    u = client.lookup("race2", timeout=0)
    assert u.storage_id == newer.storage_id and bytes(u.numpy()) == b"new"
    client.unpublish("race2")
    u.release()
    newer.release()
    assert wait_storages(daemon, lambda ls: not ls) == []
