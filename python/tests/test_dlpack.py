"""Tensor.torch(), torch.from_dlpack and share() of torch tensors (the torch
integration itself, tensord.torch, is tested in test_torch*.py)."""

import pytest

torch = pytest.importorskip("torch")

# Every dtype torch 1.13 and tensord share.
DTYPES = [
    (torch.bool, "bool"),
    (torch.uint8, "uint8"),
    (torch.int8, "int8"),
    (torch.int16, "int16"),
    (torch.int32, "int32"),
    (torch.int64, "int64"),
    (torch.float16, "float16"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "float32"),
    (torch.float64, "float64"),
    (torch.complex64, "complex64"),
    (torch.complex128, "complex128"),
]


def sample(dtype, shape):
    g = torch.Generator().manual_seed(7)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_complex:
        return torch.randn(shape, dtype=dtype, generator=g)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=dtype)


def same_as_torch(t, x, base_t):
    y = t.torch()
    assert y.dtype == x.dtype and tuple(y.shape) == tuple(x.shape) == t.shape
    assert tuple(y.stride()) == tuple(x.stride()) == t.strides
    assert torch.equal(y, x)
    if y.numel():
        assert y.data_ptr() == t.data_ptr
        assert t.data_ptr - base_t.data_ptr == (x.data_ptr() - x._base.data_ptr()
                                                 if x._base is not None else 0)


@pytest.mark.parametrize("dtype,name", DTYPES, ids=[n for _, n in DTYPES])
def test_torch_round_trip_every_dtype(client, dtype, name):
    x = sample(dtype, (4, 6))
    t = client.share(x)
    assert t.dtype == name and t.shape == (4, 6) and t.strides == (6, 1)
    y = t.torch()
    assert y.dtype == dtype and torch.equal(y, x) and y.data_ptr() == t.data_ptr
    # Views keep strides and offset.
    same_as_torch(t[1:3, 2:], x[1:3, 2:], t)
    same_as_torch(t.transpose(0, 1), x.t(), t)
    same_as_torch(t[::2, 1::2], x[::2, 1::2], t)
    same_as_torch(t[1:2].expand(3, 6), x[1:2].expand(3, 6), t)
    # Writes through torch land in the storage.
    y[0, 0] = x[1, 1]
    assert torch.equal(t.torch()[0, 0], x[1, 1])
    # torch.from_dlpack of the Tensor itself, and of a view of it.
    if dtype != torch.bool:  # DLPack 0.6 carries bool as uint8
        z = torch.utils.dlpack.from_dlpack(t[2:])
        assert z.data_ptr() == t[2:].data_ptr and z.dtype == dtype
    e = client.empty((2, 2), dtype)
    assert e.dtype == name and e.torch().dtype == dtype
    for v in (t, e):
        v.release()


def test_share_of_views_and_noncontiguous(client):
    x = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    for src in (x[:, 1:, ::2], x.permute(2, 0, 1), x[1], x.expand(2, 2, 3, 4)[1]):
        t = client.share(src)
        assert t.shape == tuple(src.shape) and torch.equal(t.torch(), src)
        assert t.torch().is_contiguous()
        t.release()
    with pytest.raises(RuntimeError):  # torch refuses: needs detach()
        client.share(torch.ones(2, requires_grad=True))


def test_dtypes_torch_lacks(client):
    for name in ("uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"):
        t = client.empty(4, name)
        with pytest.raises(TypeError, match=name) as e:
            t.torch()
        assert "view_dtype" in str(e.value)
        bits = t.itemsize * 8
        assert t.view_dtype(f"int{bits}").torch().dtype == getattr(torch, f"int{bits}")
        t.release()
    # float8 has no DLPack 0.6 code either.
    f8 = client.empty(2, "float8_e5m2")
    with pytest.raises(TypeError):
        f8.__dlpack__()
    f8.release()


def test_numpy_and_torch_see_the_same_bytes(client):
    t = client.empty((3, 3), "float32")
    a, x = t.numpy(), t.torch()
    x.fill_(2.5)
    assert (a == 2.5).all()
    a[1] = 0
    assert x[1].sum() == 0 and x.sum() == 15
    t.release()
    del a, x
