"""Read-only tensors never crash the interpreter and never reach the shared
pages: their mappings are copy-on-write (TD_COW)."""

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest


def publish_bytes(client, key, data):
    t = client.share(np.frombuffer(data, np.uint8))
    client.publish(key, t)
    return t


def test_readonly_numpy_is_not_writeable(client):
    t = publish_bytes(client, "ro", b"\x01\x02\x03\x04")
    r = client.lookup("ro", readonly=True)
    assert r.readonly
    a = r.numpy()
    assert not a.flags.writeable
    with pytest.raises(ValueError):
        a[0] = 9
    with pytest.raises(ValueError):
        a.setflags(write=True)
    m = memoryview(r)
    assert m.readonly
    with pytest.raises(TypeError):
        m[0] = 9
    with pytest.raises(TypeError, match="underlying buffer is not writable"):
        ctypes.c_char.from_buffer(r)  # ctypes' own check, of a read-only buffer
    assert r.__array_interface__["data"] == (r.data_ptr, True)
    m.release()
    client.unpublish("ro")
    t.release()
    r.release()


class Py_buffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p), ("obj", ctypes.py_object),
        ("len", ctypes.c_ssize_t), ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int), ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p), ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p), ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


PyBUF_WRITABLE = 0x0001


def test_writable_buffer_of_a_readonly_tensor_is_refused_by_the_extension(client):
    """The extension's own check (Tensor_getbuffer): numpy, memoryview and
    ctypes look at a buffer's readonly flag themselves, so they never show
    it; these consumers ask for PyBUF_WRITABLE and take what they get."""
    t = publish_bytes(client, "rob", b"abcd")
    r = client.lookup("rob", readonly=True)
    want = r"^tensord\.Tensor of storage %d is mapped read-only" % r.storage_id
    rfd, wfd = os.pipe()
    try:
        os.write(wfd, b"xy")
        with pytest.raises(BufferError, match=want):
            os.readv(rfd, [r])  # PyObject_GetBuffer(r, PyBUF_WRITABLE)
    finally:
        os.close(rfd)
        os.close(wfd)
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(Py_buffer), ctypes.c_int]
    b = Py_buffer()
    with pytest.raises(BufferError, match=want):
        get(r, ctypes.byref(b), PyBUF_WRITABLE)
    assert bytes(r.numpy()) == b"abcd"  # nothing was written, not even privately
    get(t, ctypes.byref(b), PyBUF_WRITABLE)  # a writable Tensor's is granted
    assert b.readonly == 0 and b.len == 4
    ctypes.pythonapi.PyBuffer_Release(ctypes.byref(b))
    client.unpublish("rob")
    t.release()
    r.release()


def test_forced_write_stays_private(daemon, client):
    t = publish_bytes(client, "cow", b"old bytes!")
    r = client.lookup("cow", readonly=True)
    # What numpy forbids, ctypes does anyway: no SIGSEGV, a private copy.
    ctypes.memmove(r.data_ptr, b"NEW BYTES!", 10)
    assert bytes(r.numpy()) == b"NEW BYTES!"  # the writer sees its copy
    assert bytes(t.numpy()) == b"old bytes!"  # the shared pages do not
    w = client.lookup("cow")  # a new read-write lookup: the shared pages
    assert bytes(w.numpy()) == b"old bytes!"
    # Another process sees the shared pages too.
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys, tensord\n"
         "c = tensord.connect(sys.argv[1])\n"
         "print(bytes(c.lookup('cow', readonly=True).numpy()).decode())",
         daemon],
        capture_output=True, text=True, timeout=30, check=True)
    assert out.stdout.strip() == "old bytes!"
    client.unpublish("cow")
    for x in (t, r, w):
        x.release()


def test_readonly_torch_write_does_not_crash(client):
    torch = pytest.importorskip("torch")
    t = publish_bytes(client, "cowt", bytes(range(16)))
    r = client.lookup("cowt", readonly=True)
    x = r.view_dtype("int32").torch()
    x.fill_(-1)  # torch cannot mark it read-only: the mapping is private
    assert x.tolist() == [-1] * 4
    assert bytes(t.numpy()) == bytes(range(16))
    assert bytes(client.lookup("cowt").numpy()) == bytes(range(16))
    client.unpublish("cowt")
    del x
    t.release()
    r.release()
    assert torch is not None


def test_open_readonly_is_cow_too(client):
    t = client.share(b"abc")
    r = client.open(t.storage_id, readonly=True)
    ctypes.memmove(r.data_ptr, b"xyz", 3)
    assert bytes(t.numpy()) == b"abc"
    t.release()
    r.release()


def _rss_kib(addr: int) -> int:
    """Rss of the mapping of this process that holds addr, from smaps."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("no mapping holds 0x%x" % addr)


def test_lazy_lookup_maps_no_page_until_touched(client):
    """lazy=True (TD_LAZY) skips the populate: attaching costs nothing that
    grows with the size; the pages come as they are touched. Without it, a
    mapping this big is populated when the Tensor is made. (Read-only: the
    writer's read-write mapping in this process is another one.)"""
    readonly = True
    n = 4 << 20
    with client.empty((n,), "uint8") as w:
        w.numpy()[:] = 7
        client.publish("lazy/big", w)
        a = client.lookup("lazy/big", readonly=readonly, lazy=True)
        assert _rss_kib(a.data_ptr) == 0
        assert a.numpy()[4096 * 100] == 7  # one touch maps a few pages only
        assert 0 < _rss_kib(a.data_ptr) < n // 1024
        a.release()
        b = client.lookup("lazy/big", readonly=readonly)  # populated
        assert _rss_kib(b.data_ptr) == n // 1024
        b.release()
        client.unpublish("lazy/big")
