"""Who keeps a storage alive: Tensors, their arrays and exports, and no one
longer than the last of them."""

import gc
import os
import sys

import numpy as np
import pytest

import tensord

from conftest import wait_storages


def refs(ls, sid):
    for s in ls:
        if s["id"] == sid:
            return sum(h["refs"] for h in s["holders"] if h["pid"] == os.getpid())
    return 0


def held(sock, sid, n=None):
    """The references this process holds on storage sid, seen by tensord (0
    once it is gone). Releases travel without a reply, some with the next
    request: with n, this polls up to 2 s for the count to become n."""
    ls = wait_storages(sock, lambda ls: n is None or refs(ls, sid) == n)
    return refs(ls, sid)


def gone(sock, sid):
    ls = wait_storages(sock, lambda ls: all(s["id"] != sid for s in ls))
    return all(s["id"] != sid for s in ls)


def test_array_outlives_its_tensor(daemon, client):
    t = client.share(np.arange(5, dtype=np.int32))
    sid = t.storage_id
    a = t.numpy()
    t.release()
    assert t.released
    gc.collect()
    assert held(daemon, sid) >= 1  # the array's reference
    assert a.tolist() == [0, 1, 2, 3, 4]
    a[:] = 7  # still mapped, still writable
    assert a.sum() == 35
    b = a[1:]  # a numpy view of the array keeps it too
    del a
    gc.collect()
    assert held(daemon, sid) >= 1
    del b
    gc.collect()
    assert gone(daemon, sid)


def test_storage_goes_when_tensor_and_array_are_gone(daemon, client):
    t = client.empty((100,), "float64")
    sid = t.storage_id
    a = t.numpy()
    del t
    gc.collect()
    assert held(daemon, sid) >= 1
    del a
    gc.collect()
    assert gone(daemon, sid)


def test_every_view_and_export_holds_its_reference(daemon, client):
    t = client.empty((4, 4), "uint8")
    sid = t.storage_id
    v = t[1:, ::2]
    m = memoryview(t)
    cap = t.__dlpack__()
    d = np.from_dlpack(v)
    t.release()
    # Each holder alone keeps the storage: drop them one at a time.
    del v
    gc.collect()
    assert held(daemon, sid) >= 1
    del cap
    assert held(daemon, sid) >= 1
    m.release()
    del m
    assert held(daemon, sid) >= 1
    assert d.shape == (3, 2)
    del d
    gc.collect()
    assert gone(daemon, sid)


def test_release_is_idempotent_and_ends_access(client):
    t = client.empty(3)
    t.release()
    t.release()
    assert t.released
    for call in (t.numpy, lambda: t.data_ptr, lambda: t[0], lambda: t.view(3),
                 t.__dlpack__, lambda: t.__array_interface__,
                 lambda: client.share(t)):
        with pytest.raises(ValueError, match="released"):
            call()
    with pytest.raises(BufferError):
        memoryview(t)
    # Metadata stays readable.
    assert t.shape == (3,) and t.dtype == "float32" and t.storage_id > 0


def test_with_statement_releases(daemon, client):
    with client.empty(8, "int8") as t:
        sid = t.storage_id
        assert held(daemon, sid, 1) == 1
    assert t.released
    assert gone(daemon, sid)


def test_buffer_export_defers_release(daemon, client):
    t = client.share(b"abcdef")
    sid = t.storage_id
    m = memoryview(t)
    t.release()
    assert t.released and held(daemon, sid, 1) == 1
    assert m.tobytes() == b"abcdef"  # still mapped
    m.release()
    assert gone(daemon, sid)


def test_array_interface_defers_release_to_collection(daemon, client):
    t = client.share(np.arange(3, dtype=np.int16))
    sid = t.storage_id

    class Holder:
        pass

    h = Holder()
    h.__array_interface__ = t.__array_interface__
    h.owner = t  # what a consumer of the interface must do
    a = np.asarray(h)
    t.release()
    assert held(daemon, sid, 1) == 1  # deferred: the pointer is out there
    assert a.tolist() == [0, 1, 2]
    del t, h, a
    gc.collect()
    assert gone(daemon, sid)


def test_torch_tensor_keeps_storage(daemon, client):
    torch = pytest.importorskip("torch")
    t = client.share(np.arange(4, dtype=np.float32))
    sid = t.storage_id
    x = t.torch()
    y = x[1:]
    t.release()
    del t, x
    gc.collect()
    assert held(daemon, sid) >= 1
    assert y.tolist() == [1.0, 2.0, 3.0]
    del y
    gc.collect()
    assert gone(daemon, sid)
    assert torch is not None


def test_unconsumed_capsule_releases(daemon, client):
    t = client.empty(2)
    sid = t.storage_id
    cap = t.__dlpack__()
    t.release()
    assert held(daemon, sid, 1) == 1
    del cap
    assert gone(daemon, sid)


def test_no_reference_leak_per_call(daemon, client):
    """Python objects: a thousand calls leave no new objects behind."""
    t = client.share(np.arange(16, dtype=np.float32).reshape(4, 4), key="rc")

    def work():
        u = client.lookup("rc", timeout=0)
        a = u[1:, ::2].numpy()
        b = np.from_dlpack(u.transpose(0, 1))
        m = memoryview(u)
        m.release()
        u.release()
        return a.sum() + b.sum()

    for _ in range(50):
        work()
    gc.collect()
    before = len(gc.get_objects())
    rc = sys.getrefcount(client)
    for _ in range(1000):
        work()
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert sys.getrefcount(client) == rc
    # t's reference alone: no handle left behind. (A release that is not
    # a connection's last rides with its next request: ping sends them.)
    client.ping()
    assert held(daemon, t.storage_id, 1) == 1
    client.unpublish("rc")
    t.release()


def test_find(daemon, client):
    t = client.empty((8,), "int64")
    hit = tensord.find(t.data_ptr + 20)
    assert hit is not None
    w, off = hit
    assert off == 20 and w.storage_id == t.storage_id
    assert w.dtype == "uint8" and w.shape == (64,) and w.data_ptr == t.data_ptr
    assert w.client is None
    # It holds its own reference.
    sid = t.storage_id
    t.release()
    assert held(daemon, sid, 1) == 1
    w.release()
    assert gone(daemon, sid)
    assert tensord.find(id(object())) is None
    # An export alone keeps its range known.
    u = client.empty(4)
    a = u.numpy()
    u.release()
    hit = tensord.find(a.ctypes.data)
    assert hit is not None and hit[1] == 0
    hit[0].release()
    del a, hit
    gc.collect()
