"""numpy over tensord: every dtype, views, zero-copy exports."""

import ctypes
import random

import numpy as np
import pytest


# Every numpy dtype tensord has, with torch's name.
DTYPES = [
    (np.bool_, "bool"),
    (np.uint8, "uint8"),
    (np.int8, "int8"),
    (np.int16, "int16"),
    (np.uint16, "uint16"),
    (np.int32, "int32"),
    (np.uint32, "uint32"),
    (np.int64, "int64"),
    (np.uint64, "uint64"),
    (np.float16, "float16"),
    (np.float32, "float32"),
    (np.float64, "float64"),
    (np.complex64, "complex64"),
    (np.complex128, "complex128"),
]


def sample(dtype, shape, seed=0):
    """Values of dtype that use its whole range (and are all distinct)."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    if dtype == np.bool_:
        return rng.integers(0, 2, n).astype(np.bool_).reshape(shape)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True).reshape(shape)
    if np.issubdtype(dtype, np.complexfloating):
        return (rng.standard_normal(n) + 1j * rng.standard_normal(n)).astype(dtype).reshape(shape)
    return rng.standard_normal(n).astype(dtype).reshape(shape)


def offset_of(t, base):
    """t's first element, in bytes from base's (both tensord Tensors)."""
    return t.data_ptr - base.data_ptr


def same_as_numpy(t, a, base_t, base_a):
    """t (a tensord view) is a (the numpy view) over the same bytes."""
    got = t.numpy()
    assert got.dtype == a.dtype
    assert got.shape == a.shape == t.shape
    assert (got == a).all() if got.size else True
    if a.size > 1:
        # numpy's strides in bytes; tensord's in elements. Only dims of
        # size > 1 have a stride that means anything.
        for i, n in enumerate(a.shape):
            if n > 1:
                assert got.strides[i] == a.strides[i] == t.strides[i] * t.itemsize
    if a.size:
        assert offset_of(t, base_t) == a.ctypes.data - base_a.ctypes.data
        assert got.ctypes.data == t.data_ptr


@pytest.mark.parametrize("np_dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_round_trip_every_dtype(client, np_dtype, name):
    a = sample(np_dtype, (5, 6))
    t = client.share(a)
    assert t.dtype == name and t.itemsize == a.itemsize
    assert t.shape == (5, 6) and t.strides == (6, 1) and t.offset == 0
    got = t.numpy()
    assert got.dtype == a.dtype and got.tobytes() == a.tobytes()
    assert got.ctypes.data == t.data_ptr  # no copy
    # Views: sliced, transposed, stepped, expanded.
    same_as_numpy(t[1:4, 2:], a[1:4, 2:], t, a)
    same_as_numpy(t.transpose(0, 1), a.T, t, a)
    same_as_numpy(t[::2, 1::3], a[::2, 1::3], t, a)
    e = t[2:3, :].expand(4, 6)
    ea = np.broadcast_to(a[2:3, :], (4, 6))
    assert e.strides == (0, 1)
    assert (e.numpy() == ea).all() and e.numpy().strides == (0, a.itemsize)
    # Through empty() as well, by numpy's dtype object.
    u = client.empty((3,), np_dtype)
    assert u.dtype == name and u.numpy().dtype == a.dtype
    # And back: what numpy writes, tensord's other views see.
    u.numpy()[:] = a[0, :3]
    assert u[1:].numpy().tobytes() == a[0, 1:3].tobytes()
    for x in (t, e, u):
        x.release()


def test_numpy_dtypes_tensord_lacks(client):
    for a in (np.zeros(2, np.float128), np.zeros(2, "U3"), np.zeros(2, object),
              np.zeros(2, "datetime64[ns]"), np.zeros(2, "S2")):
        with pytest.raises(TypeError):
            client.share(a)


@pytest.mark.parametrize("name", ["bfloat16", "float8_e4m3fn", "float8_e5m2"])
def test_dtypes_numpy_lacks(client, name):
    t = client.empty((2, 4), name)
    with pytest.raises(TypeError, match=name) as e:
        t.numpy()
    assert "view_dtype" in str(e.value)
    with pytest.raises(TypeError, match=name):
        t.__array_interface__
    with pytest.raises(BufferError, match=name):
        memoryview(t)
    with pytest.raises(TypeError, match=name):
        np.asarray(t)
    u = t.view_dtype("uint8")
    assert u.dtype == "uint8" and u.shape == (2, 4 * t.itemsize)
    assert u.numpy().ctypes.data == t.data_ptr
    u.numpy()[:] = 0x3F
    assert (t.view_dtype(np.uint8).numpy() == 0x3F).all()
    t.release()
    u.release()


def apply_tensord(op, t):
    kind, arg = op
    if kind == "index":
        return t[arg]
    if kind == "transpose":
        return t.transpose(*arg)
    return t.permute(*arg)


def apply_numpy(op, a):
    kind, arg = op
    if kind == "index":
        r = a[arg]
        # Every dim indexed by an int: numpy gives a scalar, unless an
        # ellipsis asks for a 0-d array view.
        return r if isinstance(r, np.ndarray) else a[arg + (Ellipsis,)]
    if kind == "transpose":
        return np.swapaxes(a, *arg)
    return np.transpose(a, arg)


def random_op(rng, a):
    """An indexing or reordering numpy and tensord both accept on a."""
    nd = a.ndim
    r = rng.random()
    if nd >= 2 and r < 0.15:
        return ("transpose", tuple(rng.sample(range(-nd, nd), 2)))
    if nd >= 1 and r < 0.3:
        p = list(range(nd))
        rng.shuffle(p)
        return ("permute", tuple(p))
    items = []
    consumed = 0
    ellipsis = False
    for _ in range(rng.randint(1, 4)):
        c = rng.random()
        if c < 0.15 and nd + sum(x is None for x in items) < 12:
            items.append(None)
        elif c < 0.25 and not ellipsis:
            items.append(Ellipsis)
            ellipsis = True
        elif consumed < nd:
            # The dim this item lands on, if no ellipsis comes before it.
            size = a.shape[consumed] if not ellipsis else None
            if c < 0.5 and size:
                items.append(rng.randint(-size, size - 1))
            else:
                lo = rng.choice([None, rng.randint(-8, 8)])
                hi = rng.choice([None, rng.randint(-8, 8)])
                items.append(slice(lo, hi, rng.choice([None, 1, 2, 3])))
            consumed += 1
    return ("index", tuple(items))


def test_views_agree_with_numpy_on_random_chains(client):
    seed = 20260901
    rng = random.Random(seed)
    a0 = np.arange(4 * 5 * 6 * 3, dtype=np.int32).reshape(4, 5, 6, 3)
    t0 = client.share(a0)
    base_a = np.asarray(t0.numpy())  # a0's copy: offsets count from it
    checked = 0
    for chain in range(200):
        t, a = t0, base_a
        steps = []
        for _ in range(rng.randint(1, 5)):
            op = random_op(rng, a)
            steps.append(op)
            try:
                na = apply_numpy(op, a)
            except IndexError:
                with pytest.raises(IndexError):  # refused by both
                    apply_tensord(op, t)
                break
            t, a = apply_tensord(op, t), na
            try:
                same_as_numpy(t, a, t0, base_a)
            except AssertionError as e:
                raise AssertionError(f"seed {seed}, chain {chain}: {steps}") from e
            checked += 1
    assert checked > 400, f"seed {seed}: only {checked} steps checked"
    t0.release()


def test_getitem_errors_like_numpy(client):
    t = client.empty((3, 4), "int16")
    with pytest.raises(IndexError):
        t[3]
    with pytest.raises(IndexError):
        t[0, -5]
    with pytest.raises(IndexError, match="too many"):
        t[0, 0, 0]
    with pytest.raises(IndexError, match="ellipsis"):
        t[..., 0, ...]
    with pytest.raises(ValueError, match="step"):
        t[::-1]
    with pytest.raises(ValueError):
        t[::0]
    with pytest.raises(IndexError):
        t[[0, 1]]
    with pytest.raises(IndexError):
        t[True]
    assert t[...].shape == (3, 4) and t[None, ..., None].shape == (1, 3, 4, 1)
    assert t[np.int64(2)].shape == (4,)
    t.release()


def test_view_methods(client):
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    t = client.share(a)
    same_as_numpy(t.permute(2, 0, 1), a.transpose(2, 0, 1), t, a)
    same_as_numpy(t.permute((1, 2, 0)), a.transpose(1, 2, 0), t, a)
    same_as_numpy(t.view(6, 4), a.reshape(6, 4), t, a)
    same_as_numpy(t.view((-1,)), a.reshape(-1), t, a)
    same_as_numpy(t.unsqueeze(1), a[:, None], t, a)
    same_as_numpy(t[:, :1].squeeze(1), a[:, 0], t, a)
    same_as_numpy(t[:1, :, :1].squeeze(), a[0, :, 0], t, a)
    same_as_numpy(t.narrow(2, 1, 2), a[:, :, 1:3], t, a)
    same_as_numpy(t[0].expand(2, 3, 4), np.broadcast_to(a[0], (2, 3, 4)), t, a)
    v = t.view_dtype("int32")
    assert (v.numpy() == a.view(np.int32)).all()
    h = t.view_dtype("float16")
    assert h.shape == (2, 3, 8)
    s = t.as_strided((3, 2), (1, 3), offset=4)
    assert (s.numpy() == np.lib.stride_tricks.as_strided(
        a.reshape(-1)[4:], (3, 2), (4, 12))).all()
    b = t.as_strided((2,), (1,), dtype="uint8")
    assert b.dtype == "uint8" and b.offset == 0
    with pytest.raises(ValueError, match="outside"):
        t.as_strided((25,), (1,))
    with pytest.raises(ValueError):
        t.transpose(0, 3)
    with pytest.raises(ValueError):
        t.permute(0, 1)
    with pytest.raises(ValueError):
        t.transpose(0, 1).view(24)  # needs a copy
    with pytest.raises(ValueError):
        t.expand(3, 3, 4)
    with pytest.raises(IndexError):
        t.narrow(0, 1, 5)
    with pytest.raises(ValueError):
        t[:, :, 1:].view_dtype("float64")
    with pytest.raises(TypeError):
        t.view_dtype("nope")
    assert len(t) == 2
    with pytest.raises(TypeError):
        len(t[0, 0, 0])
    for x in (t, v, h, s, b):
        x.release()


def test_views_keep_storage_and_drop_key(client):
    t = client.share(np.arange(6, dtype=np.int64), key="views")
    u = client.lookup("views")
    assert u.key == "views"
    w = u[2:]
    assert w.key is None and w.storage_id == u.storage_id and w.client is client
    assert "storage %d" % u.storage_id in repr(w)
    assert "key 'views'" in repr(u)
    client.unpublish("views")
    for x in (t, u, w):
        x.release()
    assert "released" in repr(w)


def test_from_dlpack_and_memoryview_are_zero_copy(client):
    t = client.share(np.arange(12, dtype=np.float64).reshape(3, 4))
    v = t[1:, ::2]
    a = np.from_dlpack(v)
    assert a.ctypes.data == v.data_ptr
    assert (a == np.arange(12.0).reshape(3, 4)[1:, ::2]).all()
    assert v.__dlpack_device__() == (1, 0)
    m = memoryview(v)
    assert m.format == "d" and m.shape == (2, 2) and m.strides == (32, 16)
    assert np.asarray(m).ctypes.data == v.data_ptr
    assert m.readonly is False
    n = np.asarray(t)  # the buffer protocol
    assert n.ctypes.data == t.data_ptr
    n[0, 0] = 42
    assert t.numpy()[0, 0] == 42
    # Strided buffers for those that take strides, refused to those that
    # need C-contiguous bytes.
    tt = t.transpose(0, 1)
    assert memoryview(tt).tobytes() == t.numpy().T.tobytes()
    with pytest.raises((BufferError, TypeError)):
        (ctypes.c_char * 96).from_buffer(tt)
    tt.release()
    with pytest.raises(ValueError):
        v.__dlpack__(stream=1)
    m.release()
    del a, n
    t.release()
    v.release()


def test_array_interface(client):
    t = client.share(np.arange(6, dtype=np.int16).reshape(2, 3))
    v = t.transpose(0, 1)
    d = v.__array_interface__
    assert d["version"] == 3 and d["typestr"] == "<i2"
    assert d["shape"] == (3, 2) and d["strides"] == (2, 6)
    assert d["data"] == (v.data_ptr, False)

    class Holder:
        __array_interface__ = d

    a = np.asarray(Holder())
    assert a.ctypes.data == v.data_ptr and (a == np.arange(6).reshape(2, 3).T).all()
    t.release()
    v.release()
