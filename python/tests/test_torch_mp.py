"""tensord.torch.install(): tensors through torch.multiprocessing via tensord."""

import os
import signal
import time
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
import torch.multiprocessing as mp

import tensord
import tensord.torch as tdt
from conftest import Daemon, nothing_left, wait_until
from tensord import _tensord


def in_flight_keys(client):
    return sorted(
        k for s in client.ls() for k in s["keys"] if k.startswith(tdt.KEY_PREFIX)
    )


def storage_of(x):
    """(storage id, byte offset) of tensor x's bytes in tensord, or None."""
    hit = _tensord.find(x.data_ptr())
    if hit is None:
        return None
    base, off = hit
    sid = base.storage_id
    base.release()
    return sid, off



@pytest.fixture
def clean(client):
    """No reducer installed and no scope in the environment, before and after."""
    tdt.uninstall()
    for k in (tdt.ENV_SCOPE, tdt.ENV_SOCKET):
        os.environ.pop(k, None)
    yield client
    tdt.uninstall()
    for k in (tdt.ENV_SCOPE, tdt.ENV_SOCKET):
        os.environ.pop(k, None)
    wait_until(lambda: nothing_left(client), "no storage and no key left")


@pytest.fixture
def installed(clean):
    tdt.install(clean)
    assert tdt.installed()
    yield clean


def tensord_tensor(client, values):
    t = client.empty(tuple(values.shape), values.dtype)
    x = t.torch()
    x.copy_(values)
    return t, x


# -- in one process: what the reducer publishes --------------------------------


def test_tensord_tensor_is_sent_without_copy(installed):
    c = installed
    t, x = tensord_tensor(c, torch.arange(40, dtype=torch.float64).reshape(5, 8))
    v = x[1:, 2::3]  # offset, steps
    nstorages = c.stat()["storages"]
    data = ForkingPickler.dumps(v)
    assert c.stat()["storages"] == nstorages  # no new storage: no copy
    (key,) = in_flight_keys(c)
    token = int(os.environ[tdt.ENV_SCOPE], 16)
    assert key.startswith("%s%016x/%d." % (tdt.KEY_PREFIX, token, os.getpid()))
    y = ForkingPickler.loads(data)
    assert in_flight_keys(c) == []  # taken
    assert storage_of(y) == (t.storage_id, v.storage_offset() * 8)
    assert y.stride() == v.stride() and torch.equal(y, v)
    with pytest.raises(tensord.NotFound):
        ForkingPickler.loads(data)  # one pickle, one receiver
    del x, v, y
    t.release()


def test_foreign_tensor_is_copied_once(installed):
    c = installed
    src = torch.arange(12, dtype=torch.int32).reshape(3, 4).t()  # not contiguous
    data = ForkingPickler.dumps(src)
    (s,) = c.ls()  # exactly one new storage, holding the in-flight key
    assert s["nbytes"] == src.numel() * 4 and len(s["keys"]) == 1
    y = ForkingPickler.loads(data)
    assert storage_of(y) == (s["id"], 0)
    assert y.is_contiguous() and torch.equal(y, src)
    assert y.data_ptr() != src.data_ptr()
    del y


def test_tensor_of_a_readonly_lookup_is_copied_as_its_reader_sees_it(installed):
    c = installed
    t, x = tensord_tensor(c, torch.arange(8, dtype=torch.int16))
    c.publish("mp/ro", t)
    ro = c.lookup("mp/ro", timeout=0, readonly=True)
    y = ro.torch()
    y[0] = 99  # a private copy-on-write page: only this process sees it
    z = ForkingPickler.loads(ForkingPickler.dumps(y))
    assert storage_of(z)[0] not in (t.storage_id, None)  # copied
    assert z.tolist() == [99] + list(range(1, 8))
    assert x.tolist() == list(range(8))  # the shared pages never changed
    c.unpublish("mp/ro")
    del x, y, z
    ro.release()
    t.release()


def test_parameter_and_requires_grad_survive(installed):
    p = torch.nn.Parameter(torch.randn(3, 2))
    leaf = torch.randn(4, requires_grad=True)
    q, l2 = ForkingPickler.loads(ForkingPickler.dumps((p, leaf)))
    assert isinstance(q, torch.nn.Parameter) and q.requires_grad
    assert torch.equal(q.detach(), p.detach())
    assert l2.requires_grad and not isinstance(l2, torch.nn.Parameter)
    assert storage_of(q) is not None and storage_of(l2) is not None
    with pytest.raises(RuntimeError, match="non-leaf"):
        ForkingPickler.dumps(leaf * 2)  # torch's own refusal
    del q, l2


@pytest.mark.filterwarnings("ignore:ComplexHalf")
def test_tensors_tensord_cannot_hold_go_through_torch(installed):
    c = installed
    x = torch.arange(3, dtype=torch.float32).to(torch.complex32)
    y = ForkingPickler.loads(ForkingPickler.dumps(x))
    assert y.dtype == torch.complex32 and torch.equal(y.real, x.real)
    assert storage_of(y) is None and not c.ls()


def test_conjugate_view_arrives_resolved(installed):
    t, x = tensord_tensor(installed, torch.tensor([1 + 2j, 3 - 4j]))
    v = x.conj()  # a conj bit over tensord bytes: cannot be sent as a view
    y = ForkingPickler.loads(ForkingPickler.dumps(v))
    assert not y.is_conj() and torch.equal(y, v.resolve_conj())
    assert storage_of(y)[0] != t.storage_id
    del x, v, y
    t.release()


def test_scope_that_ended_is_replaced(installed):
    c = installed
    first = int(os.environ[tdt.ENV_SCOPE], 16)
    c.scope_close(first)
    data = ForkingPickler.dumps(torch.ones(5))
    second = int(os.environ[tdt.ENV_SCOPE], 16)
    assert second != first
    assert in_flight_keys(c)[0].startswith("%s%016x/" % (tdt.KEY_PREFIX, second))
    assert torch.equal(ForkingPickler.loads(data), torch.ones(5))


def test_uninstall_gives_torch_its_reducers_back(installed):
    from torch.multiprocessing.reductions import reduce_tensor

    c = installed
    tdt.uninstall()
    assert not tdt.installed() and tdt.ENV_SCOPE not in os.environ
    assert ForkingPickler._extra_reducers[torch.Tensor] is reduce_tensor
    y = ForkingPickler.loads(ForkingPickler.dumps(torch.ones(3)))
    assert torch.equal(y, torch.ones(3)) and not c.ls()


# -- across processes ------------------------------------------------------------


def _echo(path, q_in, q_out):
    """Receives a tensor, writes into it, sends back where it lies and a view."""
    tdt.install(tdt.client_for(path))  # a spawned child has to; forked: no-op
    y = q_in.get(timeout=60)
    where = storage_of(y)
    y.add_(1000)  # seen by the sender only if nothing was copied
    q_out.put((where, y.stride(), y[:, ::2]))
    q_out.close()
    q_out.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_queue_round_trip_without_copy(installed, daemon, method):
    c = installed
    ctx = mp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo, args=(daemon, q_in, q_out))
    p.start()
    ref = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    t, x = tensord_tensor(c, ref)
    v = x[1:, 1::2]
    q_in.put(v)
    where, stride, back = q_out.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    assert where == (t.storage_id, v.storage_offset() * 4)  # same storage
    assert stride == v.stride()
    want = ref.clone()
    want[1:, 1::2] += 1000
    assert torch.equal(x, want)  # the child's write landed in our storage
    assert storage_of(back) == (t.storage_id, v.storage_offset() * 4)
    assert torch.equal(back, want[1:, 1::2][:, ::2])
    del x, v, back
    t.release()


def _send_and_exit(path, q):
    c = tdt.client_for(path)
    t = c.empty((3, 4), "int64")
    x = t.torch()
    x.copy_(torch.arange(12).reshape(3, 4))
    q.put((t.storage_id, x.t()))
    q.close()
    q.join_thread()  # pickled and written: the key is published


def test_sender_that_exits_before_the_receiver_unpickles(installed, daemon):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_send_and_exit, args=(daemon, q))
    p.start()
    p.join(30)
    assert p.exitcode == 0
    sid, y = q.get(timeout=10)
    assert storage_of(y) == (sid, 0)
    assert y.stride() == (1, 4)
    assert torch.equal(y, torch.arange(12).reshape(3, 4).t())
    del y


def _send_inherited(q, x):
    q.put(x[1:])  # a tensor this forked child inherited, not received
    q.close()
    q.join_thread()


def test_forked_child_sends_an_inherited_tensor_without_copy(installed):
    c = installed
    t, x = tensord_tensor(c, torch.arange(6, dtype=torch.int32))
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_send_inherited, args=(q, x))  # fork: not pickled
    p.start()
    y = q.get(timeout=30)
    p.join(30)
    assert p.exitcode == 0
    assert storage_of(y) == (t.storage_id, 4)
    assert y.tolist() == [1, 2, 3, 4, 5]
    del x, y
    t.release()


def _never_reads(q):
    time.sleep(60)


def _root(path, ready, go):
    """The first install() of its tree: owns the scope. Sends two tensors to
    a receiver that is killed before reading them, then waits to exit."""
    c = tensord.connect(path)
    tdt.install(c)
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    r = ctx.Process(target=_never_reads, args=(q,))
    r.start()
    t = c.empty((1000,), "float32")
    x = t.torch()
    x.fill_(1.0)
    q.put(x)  # no copy
    q.put(torch.ones(10))  # copied once
    q.close()
    q.join_thread()
    os.kill(r.pid, signal.SIGKILL)
    r.join()
    del x
    t.release()
    ready.set()
    go.wait(30)


def test_receiver_that_dies_before_unpickling_leaks_nothing(clean, daemon):
    c = clean
    ctx = mp.get_context("fork")
    ready, go = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_root, args=(daemon, ready, go))
    p.start()
    assert ready.wait(30)
    assert len(in_flight_keys(c)) == 2  # both alive, held by their keys only
    assert len(c.ls()) == 2
    go.set()
    p.join(30)
    assert p.exitcode == 0
    wait_until(lambda: nothing_left(c), "the scope's keys dropped with its owner")


def test_tensor_of_another_daemon_is_copied(installed):
    """Storage ids are per daemon instance: a tensor whose storage belongs to
    another tensord is copied, never sent as an id the installed daemon would
    read as one of its own storages."""
    c = installed
    other = Daemon()
    try:
        with tensord.connect(other.sock) as oc:
            assert oc.instance != c.instance
            t, x = tensord_tensor(oc, torch.arange(16, dtype=torch.int64))
            assert t.instance == oc.instance
            mine = c.empty((16,), "int64")  # the same id may exist here
            data = ForkingPickler.dumps(x)
            (key,) = in_flight_keys(c)
            y = ForkingPickler.loads(data)
            assert torch.equal(y, x) and y.data_ptr() != x.data_ptr()
            assert storage_of(y)[0] not in (mine.storage_id, None)
            del x, y
            t.release()
            mine.release()
    finally:
        other.stop()


# -- tensord.Tensor itself through torch.multiprocessing -------------------------


def _echo_td(path, q_in, q_out):
    """Receives tensord.Tensors, writes into the first, sends back what it
    saw and the Tensor itself."""
    tdt.install(tdt.client_for(path))  # a spawned child has to; forked: no-op
    v, ro, u16 = q_in.get(timeout=60)
    seen = [
        (type(x).__name__, x.storage_id, x.dtype, x.shape, x.strides, x.offset,
         x.readonly, x.numpy().tolist())
        for x in (v, ro, u16)
    ]
    v.numpy()[...] += 1000  # seen by the sender only if nothing was copied
    q_out.put((seen, v))
    q_out.close()
    q_out.join_thread()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_tensord_tensor_through_a_queue(installed, daemon, method):
    """A tensord.Tensor put on a torch.multiprocessing queue arrives as a
    tensord.Tensor: its own storage and view when writable, a copy of what
    a read-only reader sees otherwise; any dtype, uint16 included."""
    c = installed
    ctx = mp.get_context(method)
    q_in, q_out = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=_echo_td, args=(daemon, q_in, q_out))
    p.start()
    t = c.empty((4, 6), "float32")
    ref = torch.arange(24, dtype=torch.float32).reshape(4, 6).numpy()
    t.numpy()[...] = ref
    v = t[1:, ::2]
    c.publish("mp/td-ro", t)
    ro = c.lookup("mp/td-ro", timeout=0, readonly=True)
    u16 = c.empty((3,), "uint16")
    u16.numpy()[...] = [1, 2, 65535]
    q_in.put((v, ro, u16))
    seen, back = q_out.get(timeout=60)
    p.join(30)
    assert p.exitcode == 0
    sv, sro, su = seen
    assert sv == ("Tensor", t.storage_id, "float32", (3, 3), (6, 2), 6, False,
                  ref[1:, ::2].tolist())  # the same storage and view
    assert sro[1] not in (t.storage_id, ro.storage_id)  # copied
    assert sro[2:5] == ("float32", (4, 6), (6, 1)) and not sro[6]
    assert sro[7] == ref.tolist()
    assert su[2:5] == ("uint16", (3,), (1,)) and su[7] == [1, 2, 65535]
    # The child's write landed in our storage, and v came back as itself.
    assert t.numpy()[1, 0] == 1006.0 and t.numpy()[1, 1] == 7.0
    assert isinstance(back, tensord.Tensor)
    assert (back.storage_id, back.shape, back.strides, back.offset) == (
        t.storage_id, (3, 3), (6, 2), 6)
    assert v.key is None  # sending does not change the sender's Tensor
    assert in_flight_keys(c) == []
    c.unpublish("mp/td-ro")
    for x in (back, v, ro, u16, t):
        x.release()


def test_tensord_tensor_of_another_daemon_is_copied(installed):
    c = installed
    other = Daemon()
    try:
        with tensord.connect(other.sock) as oc:
            t = oc.share(b"from the other daemon")
            y = ForkingPickler.loads(ForkingPickler.dumps(t))
            assert y.instance == c.instance
            assert bytes(memoryview(y)) == b"from the other daemon"
            y.release()
            t.release()
    finally:
        other.stop()


def test_what_cannot_be_sent_raises_in_the_consumer_not_hang(clean):
    """A multiprocessing.Queue pickles in its feeder thread after put()
    returned; what cannot be pickled raises in the consumer's get() instead
    of leaving it to wait forever. Where the caller pickles, it raises
    there."""
    c = clean
    q = mp.get_context("fork").Queue()
    t = c.share(b"abc")
    q.put(t)  # not installed: no way to send it
    with pytest.raises(TypeError, match="install()") as e:
        q.get(timeout=60)
    assert "feeder thread" in str(e.value)
    with pytest.raises(TypeError, match="install()"):
        ForkingPickler.dumps(t)  # in this thread: raises here
    tdt.install(c)
    r = c.share(b"xyz")
    r.release()
    q.put(r)  # released: nothing to send
    with pytest.raises(ValueError, match="released"):
        q.get(timeout=60)
    q.put(t)  # the queue still works
    y = q.get(timeout=60)
    assert bytes(memoryview(y)) == b"abc" and y.storage_id == t.storage_id
    q.close()
    q.join_thread()
    y.release()
    t.release()


def test_without_install_torchs_reducer_moves_the_senders_tensor_out(clean):
    """docs/python.md (is_shared): torch's own reducer share_memory_()s a
    tensor whose storage it did not allocate, in the sender: the sender's
    tensor then lives in torch's shared memory, no longer in tensord."""
    c = clean
    t = c.empty((4,), "float32")
    x = t.torch()
    before = x.data_ptr()
    assert not x.is_shared()
    ForkingPickler.dumps(x)
    assert x.is_shared() and x.data_ptr() != before
    x.fill_(3.0)
    assert t.numpy().tolist() == [0.0] * 4  # the storage no longer sees it
    del x
    t.release()
