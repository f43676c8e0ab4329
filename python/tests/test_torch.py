"""Tensor.torch(): round trips for every dtype torch has, views, read-only."""

import pytest
import torch

import tensord
from tensord import _tensord

# Every dtype that both tensord and torch 1.13 have.
TORCH_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]
# tensord dtypes torch 1.13 lacks.
NOT_IN_TORCH = ["uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2"]


def sample(dtype, shape, seed=0):
    """Distinct, exactly representable values of dtype."""
    n = 1
    for s in shape:
        n *= s
    g = torch.Generator().manual_seed(seed)
    v = torch.randperm(n, generator=g).reshape(shape)
    if dtype == torch.bool:
        return v % 3 == 0
    if dtype in (torch.uint8, torch.int8):
        return (v % 100).to(dtype)
    if dtype.is_complex:
        return torch.complex(v.double(), -v.double() / 4).to(dtype)
    return (v - n // 2).to(dtype)


def filled(client, src):
    """A new storage holding src's values, contiguous."""
    t = client.empty(tuple(src.shape), src.dtype)
    t.torch().copy_(src)
    return t


def check_same(got, want, base_ptr, offset, itemsize):
    """got (over tensord) agrees with want (torch's own view) in full."""
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert got.stride() == want.stride()
    assert torch.equal(got, want)
    if got.numel():
        assert got.data_ptr() == base_ptr + offset * itemsize


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_round_trip_every_dtype(client, dtype):
    src = sample(dtype, (6, 8))
    t = filled(client, src)
    x = t.torch()
    assert t.dtype == str(dtype)[len("torch.") :]
    assert x.dtype == dtype and x.shape == (6, 8) and x.stride() == (8, 1)
    assert torch.equal(x, src)
    assert x.data_ptr() == t.data_ptr  # no copy
    ptr, isz = t.data_ptr, x.element_size()

    views = {
        "sliced": (t[2:5], src[2:5]),
        "stepped": (t[1::2, 3::3], src[1::2, 3::3]),
        "transposed": (t.transpose(0, 1), src.transpose(0, 1)),
        "permuted_slice": (t[1:, 2:7].permute(1, 0), src[1:, 2:7].permute(1, 0)),
        "expanded": (t[3:4, 2:7].expand(4, 5), src[3:4, 2:7].expand(4, 5)),
        "row": (t[4], src[4]),
        "element": (t[5, 7], src[5, 7]),
        "new_axis": (t[None, 2, ::4], src[None, 2, ::4]),
        "empty": (t[3:3], src[3:3]),
    }
    for name, (v, want) in views.items():
        got = v.torch()
        if want.numel():  # an empty view's offset means nothing (tensord: 0)
            assert v.offset == want.storage_offset(), name
        assert v.strides == want.stride(), name
        check_same(got, want, ptr, v.offset, isz)
    # The tensor sees later writes through the storage: it is the same memory.
    y = t[1::2, 3::3].torch()
    x[1, 3] = src[0, 0]
    assert torch.equal(y[0, 0], src[0, 0])


@pytest.mark.parametrize("dtype", TORCH_DTYPES, ids=str)
def test_torch_published_view_round_trip(client, dtype):
    """A view published under a key comes back from lookup exactly."""
    src = sample(dtype, (5, 7), seed=1)
    t = filled(client, src)
    v = t[1:, 1::3].transpose(0, 1)
    client.publish("torch/view", v)
    got = client.lookup("torch/view", timeout=0)
    try:
        assert got.storage_id == t.storage_id
        assert got.offset == v.offset and got.strides == v.strides
        check_same(got.torch(), src[1:, 1::3].transpose(0, 1), t.data_ptr, v.offset,
                   src.element_size())
    finally:
        client.unpublish("torch/view")
        got.release()
        t.release()


@pytest.mark.parametrize("name", NOT_IN_TORCH)
def test_dtypes_torch_lacks_raise_type_error(client, name):
    t = client.empty((4,), name)
    with pytest.raises(TypeError, match=name):
        t.torch()
    # The bytes stay reachable through a dtype torch has.
    assert t.view_dtype("uint8").torch().shape[0] == 4 * _tensord.dtype_size(name)
    t.release()


def test_torch_dtype_spellings(client):
    for spelling in (torch.float16, "float16", "half"):
        t = client.empty((2, 2), spelling)
        assert t.torch().dtype == torch.float16
        t.release()


def test_torch_tensor_keeps_storage_alive(client):
    before = client.stat()["storages"]
    t = client.empty((16,), torch.int32)
    x = t.torch()
    sid = t.storage_id
    t.release()
    x.fill_(7)  # still mapped: the torch tensor holds its own reference
    assert any(s["id"] == sid for s in client.ls())
    del x
    assert client.stat()["storages"] == before


def test_torch_write_to_readonly_lookup_neither_crashes_nor_reaches_shared(client):
    src = sample(torch.float32, (64, 1024))  # 64 pages
    t = filled(client, src)
    client.publish("torch/ro", t)
    ro = client.lookup("torch/ro", timeout=0, readonly=True)
    assert ro.readonly
    x = ro.torch()
    x.fill_(-1.0)  # would be SIGSEGV with a plain read-only mapping
    x[3, 5] = 42.0
    assert float(x[3, 5]) == 42.0  # the writer sees its private copy
    # The shared pages did not change: the writable mapping shows them.
    assert torch.equal(t.torch(), src)
    # A read-only storage is not published from (it may hold private pages).
    with pytest.raises(tensord.PermissionDenied):
        client.publish("torch/ro2", ro)
    # The private copies go with the copy-on-write mapping.
    del x
    ro.release()
    again = client.lookup("torch/ro", timeout=0, readonly=True)
    assert torch.equal(again.torch(), src)
    client.unpublish("torch/ro")
    again.release()
    t.release()
