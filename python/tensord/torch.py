"""PyTorch integration: tensors through tensord across processes.

Four pieces, all pure Python over the ``tensord._tensord`` extension:

``install(client=None)`` / ``uninstall()``
    Reducers for ``torch.multiprocessing``: CPU tensors put on a torch queue or
    pipe, passed to a spawned process, or returned by a DataLoader worker
    travel as a reference to a tensord storage plus a view, instead of
    through torch's own shared-memory files.

``DataLoader``
    A drop-in ``torch.utils.data.DataLoader`` whose workers collate straight
    into the slots of a tensord channel, which the main process receives
    without a copy, a pipe or a daemon call.

``publish_state_dict`` / ``load_state_dict``
    A state dict as one packed storage under one key: many processes map the
    same pages, loading is one lookup, updates are atomic for readers.

Reducers (``install``)
----------------------
For a tensor that is on the CPU, dense and strided, of a dtype tensord has
(everything torch 1.13 has but complex32 and the quantized types), not a
non-leaf that requires grad, without named dimensions, the reducer

1. asks ``tensord._tensord.find(t.data_ptr())`` whether the bytes already lie
   in a tensord storage this process holds (a tensor made by ``.torch()``, a
   DataLoader batch, a tensor received from another process). If they do, the
   storage is writable (not a read-only or copy-on-write mapping, whose
   private pages other processes could not see) and the element offset is
   whole, the tensor is sent as that storage with its exact view (dtype,
   shape, strides, offset): no byte is copied. Otherwise the tensor is copied
   once into a new storage (contiguous, uninitialised before the copy, so
   recycled by the daemon). A storage of another daemon than the installed
   client's (``Tensor.instance`` against ``Client.instance``: ids are per
   daemon instance) is copied like a foreign tensor.
2. publishes the view under a one-shot key ``tensord.mp/<scope>/<pid>.<n>``
   into a *scope* (below), and pickles ``(socket path, key, requires_grad,
   is Parameter)``.
3. The receiver's unpickling takes the key (``lookup(take=True)``): it now
   holds its own reference and the key is gone. Each pickle can therefore be
   loaded once. Two views of one storage in one message arrive as two torch
   tensors over the same bytes that do not share a torch storage object.

Every other tensor (CUDA, sparse, quantized, complex32, non-leaf requiring
grad, named) goes through torch's own reducer, unchanged.

A ``tensord.Tensor`` travels the same way (a one-shot key in the scope) and
arrives as a ``tensord.Tensor``: a writable one of the installed client's
daemon as its own storage and view, a read-only one or another daemon's
copied once (``Client.share``). What a reducer cannot send (a released
Tensor, a publish the daemon refuses) raises where the caller pickles; in a
``multiprocessing.Queue``'s feeder thread, which pickles after ``put()`` has
returned, the error is pickled instead and the consumer's ``get()`` raises
it (``tensord._unsendable``), so no consumer waits forever.

Who frees a tensor in flight: the key holds a reference from the moment the
sender pickles it until a receiver takes it, so the sender may release its
own at once and even exit before the receiver unpickles (a DataLoader worker
that ends its epoch). A key that no one takes (the receiver died first, the
message was never read) must not live forever either: one-shot keys are
published into a scope, and the daemon drops every key of a scope when the
scope ends. The first process of a process tree to call ``install()`` opens
the scope with its own connection and exports it in the environment
(``TENSORD_MP_SCOPE``: the token in hex, ``TENSORD_MP_SOCKET``: the daemon's
socket path), so that forked and spawned descendants that call ``install()``
publish into the same scope instead of opening their own. The scope ends
when its owner's connection closes, however the owner ends (SIGKILL
included), or at ``uninstall()``. So nothing outlives the root of the process
tree, and nothing is released before a receiver could take it while the root
lives. If a descendant finds the scope ended (its root is gone), it opens a
scope of its own and becomes the root of its subtree.

Forked children inherit the registered reducers with the rest of the
process; a spawned child must call ``install()`` itself (as it must import
its own modules) if it sends tensors; receiving needs nothing installed. One
process-global client per socket path (``client_for``) serves all this; the
extension's Client reconnects by itself in a forked child.

DataLoader
----------
``DataLoader`` subclasses ``torch.utils.data.DataLoader`` and keeps its
sampler, batch sampler, worker loop, seeding, ordering, prefetching,
persistent workers and error handling: the same arguments give the same
batches in the same order. What differs:

- Without a ``collate_fn`` (or with torch's ``default_collate``) batches are
  collated by ``default_collate`` below: torch's own ``collate`` with the
  same rules (nested dicts, lists, tuples, namedtuples, numbers, numpy arrays
  and scalars, strings), except that each tensor it makes is allocated in a
  tensord storage (``client.empty(..., uninit=True)``) and filled by
  ``torch.stack(..., out=)``. A user's ``collate_fn`` is called as is; the
  tensors it returns that are not already in tensord are copied once by the
  reducer, as torch copies them into its shared memory.
- With workers, the iterator opens a scope before starting them and passes
  it to them (a wrapper around ``worker_init_fn`` installs the reducers in
  each worker with that scope). By default (``channel=True``) their results
  come through channels instead of torch's result queue (see "DataLoader
  batches through a channel" below): a batch is collated into a slot, and
  only what does not fit a slot, or comes before the slots exist, travels
  as keys in that scope. With ``channel=False`` every batch travels as keys
  through torch's queue. When the iterator shuts its workers down (end of
  epoch, deletion, a worker's death raising in the main process, exactly as
  torch raises it) the main process closes the scope and drains the
  channels: every batch still in flight is freed. A batch the
  training loop drops releases its storage (the torch tensor's DLPack
  deleter), and the daemon recycles it for the next uninitialised create.
- With ``num_workers=0`` the same collate runs in the main process: batches
  are tensord storages there too (so they can be sent on without a copy).

State dicts
-----------
``publish_state_dict`` packs a state dict into ONE storage: the header
``b"TDSTATE1"``, the manifest length (little-endian u64) and a JSON manifest
(per tensor: dtype, shape, stride, storage_offset in elements and a region
index; per region: byte offset in the packed storage and nbytes), then each
distinct torch storage behind the tensors copied once, 64-byte aligned.
Tensors that shared a torch storage (tied weights, views) share a region.
The storage is published under the one key ``prefix``; publishing again
replaces the key atomically, so a reader gets all old or all new tensors.

``load_state_dict`` looks the key up once (read-only by default: a
copy-on-write mapping, so a write through a loaded tensor changes only the
writer's private copy and never crashes), exports one torch tensor per region
(one DLPack export each, no daemon call), and makes every entry with
``torch.as_strided`` over that region: dtype, shape, strides and storage
offset are the original ones and entries that shared a torch storage share
one again. The loaded tensors hold the version they were loaded from: a new
publish does not change them.

Processes that load one state dict share its pages, but a module built the
usual way (``Net()``) allocates weights of its own in each process, and
``model.load_state_dict(sd)`` copies into those: to serve without a copy per
process, build the module on the meta device (``meta_device()``) and bind it
to the loaded tensors with ``attach`` (docs/python.md, "Memory with
nn.Modules").

Serving: ``attach`` and ``follow``
----------------------------------
``attach(model, weights)`` makes each parameter a ``Parameter`` over the
weights' tensor (``requires_grad=False``) and each buffer the tensor itself,
keeping ties, refusing (or with ``strict=False`` reporting) missing,
unexpected and mismatched names. ``follow(name, callback)`` keeps a server on
the latest version published under ``name``: a thread blocked on the
daemon's events (``tensord.watch``) loads each new version and calls the
callback, whose value requests take from ``Follower.current``.
"""

from __future__ import annotations

import collections.abc
import io
import itertools
import json
import re
import logging
import os
import pickle
import queue
import tempfile
import threading
import time
import traceback
from typing import Any, Callable, Dict, Mapping, Optional

import torch
import torch.utils.data
from multiprocessing.reduction import ForkingPickler
from torch.utils.data import dataloader as _dataloader
from torch.utils.data._utils import collate as _collate

import tensord
from tensord import _tensord

__all__ = [
    "install",
    "uninstall",
    "installed",
    "client_for",
    "DataLoader",
    "default_collate",
    "publish_state_dict",
    "load_state_dict",
    "load_safetensors",
    "save_safetensors",
    "Weights",
    "version_of",
    "meta_device",
    "attach",
    "AttachError",
    "IncompatibleKeys",
    "Mismatch",
    "follow",
    "Follower",
]

ENV_SCOPE = "TENSORD_MP_SCOPE"
ENV_SOCKET = "TENSORD_MP_SOCKET"
KEY_PREFIX = "tensord.mp/"

# torch dtypes that tensord has (the others go through torch's reducer).
_TD_DTYPES = frozenset(
    [
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
)

# --------------------------------------------------------------------------
# Process-global clients.

_NAME_MAX = 63  # bytes of a client name tensord keeps (TD_CLIENT_NAME_MAX)

_clients_lock = threading.Lock()
_clients: Dict[Optional[str], Any] = {}
_own_clients: set = set()  # ids of the clients client_for() connected itself
# The name client_for() connects with (None: libtensord's default, the
# program's); a DataLoader worker's is "<program> worker <id>".
_process_name: Optional[str] = None


def client_for(path: Optional[str] = None) -> "tensord.Client":
    """Returns this process's shared Client for socket ``path``.

    ``path`` None means the default socket path (``$TENSORD_SOCKET`` and the
    rest of libtensord's rule). The client is connected on first use and
    reused afterwards, also by forked children (the Client reconnects by
    itself after a fork). A closed client is replaced by a new connection.
    It connects with the default name (the program's), or in a DataLoader
    worker with "<program> worker <id>".
    """
    with _clients_lock:
        c = _clients.get(path)
        if c is None or c.closed:
            c = tensord.connect(path, name=_process_name)
            _clients[path] = c
            _clients[c.path] = c
            _own_clients.add(id(c))
        return c


def _adopt_client(c: "tensord.Client") -> None:
    """Makes c the shared client for its socket path (install(client))."""
    with _clients_lock:
        _clients[c.path] = c


def _forget_clients() -> None:
    """Closes the clients client_for() connected and forgets them all."""
    with _clients_lock:
        for c in set(_clients.values()):
            if id(c) in _own_clients:
                try:
                    c.close()
                except tensord.Error:
                    pass
        _clients.clear()
        _own_clients.clear()


# --------------------------------------------------------------------------
# Reducers and the scope of keys in flight.


class _MPState:
    """What install() set up in this process."""

    def __init__(self) -> None:
        self.client = None  # the client reducers publish through
        self.scope: Optional[int] = None  # token keys are published into
        self.owner_pid: Optional[int] = None  # pid that opened self.scope
        self.installed = False


_state = _MPState()
_state_lock = threading.RLock()
_counter = itertools.count()


def _env_scope(path: str) -> Optional[int]:
    """Returns the scope an ancestor exported for daemon ``path``, or None."""
    token = os.environ.get(ENV_SCOPE)
    if not token:
        return None
    sock = os.environ.get(ENV_SOCKET)
    if sock is not None and sock != path:
        return None
    try:
        return int(token, 16)
    except ValueError:
        return None


def _open_scope(client) -> int:
    """Opens a scope owned by this process and exports it. Needs the lock."""
    token = client.scope_open()
    _state.scope = token
    _state.owner_pid = os.getpid()
    os.environ[ENV_SCOPE] = "%016x" % token
    os.environ[ENV_SOCKET] = client.path
    return token


def _end_scope() -> None:
    """Closes the scope if this process opened it, then forgets it."""
    st = _state
    if st.scope is not None and st.owner_pid == os.getpid():
        try:
            st.client.scope_close(st.scope)
        except tensord.Error:
            pass  # it ended already (the daemon restarted, the client closed)
        if os.environ.get(ENV_SCOPE) == "%016x" % st.scope:
            os.environ.pop(ENV_SCOPE, None)
            os.environ.pop(ENV_SOCKET, None)
    st.scope = None
    st.owner_pid = None


def _register() -> None:
    ForkingPickler.register(torch.Tensor, _reduce_tensor)
    ForkingPickler.register(torch.nn.parameter.Parameter, _reduce_tensor)
    ForkingPickler.register(_tensord.Tensor, _reduce_td_tensor)


def install(client=None) -> None:
    """Sends CPU tensors through tensord in torch.multiprocessing pickles.

    Registers reducers for torch.Tensor and torch.nn.Parameter with
    multiprocessing's ForkingPickler (which torch's queues, pipes and
    DataLoader workers use). ``client``: the Client to publish through; None
    takes the shared client of the socket an ancestor's install() exported
    (``TENSORD_MP_SOCKET``), else of the default socket path. The first
    install() of a process tree opens the scope that keys in flight live in
    (see the module's documentation); a later one, or one in a descendant,
    reuses it. Calling it again with another client moves to that client
    (and its daemon). Raises tensord.Error if the daemon cannot be reached.
    """
    with _state_lock:
        if client is None:
            client = (
                _state.client
                if _state.client is not None and not _state.client.closed
                else client_for(os.environ.get(ENV_SOCKET))
            )
        else:
            _adopt_client(client)
        if _state.client is not None and _state.client is not client:
            if _state.client.path != client.path:
                _end_scope()
        _state.client = client
        if _state.scope is None:
            inherited = _env_scope(client.path)
            if inherited is not None:
                _state.scope = inherited
                _state.owner_pid = None
            else:
                _open_scope(client)
        _register()
        _state.installed = True


def uninstall() -> None:
    """Undoes install(): torch's reducers again, and the scope closed.

    Closes the scope only in the process that opened it (keys still in flight
    in it are freed) and then removes it from the environment. Forgets and
    closes the clients ``client_for`` connected (not a client passed to
    install()). Safe to call when not installed.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    with _state_lock:
        ForkingPickler.register(torch.Tensor, reduce_tensor)
        ForkingPickler.register(torch.nn.parameter.Parameter, reduce_tensor)
        ForkingPickler.register(_tensord.Tensor, tensord._reduce_tensor)
        _end_scope()
        _state.client = None
        _state.installed = False
        _forget_clients()


def installed() -> bool:
    """True when this process's pickler sends tensors through tensord."""
    return _state.installed


def _worker_setup(path: Optional[str], scope: int, name: str) -> None:
    """Installs the reducers in a DataLoader worker, publishing into scope,
    through a client of its own named name."""
    global _process_name
    with _clients_lock:
        # A forked worker inherits its parent's clients, which would
        # reconnect under the parent's name: this process is told apart.
        _process_name = name
        _clients.clear()
        _own_clients.clear()
    with _state_lock:
        _state.client = client_for(path)
        _state.scope = scope
        _state.owner_pid = None
        _register()
        _state.installed = True


def _eligible(t: torch.Tensor) -> bool:
    """True for the tensors the reducer sends through tensord."""
    if t.device.type != "cpu" or t.layout != torch.strided:
        return False
    if t.is_quantized or t.dtype not in _TD_DTYPES:
        return False
    if t.requires_grad and not t.is_leaf:
        return False  # torch's reducer refuses it with its own message
    if t.has_names():
        return False
    return True


def _storage_view(client, t: torch.Tensor):
    """Returns a tensord.Tensor of t's exact view if t's bytes already lie in
    a writable tensord storage of client's daemon, else None."""
    if t.numel() == 0 or t.is_conj() or t.is_neg():
        return None
    hit = _tensord.find(t.data_ptr())
    if hit is None:
        return None
    base, off = hit
    try:
        isz = t.element_size()
        if base.readonly or off % isz:
            return None
        if base.instance != client.instance:
            return None  # another daemon's storage: its id means nothing here
        try:
            return base.as_strided(
                tuple(t.shape), tuple(t.stride()), offset=off // isz, dtype=t.dtype
            )
        except (ValueError, IndexError):
            return None  # the view reaches outside the storage: copy it
    finally:
        base.release()


def _copy_into(client, t: torch.Tensor):
    """Copies t once into a new storage; returns its contiguous Tensor."""
    out = client.empty(tuple(t.shape), t.dtype, uninit=True)
    try:
        with torch.no_grad():
            out.torch().copy_(t)
    except BaseException:
        out.release()
        raise
    return out


def _publish_in_flight(client, view) -> str:
    """Publishes view under a new one-shot key in the scope; returns the key.

    If the scope has ended (its owner is gone), opens one owned by this
    process and publishes there.
    """
    for attempt in (0, 1):
        with _state_lock:
            token = _state.scope
            if token is None:
                token = _open_scope(client)
        key = "%s%016x/%d.%d" % (KEY_PREFIX, token, os.getpid(), next(_counter))
        try:
            client.publish(key, view, scope=token)
            return key
        except tensord.NotFound:
            if attempt:
                raise
            with _state_lock:
                if _state.scope == token:
                    _open_scope(client)
    raise AssertionError("unreachable")


def _reduce_tensor(t: torch.Tensor):
    """ForkingPickler reducer for torch.Tensor and torch.nn.Parameter."""
    client = _state.client
    if client is None or not _eligible(t):
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(t)
    try:
        view = _storage_view(client, t)
        if view is None:
            view = _copy_into(client, t)
        try:
            key = _publish_in_flight(client, view)
        finally:
            view.release()
    except Exception as e:
        return tensord._unsendable(e)  # a queue's feeder: to the consumer
    is_param = isinstance(t, torch.nn.Parameter)
    return (_rebuild_tensor, (client.path, key, bool(t.requires_grad), is_param))


def _reduce_td_tensor(t):
    """ForkingPickler reducer for tensord.Tensor: the same one-shot key in
    the scope as a torch tensor's. A writable Tensor of the installed
    client's daemon travels as its own storage and view (no copy); a
    read-only one (its copy-on-write pages are private) or another daemon's
    is copied once (Client.share: any dtype; a GPU's into CPU memory)."""
    client = _state.client
    if client is None:
        return tensord._reduce_tensor(t)
    try:
        if t.readonly or t.instance != client.instance:
            view = client.share(t)
        else:
            # A view of its own: publishing sets .key, which must stay the
            # sender's Tensor's.
            view = t.as_strided(t.shape, t.strides)
        try:
            key = _publish_in_flight(client, view)
        finally:
            view.release()
    except Exception as e:
        return tensord._unsendable(e)
    return (_rebuild_td_tensor, (client.path, key))


def _rebuild_tensor(path: str, key: str, requires_grad: bool, is_parameter: bool):
    """Unpickles a tensor the reducer sent: takes its one-shot key."""
    t = client_for(path).lookup(key, timeout=0, take=True)
    try:
        x = t.torch()
    finally:
        t.release()
    if is_parameter:
        return torch.nn.Parameter(x, requires_grad=requires_grad)
    if requires_grad:
        x.requires_grad_(True)
    return x


def _rebuild_td_tensor(path: str, key: str):
    """Unpickles a tensord.Tensor the reducer sent: takes its one-shot key
    (the Tensor's .key is that key, gone once taken)."""
    return client_for(path).lookup(key, timeout=0, take=True)


# --------------------------------------------------------------------------
# Collate into tensord storages.


def _empty_fn(client) -> Callable[[tuple, torch.dtype], torch.Tensor]:
    """empty(shape, dtype): a torch tensor over a new storage of client's
    (uninitialised: recycled by the daemon), holding it alone."""

    def empty(shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        out = client.empty(shape, dtype, uninit=True)
        try:
            return out.torch()
        finally:
            out.release()

    return empty


def _into_tensord(empty, t: torch.Tensor) -> torch.Tensor:
    """Returns t copied into empty(...) (t if tensord lacks its dtype)."""
    if not _eligible(t) or t.requires_grad:
        return t
    return empty(tuple(t.shape), t.dtype).copy_(t)


def _collate_fn_map(client, empty=None) -> dict:
    """torch's default_collate_fn_map, with tensors made in tensord: by
    empty(shape, dtype) (None: each in a storage of its own)."""
    if empty is None:
        empty = _empty_fn(client)

    def tensor_fn(batch, *, collate_fn_map=None):
        elem = batch[0]
        if (
            not _eligible(elem)
            or elem.requires_grad
            or any(x.requires_grad for x in batch)
        ):
            return _collate.collate_tensor_fn(batch, collate_fn_map=collate_fn_map)
        o = empty((len(batch),) + tuple(elem.shape), elem.dtype)
        return torch.stack(batch, 0, out=o)

    def numpy_scalar_fn(batch, *, collate_fn_map=None):
        return _into_tensord(empty, _collate.collate_numpy_scalar_fn(batch))

    def float_fn(batch, *, collate_fn_map=None):
        return _into_tensord(empty, _collate.collate_float_fn(batch))

    def int_fn(batch, *, collate_fn_map=None):
        return _into_tensord(empty, _collate.collate_int_fn(batch))

    m = dict(_collate.default_collate_fn_map)
    replace = {
        _collate.collate_tensor_fn: tensor_fn,
        _collate.collate_numpy_scalar_fn: numpy_scalar_fn,
        _collate.collate_float_fn: float_fn,
        _collate.collate_int_fn: int_fn,
    }
    for k, fn in m.items():
        if fn in replace:
            m[k] = replace[fn]
    return m


def default_collate(batch, client=None):
    """torch's default_collate, with every tensor it makes in tensord.

    Same rules and output types as ``torch.utils.data.default_collate``;
    stacked tensors are allocated with ``client.empty(..., uninit=True)``
    and filled by ``torch.stack(..., out=)``, numbers and numpy scalars are
    copied into a tensord storage. Tensors of dtypes tensord lacks, non-CPU
    tensors and tensors that require grad are collated by torch as usual.
    ``client`` None: the shared client of the default socket.
    """
    if client is None:
        client = client_for(None)
    return _collate.collate(batch, collate_fn_map=_collate_fn_map(client))


class _Collate:
    """default_collate bound to a socket path (picklable for spawn)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path

    def __call__(self, batch):
        return default_collate(batch, client_for(self.path))


class _WorkerInit:
    """Wraps worker_init_fn: installs the reducers with the iterator's scope,
    on a client named "<program> worker <id>" (program: the name of the main
    process's client)."""

    def __init__(
        self, fn: Optional[Callable[[int], None]], path: str, scope: int, program: str
    ):
        self.fn = fn
        self.path = path
        self.scope = scope
        self.program = program

    def __call__(self, worker_id: int) -> None:
        suffix = " worker %d" % worker_id
        # Names are cut at 63 bytes: the worker's number must survive.
        name = self.program[: _NAME_MAX - len(suffix)] + suffix
        _worker_setup(self.path, self.scope, name)
        if self.fn is not None:
            self.fn(worker_id)


class _LoaderOverride:
    """The loader as the iterator sees it, with some attributes replaced."""

    def __init__(self, loader, **overrides) -> None:
        self.__dict__.update(overrides)
        self.__dict__["_loader"] = loader

    def __getattr__(self, name: str):
        return getattr(self.__dict__["_loader"], name)


class _MultiProcessingIter(_dataloader._MultiProcessingDataLoaderIter):
    """torch's multi-process iterator, with a tensord scope for its batches."""

    def __init__(self, loader, client, **overrides) -> None:
        self._td_client = client
        self._td_scope = client.scope_open()
        init = _WorkerInit(
            loader.worker_init_fn, client.path, self._td_scope, client.name
        )
        try:
            super().__init__(
                _LoaderOverride(loader, worker_init_fn=init, **overrides)
            )
        except BaseException:
            self._td_close_scope()
            raise

    def _td_close_scope(self) -> None:
        scope, self._td_scope = self._td_scope, None
        if scope is None:
            return
        try:
            self._td_client.scope_close(scope)
        except Exception:
            pass  # ended already: the client closed, or interpreter shutdown

    def _next_data(self):
        try:
            return super()._next_data()
        except RuntimeError as e:
            # A worker died: torch's iterator cannot go on, so free what is
            # in flight now rather than when the iterator is collected.
            if "DataLoader worker" in str(e):
                self._shutdown_workers()
            raise

    def _shutdown_workers(self) -> None:
        try:
            super()._shutdown_workers()
        finally:
            if getattr(self, "_td_scope", None) is not None:
                self._td_close_scope()


# --------------------------------------------------------------------------
# DataLoader batches through a channel.
#
# The iterator's workers send their results (idx, batch) through a channel
# instead of torch's result queue (a pipe): a batch is collated straight into
# a slot, its tensors one after another, and the rest of it (the structure,
# the numbers, the strings, the index) pickled after them, as the header the
# entry's view points at. The main process receives the slot, unpickles the
# header and makes each tensor a view of the slot: no copy, no socket, no
# daemon call. Slots are made from the first batch's size, which no one
# knows before a worker has collated one: until then the workers send on a
# bootstrap channel without slots (each tensor in a storage of its own,
# travelling by a key of the scope, as the old path did; the header in a
# storage), and the main process makes the slots' channel when the first
# batch tells it the size. What does not fit in a slot (a bigger batch, no
# slot free because the training loop holds many batches) goes the same
# per-storage way.

_CHAN_SLACK = 64 << 10  # a slot holds the first batch, an eighth and this
_chan_counter = itertools.count()


class _Arena:
    """A bump allocator over one storage (a slot, or a storage of a slot's
    size): a batch's tensors one after another, its header after them."""

    def __init__(self, t) -> None:
        self.t = t  # the handle, a tensord.Tensor of the whole storage
        self.base = t.torch()  # uint8, the whole storage
        self.ptr = self.base.data_ptr()
        self.size = self.base.numel()
        self.used = 0

    def alloc(self, nbytes: int) -> Optional[int]:
        off = _align(self.used)
        if off + nbytes > self.size:
            return None
        self.used = off + nbytes
        return off

    def empty(self, shape: tuple, dtype: torch.dtype, nbytes: int):
        off = self.alloc(nbytes)
        if off is None:
            return None
        return self.base[off : off + nbytes].view(dtype).view(shape)

    def drop(self) -> None:
        """Gives the storage back (a slot to its channel) unsent."""
        self.base = None
        self.t.release()


class _Sink:
    """empty(shape, dtype) for a channel worker's collate: in the arena
    while it has room, else in a storage of its own; counts the bytes the
    batch needs, which sizes the slots."""

    def __init__(self, client, arena: Optional[_Arena]) -> None:
        self.arena = arena
        self.need = 0
        self._empty = _empty_fn(client)

    def __call__(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        n = _itemsize(dtype)
        for d in shape:
            n *= d
        self.need = _align(self.need) + n
        if self.arena is not None:
            x = self.arena.empty(shape, dtype, n)
            if x is not None:
                return x
        return self._empty(shape, dtype)


class _Packed:
    """What a channel worker's collate returns to torch's worker loop, which
    hands it to _ChanQueue.put: the batch and the arena it lies in."""

    __slots__ = ("batch", "arena", "need")

    def __init__(self, batch, arena: Optional[_Arena], need: int) -> None:
        self.batch = batch
        self.arena = arena
        self.need = need


class _ChanCollate:
    """default_collate in a worker of a channel iterator: into a slot of
    its channel (a storage of a slot's size when none is free; a storage per
    tensor before the slots exist). Picklable for spawn."""

    def __init__(self, path: Optional[str], bname: str, dname: str) -> None:
        self.path = path
        self.bname = bname
        self.dname = dname

    def __call__(self, batch):
        w = _chan_worker(self.path, self.bname, self.dname)
        arena = w.arena(batch_sized=True)
        sink = _Sink(client_for(self.path), arena)
        try:
            out = _collate.collate(
                batch, collate_fn_map=_collate_fn_map(None, empty=sink)
            )
        except BaseException:
            if arena is not None:
                arena.drop()
            raise
        return _Packed(out, arena, sink.need)


class _HeaderPickler(ForkingPickler):
    """Pickles a result for the channel: a tensor in the arena becomes its
    place there (a persistent id); a tensor outside tensord is copied into
    the arena if it fits; anything else goes as ForkingPickler sends it (a
    tensor of a tensord storage by a key of the scope, with no copy)."""

    def __init__(self, file, arena: Optional[_Arena]) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.arena = arena
        self.need = 0

    def persistent_id(self, obj):
        if (
            type(obj) is not torch.Tensor
            or not _eligible(obj)
            or obj.requires_grad
            or obj.numel() == 0
            or obj.is_conj()
            or obj.is_neg()
        ):
            return None
        a = self.arena
        isz = obj.element_size()
        if a is not None:
            off = obj.data_ptr() - a.ptr
            extent = sum((n - 1) * s for n, s in zip(obj.shape, obj.stride()))
            if 0 <= off and off + (extent + 1) * isz <= a.used and off % isz == 0:
                return (off // isz, _dtype_name(obj.dtype), tuple(obj.shape),
                        obj.stride())
        hit = _tensord.find(obj.data_ptr())
        if hit is not None:
            hit[0].release()
            return None  # in a storage already: by key, no copy
        nbytes = obj.numel() * isz
        self.need = _align(self.need) + nbytes
        x = a.empty(tuple(obj.shape), obj.dtype, nbytes) if a is not None else None
        if x is None:
            return None  # copied into a storage of its own by the reducer
        x.copy_(obj)
        return ((x.data_ptr() - a.ptr) // isz, _dtype_name(obj.dtype),
                tuple(obj.shape), x.stride())


class _HeaderUnpickler(pickle.Unpickler):
    """Unpickles a header the main process received: a persistent id is a
    tensor over the received storage t."""

    def __init__(self, file, t) -> None:
        super().__init__(file)
        self.t = t
        self.typed: Dict[torch.dtype, torch.Tensor] = {}

    def persistent_load(self, pid):
        offset, dtype_name, shape, stride = pid
        dt = _TORCH_DTYPES[dtype_name]
        base = self.typed.get(dt)
        if base is None:
            if not self.typed:
                t = self.t
                whole = t.as_strided((t.storage_nbytes,), (1,), offset=0)
                self.typed[torch.uint8] = whole.torch()
                whole.release()
            u8 = self.typed[torch.uint8]
            n = u8.numel() // _itemsize(dt) * _itemsize(dt)
            base = self.typed[dt] = u8[:n].view(dt)
        return torch.as_strided(base, shape, stride, offset)


def _decode(t):
    """(idx, data) and the batch's bytes from a received entry, whose view is
    the header; t is released (its tensors hold the storage)."""
    try:
        u = _HeaderUnpickler(io.BytesIO(memoryview(t)), t)
        obj = u.load()
        need = u.load()
    finally:
        t.release()
    return obj, need


class _ChanWorker:
    """A worker's side of an iterator's channels (one per process and
    iterator): the bootstrap channel until the slots' one exists. It is the
    result queue a spawned worker unpickles (put, cancel_join_thread,
    close)."""

    def __init__(self, path: Optional[str], bname: str, dname: str) -> None:
        self.path = path
        self.bname = bname
        self.dname = dname
        self.d = None  # the slots' channel, once found
        self.b = None  # the bootstrap channel, until then

    def _find_d(self):
        """The slots' channel, if the main process has made it (a round
        trip to ask, until it has)."""
        if self.d is None:
            try:
                self.d = client_for(self.path).channel(
                    self.dname, side="send", timeout=0
                )
            except tensord.NotFound:
                return None
            if self.b is not None:
                self.b.close()  # the main process learns we have moved
                self.b = None
        return self.d

    def arena(self, batch_sized: bool) -> Optional[_Arena]:
        """A free slot; else, for a batch, a storage of a slot's size; None
        while there are no slots."""
        d = self._find_d()
        if d is None:
            return None
        try:
            return _Arena(d.loan(timeout=0))
        except tensord.Timeout:
            pass  # the training loop holds them all
        except tensord.Error:
            return None  # the main process has gone
        if not batch_sized:
            return None
        t = client_for(self.path).empty((d.slot_bytes,), "uint8", uninit=True)
        return _Arena(t)

    def put(self, obj) -> None:
        idx, data = obj
        if isinstance(data, _Packed):
            arena, need, payload = data.arena, data.need, data.batch
            data.batch = data.arena = None
        else:
            arena, need, payload = self.arena(batch_sized=False), 0, data
        del obj, data
        try:
            buf = io.BytesIO()
            p = _HeaderPickler(buf, arena)
            try:
                p.dump((idx, payload))
            except Exception:
                # As torch's queue would not: the main process raises it.
                from torch._utils import ExceptionWrapper

                w = ExceptionWrapper(
                    where="in DataLoader worker process %d, sending a batch"
                    % os.getpid()
                )
                buf = io.BytesIO()
                p = _HeaderPickler(buf, None)
                p.dump((idx, w))
                need = 0
            tensors = _align(need) + _align(p.need)
            del p, payload  # the arena's torch views go with them
            # The bytes the batch needs, which size the slots (0: none).
            need = tensors + buf.tell() if tensors else 0
            pickle.dump(need, buf)
            msg = self._place(arena, buf.getbuffer())
        except BaseException:
            if arena is not None:
                arena.drop()
            raise
        self._send(msg)

    def _place(self, arena: Optional[_Arena], hdr) -> "tensord.Tensor":
        """The header written after the arena's tensors (or into a storage
        of its own without one): the entry to send, its view the header."""
        n = len(hdr)
        off = arena.alloc(n) if arena is not None else None
        if off is None and arena is not None and arena.used > 0:
            # The tensors filled the arena: they move, with the header, to
            # a storage of their own, where they keep their offsets (rare:
            # the slots have slack).
            used = arena.used
            t = client_for(self.path).empty((_align(used) + n,), "uint8",
                                            uninit=True)
            bigger = _Arena(t)
            bigger.base[:used].copy_(arena.base[:used])
            bigger.used = used
            arena.drop()
            arena = bigger
            off = arena.alloc(n)
        if off is None:
            if arena is not None:
                arena.drop()
            arena = _Arena(client_for(self.path).empty((n,), "uint8", uninit=True))
            off = arena.alloc(n)
        arena.base[off : off + n].copy_(torch.frombuffer(hdr, dtype=torch.uint8))
        msg = arena.t[off : off + n]
        arena.base = None
        arena.t.release()
        return msg

    def _send(self, msg) -> None:
        """Sends msg on the slots' channel, else the bootstrap one. The main
        process leaves the bootstrap channel only once the slots' exists
        and every worker that sent there has moved: a worker that finds it
        gone finds the slots'. Raises if neither takes msg; drops it if the
        main process has gone."""
        try:
            for _ in range(3):
                ch = self._find_d() or self._bootstrap()
                if ch is None:
                    continue
                try:
                    ch.send(msg)
                    return
                except tensord.BrokenPipe:
                    if ch is self.d:
                        return  # the main process has gone: no one wants it
                    self.b = None  # left: the slots' channel exists now
            raise tensord.NotFound(
                "DataLoader worker %d: neither channel %r nor %r takes its "
                "results" % (os.getpid(), self.dname, self.bname)
            )
        finally:
            msg.release()  # a no-op once sent (the send released it)

    def _bootstrap(self):
        """The bootstrap channel, made before the workers started; None
        once the main process has left it (or never made it: the loader's
        slots existed then)."""
        if self.b is None:
            try:
                self.b = client_for(self.path).channel(
                    self.bname, side="send", timeout=0
                )
            except tensord.NotFound:
                return None
        return self.b

    def cancel_join_thread(self) -> None:
        pass  # nothing to flush: put() has sent when it returns

    def close(self) -> None:
        for ch in (self.b, self.d):
            if ch is not None:
                ch.close()
        self.b = self.d = None


_chan_workers: Dict[tuple, _ChanWorker] = {}


def _chan_worker(path: Optional[str], bname: str, dname: str) -> _ChanWorker:
    """This process's side of the channel iterator whose bootstrap channel
    is bname (one: a slot must be sent on the end that loaned it)."""
    key = (os.getpid(), bname)
    w = _chan_workers.get(key)
    if w is None:
        w = _chan_workers[key] = _ChanWorker(path, bname, dname)
    return w


class _ChanSlots:
    """A DataLoader's slots' channel, kept from one iterator to the next:
    sized once (from the first batch) and mapped once by the main process,
    the workers of a later epoch send into it from their first batch. One
    iterator uses it at a time (busy); a copy of the loader starts afresh."""

    def __init__(self) -> None:
        self.name = "tensord.dl/%d.%d.%s/d" % (
            os.getpid(), next(_chan_counter), os.urandom(4).hex()
        )
        self.d = None  # the main process's end, once made
        self.failed = False  # it could not be made: batches go by storage
        self.busy = False

    def __reduce__(self):
        return (_ChanSlots, ())

    def close(self) -> None:
        if self.d is not None:
            self.d.close()
            self.d = None


class _ChanQueue:
    """torch's worker result queue, over channels. In the main process,
    get() receives from the iterator's bootstrap channel and, once it
    exists, from the slots' channel, which it makes when the first batch
    says its size (kept in slots, a _ChanSlots). In a worker (forked: the
    same object; spawned: unpickled) put() sends."""

    def __init__(self, client, bname: str, slots: _ChanSlots, nslots: int,
                 capacity: int) -> None:
        self.path = client.path
        self.bname = bname
        self.dname = slots.name
        self._pid = os.getpid()
        self._client = client
        self._slots = slots
        self._nslots = nslots
        self._capacity = capacity
        self._d = slots.d
        # Workers find the slots of an earlier iterator at once: no
        # bootstrap then.
        self._b = None
        if self._d is None:
            self._b = client.channel(bname, capacity=capacity, side="recv",
                                     create=True)
        self._pending = collections.deque()  # received, in order
        self._local = collections.deque()  # put() in this process
        self._closed = False

    def __reduce__(self):
        return (_chan_worker, (self.path, self.bname, self.dname))

    # -- a worker's --

    def put(self, obj) -> None:
        if os.getpid() != self._pid:
            _chan_worker(self.path, self.bname, self.dname).put(obj)
        else:
            self._local.append(obj)  # (None, None): the pin thread, to end

    def cancel_join_thread(self) -> None:
        pass

    def join_thread(self) -> None:
        pass

    def close(self) -> None:
        """In the main process, once the workers are gone: frees what is
        still in flight (the slots go back, the storages go), leaves the
        bootstrap channel and hands the slots' one back to its loader."""
        if os.getpid() != self._pid:
            _chan_worker(self.path, self.bname, self.dname).close()
            return
        if self._closed:
            return  # the slots may be another iterator's by now
        self._closed = True
        self._pending.clear()
        for ch in (self._b, self._d):
            if ch is None:
                continue
            try:
                while True:
                    ch.recv(timeout=0).release()
            except tensord.Error:
                pass  # empty, or every sender has left
        if self._b is not None:
            self._b.close()
        self._b = self._d = None
        self._slots.busy = False

    # -- the main process's --

    def _make_d(self, need: int) -> None:
        size = _align(need + need // 8 + _CHAN_SLACK)
        size = (size + _CHAN_SLACK - 1) // _CHAN_SLACK * _CHAN_SLACK
        try:
            self._d = self._slots.d = self._client.channel(
                self.dname,
                capacity=self._capacity,
                slots=self._nslots,
                slot_bytes=size,
                side="both",  # slots mapped read-write: batches are writable
                create=True,
            )
        except tensord.Error as e:
            self._slots.failed = True  # batches go on through storages
            logging.getLogger(__name__).warning(
                "tensord DataLoader: no slots (%s); batches go through "
                "storages of their own", e
            )

    def _take(self, ch, timeout: float):
        """One entry of ch, decoded, or None if none came in timeout."""
        try:
            t = ch.recv(timeout=timeout)
        except tensord.Timeout:
            return None
        obj, need = _decode(t)
        if need and self._d is None and not self._slots.failed:
            self._make_d(need)
        return obj

    def _drain_b(self) -> None:
        """Moves what waits on the bootstrap channel to pending. A worker
        sends there before it moves to the slots' channel: what it sent
        there comes first."""
        while self._b is not None:
            try:
                obj = self._take(self._b, 0)
            except tensord.BrokenPipe:
                if self._d is None:
                    return  # none has sent there yet, or the workers died
                self._b.close()  # every worker has moved
                self._b = None
                return
            if obj is None:
                return
            self._pending.append(obj)

    def get(self, timeout: Optional[float] = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._local:
                return self._local.popleft()
            self._drain_b()
            if self._pending:
                return self._pending.popleft()
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise queue.Empty
            # Watch both while workers may still send on the bootstrap
            # channel; see put((None, None)) within a slice.
            wait = 0.005 if self._d is not None and self._b is not None else 0.05
            wait = wait if left is None else min(wait, left)
            ch = self._d if self._d is not None else self._b
            if ch is None:
                raise tensord.Closed("the DataLoader's channels are closed")
            try:
                obj = self._take(ch, wait)
            except tensord.BrokenPipe:
                time.sleep(wait)  # the bootstrap's senders all left
                continue
            if obj is None:
                continue
            if ch is self._d and self._b is not None:
                self._drain_b()
                self._pending.append(obj)
                return self._pending.popleft()
            return obj


class _QueueContext:
    """A multiprocessing context whose first Queue() is the channel queue:
    the one torch's iterator makes for its workers' results."""

    def __init__(self, ctx, q: _ChanQueue) -> None:
        self._ctx = ctx
        self._q = q

    def Queue(self, *args, **kwargs):
        q, self._q = self._q, None
        return q if q is not None else self._ctx.Queue(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)


class _ChanIter(_MultiProcessingIter):
    """The multi-process iterator whose workers send through channels: a
    bootstrap channel of its own, and its loader's slots' channel (a
    private one while another iterator of the loader uses that)."""

    def __init__(self, loader, client) -> None:
        workers = loader.num_workers
        prefetch = loader.prefetch_factor or 2
        # Each outstanding task holds at most one slot (on loan, in the
        # ring, or received and not yet yielded); two more for the batches
        # a training loop holds (the one it uses, the one it just got).
        nslots = min(prefetch * workers + 2, 1024)
        capacity = 64
        while capacity < 2 * (prefetch * workers + workers) + 8:
            capacity *= 2
        slots = loader._td_slots
        if slots.d is not None and slots.d.client.closed:
            slots.close()  # made through a client closed since: anew
            slots.failed = False
        if slots.busy:
            slots = self._td_own_slots = _ChanSlots()
        slots.busy = True
        bname = "tensord.dl/%d.%d.%s/b" % (
            os.getpid(), next(_chan_counter), os.urandom(4).hex()
        )
        try:
            q = _ChanQueue(client, bname, slots, nslots, capacity)
        except BaseException:
            slots.busy = False
            raise
        ctx = loader.multiprocessing_context or torch.multiprocessing
        overrides = {"multiprocessing_context": _QueueContext(ctx, q)}
        if isinstance(loader.collate_fn, _Collate):
            # The queue's path: its worker side and the collate's must be
            # one (a slot is sent on the end that loaned it).
            overrides["collate_fn"] = _ChanCollate(client.path, bname, slots.name)
        self._td_queue = q
        try:
            super().__init__(loader, client, **overrides)
        except BaseException:
            q.close()
            raise
        if self._worker_result_queue is not q:
            self._shutdown_workers()
            raise RuntimeError(
                "tensord.torch.DataLoader: this torch made its result queue "
                "otherwise; use DataLoader(..., channel=False)"
            )

    def _shutdown_workers(self) -> None:
        try:
            super()._shutdown_workers()
        finally:
            q = getattr(self, "_td_queue", None)
            if q is not None:
                q.close()
            own = getattr(self, "_td_own_slots", None)
            if own is not None:
                own.close()


class DataLoader(torch.utils.data.DataLoader):
    """torch.utils.data.DataLoader whose batches live in tensord storages.

    Takes torch's arguments (positional and keyword) plus ``client``: the
    tensord Client (None: the shared client of the default socket path),
    and ``channel``: with workers, their batches come through a channel,
    collated straight into its slots (True, the default), or as keys
    through torch's result queue (False, the path before channels).
    Samplers, seeds, ordering, workers and errors are torch's; see the
    module's documentation for what changes.
    """

    def __init__(self, dataset, *args, client=None, channel=True, **kwargs) -> None:
        super().__init__(dataset, *args, **kwargs)
        self._td_client = client
        self._td_channel = bool(channel)
        self._td_slots = _ChanSlots()
        if self.collate_fn is _collate.default_collate:
            self.collate_fn = _Collate(client.path if client is not None else None)

    def _tensord_client(self):
        c = self._td_client
        if c is None or c.closed:
            c = client_for(None)
        return c

    def _get_iterator(self):
        if self.num_workers == 0:
            return super()._get_iterator()
        self.check_worker_number_rationality()
        if self._td_channel:
            return _ChanIter(self, self._tensord_client())
        return _MultiProcessingIter(self, self._tensord_client())


# --------------------------------------------------------------------------
# State dicts.

_MAGIC = b"TDSTATE1"
_MODEL_MAGIC = b"TDMODEL1"  # a model's manifest (docs/models.md)
_ALIGN = 64
_TORCH_DTYPES = {
    str(d)[len("torch.") :]: d
    for d in vars(torch).values()
    if isinstance(d, torch.dtype)
}


_ITEMSIZES: Dict[torch.dtype, int] = {}


def _itemsize(d: torch.dtype) -> int:
    n = _ITEMSIZES.get(d)
    if n is None:
        n = _ITEMSIZES[d] = torch.empty((), dtype=d).element_size()
    return n


def _dtype_name(d: torch.dtype) -> str:
    return str(d)[len("torch.") :]


def _untyped_storage(t: torch.Tensor):
    if hasattr(t, "untyped_storage"):
        return t.untyped_storage()
    return t.storage().untyped()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def _region_key(prefix: str, version: int, i: int) -> str:
    """The key of region i of the version of prefix whose packed storage is
    ``version``: ``PREFIX@<packed storage id>/r<i>``."""
    return "%s@%d/r%d" % (prefix, version, i)


class _Region:
    """One region of a state dict being packed: the bytes of one storage
    (a torch storage, or a tensord Tensor's), and the device they live on
    ("cpu" or "cuda:K")."""

    __slots__ = ("device", "nbytes", "torch_src", "td_src")

    def __init__(self, device: str, nbytes: int, torch_src=None, td_src=None):
        self.device = device
        self.nbytes = nbytes
        self.torch_src = torch_src  # a torch untyped storage
        self.td_src = td_src  # a tensord Tensor: the whole storage, uint8

    def torch_bytes(self) -> torch.Tensor:
        """The region as a uint8 torch tensor on its device."""
        if self.td_src is not None:
            return self.td_src.torch()
        return torch.empty(0, dtype=torch.uint8, device=self.torch_src.device).set_(
            self.torch_src
        )


def _region_of_entry(name: str, t, region_of: dict, regions: list) -> dict:
    """The manifest entry of tensor t (torch, or a tensord Tensor), adding
    the storage behind it to regions (once per storage)."""
    if isinstance(t, _tensord.Tensor):
        if t.released:
            raise ValueError(
                "state dict entry %r: the tensord Tensor is released" % name
            )
        sk = ("td", t.instance, t.storage_id)
        idx = region_of.get(sk)
        if idx is None:
            idx = region_of[sk] = len(regions)
            whole = t.as_strided((t.storage_nbytes,), (1,), 0, dtype="uint8")
            regions.append(_Region(t.device, t.storage_nbytes, td_src=whole))
        return {
            "dtype": t.dtype,
            "shape": list(t.shape),
            "stride": list(t.strides),
            "storage_offset": t.offset,
            "region": idx,
        }
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            "state dict entry %r is a %s, not a torch.Tensor"
            % (name, type(t).__name__)
        )
    if t.is_quantized or t.layout != torch.strided or t.device.type == "meta":
        raise TypeError(
            "state dict entry %r: a %s %s tensor on %s cannot be packed"
            % (name, t.layout, t.dtype, t.device)
        )
    st = _untyped_storage(t)
    sk = (t.device, st.data_ptr(), st.nbytes())
    idx = region_of.get(sk)
    if idx is None:
        idx = region_of[sk] = len(regions)
        if t.device.type == "cuda":
            dev = "cuda:%d" % (t.device.index or 0)
        else:
            dev = "cpu"  # any other device is copied to the packed storage
        regions.append(_Region(dev, st.nbytes(), torch_src=st))
    return {
        "dtype": _dtype_name(t.dtype),
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "storage_offset": t.storage_offset(),
        "region": idx,
    }


def _fill_cuda_region(client, r: _Region):
    """A new daemon-owned storage on r's GPU holding r's bytes, copied
    device to device (by torch for a torch storage, by td_copy for a tensord
    Tensor); the caller owns it. Raises tensord.Error from the daemon or the
    driver."""
    dst = client.empty((max(r.nbytes, 1),), "uint8", uninit=True, device=r.device)
    try:
        if r.nbytes:
            if r.td_src is not None:
                dst[: r.nbytes].copy_(r.td_src)
            else:
                with torch.no_grad():
                    d = dst.torch()
                    d[: r.nbytes].copy_(r.torch_bytes())
                    torch.cuda.synchronize(d.device)  # before any reader
                    del d
        return dst
    except BaseException:
        dst.release()
        raise


def _sweep_regions(client, prefix: str, below: int) -> int:
    """Unpublishes every region key of prefix (``PREFIX@<id>/r<i>``) whose
    version id is below ``below``: old versions' keys (their storages live
    on while readers hold them) and the orphans of a publisher that died
    before its switch. Returns how many keys went."""
    pat = re.compile(re.escape(prefix) + r"@(\d+)/r\d+\Z")
    gone = 0
    for s in client.ls():
        for k in s.get("keys", ()):
            m = pat.match(k)
            if m and int(m.group(1)) < below:
                try:
                    client.unpublish(k)
                    gone += 1
                except tensord.NotFound:
                    pass
    return gone


def _plan(state_dict, what: str = "publish_state_dict") -> "tuple[dict, list]":
    """The manifest entries of a state dict's tensors, by name, and the
    regions (distinct storages) they lie in. Raises TypeError for anything
    but a state dict or an nn.Module, or a value that cannot be packed."""
    if isinstance(state_dict, torch.nn.Module):
        state_dict = state_dict.state_dict()
    elif not isinstance(state_dict, collections.abc.Mapping):
        raise TypeError(
            "%s wants a state dict (a mapping of names to tensors, as "
            "module.state_dict() returns) or an nn.Module, not a %s"
            % (what, type(state_dict).__name__)
        )
    regions: list = []  # _Region
    region_of: dict = {}
    tensors: dict = {}
    for name, t in state_dict.items():
        tensors[str(name)] = _region_of_entry(name, t, region_of, regions)
    return tensors, regions


class _Packing:
    """Where each region of a state dict lies in its packed storage: a
    16-byte header (_MAGIC, the manifest's length), the manifest (JSON),
    then the regions on the CPU, each at an offset aligned to _ALIGN. A
    region on a GPU (device "cuda...") lies in a storage of its own, which
    the manifest names by key and storage id.

    The layout depends only on the tensors and the regions' devices and
    sizes, never on storage ids: it is laid out with placeholder ids of the
    most digits an id has, so two daemons pack the same state dict at the
    same offsets (tensord.distributed broadcasts the bytes after the
    header as they are) and the real manifest always fits."""

    def __init__(self, prefix: str, tensors: dict, specs: list) -> None:
        self.prefix = prefix
        self.tensors = tensors
        self.specs = [(str(d), int(n)) for d, n in specs]  # (device, nbytes)
        self.on_gpu = [i for i, (d, _) in enumerate(self.specs) if d != "cpu"]
        need = 16
        while True:
            self.start = off = _align(need)
            self.offsets: list = []
            for d, n in self.specs:
                if d != "cpu":
                    self.offsets.append(None)
                    continue
                self.offsets.append(off)
                off = _align(off + n)
            self.total = off
            text = self._manifest(_NO_ID, dict.fromkeys(self.on_gpu, _NO_ID))
            if 16 + len(text) <= self.start:
                return
            need = 16 + len(text)

    def _manifest(self, version: int, gpu_ids: dict) -> bytes:
        placed = []
        for i, (d, n) in enumerate(self.specs):
            if d != "cpu":
                placed.append({
                    "device": "cuda",
                    "key": _region_key(self.prefix, version, i),
                    "storage_id": gpu_ids[i],
                    "nbytes": n,
                })
            else:
                placed.append({"offset": self.offsets[i], "nbytes": n})
        manifest = {"tensors": self.tensors, "regions": placed}
        return json.dumps(manifest, separators=(",", ":")).encode()

    def header(self, version: int, gpu_ids: dict) -> bytes:
        """The bytes before the first region: the header, the manifest of
        version (the packed storage's id; gpu_ids: region index -> storage
        id) and zeros up to self.start."""
        text = self._manifest(version, gpu_ids)
        head = _MAGIC + len(text).to_bytes(8, "little") + text
        assert len(head) <= self.start  # real ids are no longer than _NO_ID
        return head + bytes(self.start - len(head))

    def fill(self, buf: torch.Tensor, regions: list) -> None:
        """Copies the CPU regions (_Region) into buf, the packed storage
        as uint8, zeroing the padding after each and the tail: every byte
        from self.start on is set."""
        with torch.no_grad():
            for i, r in enumerate(regions):
                o = self.offsets[i]
                if o is None:
                    continue
                if r.nbytes:
                    buf[o : o + r.nbytes].copy_(r.torch_bytes())
                buf[o + r.nbytes : _align(o + r.nbytes)].zero_()
            last = self.start
            for i, o in enumerate(self.offsets):
                if o is not None:
                    last = _align(o + self.specs[i][1])
            buf[last : self.total].zero_()


def _switch(client, prefix: str, packed, gpu: dict) -> None:
    """Publishes version packed of prefix (its header written): the GPU
    regions' keys first, then the packed storage under prefix (the switch),
    then sweeps older versions' region keys. On failure before the switch,
    the region keys published are unpublished again."""
    version = packed.storage_id
    published: list = []
    try:
        for i in sorted(gpu):
            client.publish(_region_key(prefix, version, i), gpu[i])
            published.append(_region_key(prefix, version, i))
        client.publish(prefix, packed)  # the switch
        published.clear()
    finally:
        for k in published:  # a failure before the switch: nothing stays
            try:
                client.unpublish(k)
            except tensord.Error:
                pass
    try:
        _sweep_regions(client, prefix, version)
    except tensord.Error as e:  # the switch is made; the next sweep retries
        logging.getLogger("tensord").warning(
            "publish_state_dict %r: sweeping old regions: %s", prefix, e
        )


def _check_prefix(prefix: str, nregions: int, what: str) -> None:
    longest = _region_key(prefix, _NO_ID, nregions)
    if len(longest.encode()) > tensord.KEY_MAX:
        raise ValueError(
            "%s: prefix %r of %d bytes leaves no room for its GPU regions' "
            "keys (%s; a key has at most %d bytes)"
            % (what, prefix, len(prefix.encode()), _region_key(prefix, 0, 0),
               tensord.KEY_MAX)
        )


def publish_state_dict(
    client, prefix: str, state_dict: "Mapping[str, torch.Tensor] | torch.nn.Module"
) -> int:
    """Publishes state_dict under the key ``prefix`` as one packed storage.

    ``state_dict``: a mapping of names to tensors (``module.state_dict()``),
    or an ``nn.Module``, whose ``state_dict()`` is taken. Every distinct
    torch storage behind the tensors is copied once (whole, so strides and
    storage offsets stay exact and tied weights stay tied). A storage on the
    CPU (or any device but a GPU) is copied into the packed storage; one on
    a GPU (cuda:K) stays there: it is copied device to device into a
    daemon-owned storage of its own on that GPU, published under
    ``PREFIX@<packed storage id>/r<i>`` before the packed storage (which
    names it) is published under PREFIX, so that the switch stays one
    publish (docs/python.md, "State dicts on a GPU"). A tensord Tensor
    (Client.empty(..., device="cuda:K")) may stand in for a torch tensor.
    Publishing again under the same prefix replaces the key atomically, then
    unpublishes the region keys of older versions (a version lives on while
    readers hold its storages) and any left by a publisher that died before
    its switch. Returns the new packed storage's id. Raises TypeError for
    anything else, for a value that is not a tensor or is quantized,
    ValueError for a prefix too long for its region keys, tensord.Error from
    the daemon (OutOfMemory, QuotaExceeded...); nothing new stays published
    on failure.
    """
    tensors, regions = _plan(state_dict)
    packing = _Packing(prefix, tensors, [(r.device, r.nbytes) for r in regions])
    if packing.on_gpu:
        _check_prefix(prefix, len(regions), "publish_state_dict")
    gpu: dict = {}  # region index -> its daemon-owned GPU storage
    packed = None
    try:
        packed = client.empty((packing.total,), "uint8", uninit=True)
        for i in packing.on_gpu:
            gpu[i] = _fill_cuda_region(client, regions[i])
        buf = packed.torch()
        head = packing.header(
            packed.storage_id, {i: g.storage_id for i, g in gpu.items()}
        )
        buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        packing.fill(buf, regions)
        del buf
        _switch(client, prefix, packed, gpu)
        return packed.storage_id
    finally:
        for st in gpu.values():
            st.release()
        if packed is not None:
            packed.release()


def _read_manifest(t) -> dict:
    mv = memoryview(t)
    try:
        if len(mv) < 16 or bytes(mv[:8]) != _MAGIC:
            raise ValueError(
                "key %r does not hold a state dict (no %r header)" % (t.key, _MAGIC)
            )
        n = int.from_bytes(bytes(mv[8:16]), "little")
        if 16 + n > len(mv):
            raise ValueError(
                "key %r: manifest of %d bytes overruns the %d-byte storage"
                % (t.key, n, len(mv))
            )
        return json.loads(bytes(mv[16 : 16 + n]))
    finally:
        mv.release()


class _VersionChanged(RuntimeError):
    """A GPU region a manifest names is gone or is another storage: the
    state dict was replaced between the lookups; start again (after
    _RETRIES tries in a row, the caller gets this error)."""


_RETRIES = 16
_NO_ID = 2**64 - 1  # a placeholder id of the most digits an id has


def _gpu_regions(client, manifest: dict, prefix: str) -> dict:
    """Looks up (read-only) every GPU region the manifest names, all in one
    round trip (lookup_many); returns {region index: tensord Tensor, uint8
    over the whole storage}. Raises _VersionChanged where a key is gone or
    names another storage than the manifest's (the version was replaced
    meanwhile); the Tensors looked up are released then."""
    regions = manifest["regions"]
    idx = [i for i, r in enumerate(regions) if r.get("device") == "cuda"]
    if not idx:
        return {}
    if client is None:
        raise ValueError(
            "state dict %r has GPU regions: reading it needs the "
            "client it came from" % prefix
        )
    got = client.lookup_many(
        [regions[i]["key"] for i in idx],
        timeout=0,
        readonly=True,
        return_exceptions=True,
    )
    out = {i: t for i, t in zip(idx, got) if not isinstance(t, BaseException)}
    try:
        for i, t in zip(idx, got):
            r = regions[i]
            why = (
                "state dict %r: region %d (key %r, storage %d) is no longer "
                "there: a newer version replaced it %d times in a row while "
                "loading" % (prefix, i, r["key"], r["storage_id"], _RETRIES)
            )
            if isinstance(t, tensord.NotFound):
                raise _VersionChanged(why)
            if isinstance(t, BaseException):
                raise t
            if t.storage_id != r["storage_id"]:
                raise _VersionChanged(why)
        return out
    except BaseException:
        for t in out.values():
            t.release()
        raise


def _cuda_torch(t, prefix: str, key: str) -> torch.Tensor:
    """t (a GPU storage's Tensor) as a torch CUDA tensor of the same
    memory. Raises RuntimeError naming the key when this torch has no
    CUDA."""
    if not torch.cuda.is_available():
        raise RuntimeError(
            "state dict %r: region %r lies on %s, and this torch (%s) has no "
            "CUDA: load it where torch.cuda.is_available(), or publish it "
            "from CPU tensors" % (prefix, key, t.device, torch.__version__)
        )
    return t.torch()


def load_state_dict(
    client, prefix: str, readonly: bool = True, timeout: Optional[float] = 0
) -> "Weights":
    """Maps the state dict published under ``prefix``; returns its tensors.

    One lookup (``timeout`` as for Client.lookup: 0 does not wait, None waits
    forever), and one more per region on a GPU. readonly=True maps
    copy-on-write: a write through a returned CPU tensor changes only this
    process's private copy of the page and never crashes; readonly=False
    maps the shared pages (writes reach every reader). Each tensor has its
    original dtype, shape, strides and storage offset; entries that shared a
    torch storage share one again. Tensors published from a GPU come back
    as CUDA tensors over the daemon-owned storage on that GPU, the same
    memory in every process (always read-only). The tensors keep the
    version they were loaded from alive. The dict is a ``Weights`` (a dict
    that also says which version it holds). Raises tensord.NotFound,
    ValueError if the key holds no state dict, RuntimeError for GPU regions
    when this torch has no CUDA.
    """
    # Lazily mapped: attaching costs the same for 5 MB or 5 GB; each page is
    # mapped when a forward pass first reads it.
    return _lookup_state_dict(client, prefix, timeout, readonly, models=False)


def _lookup_state_dict(
    client, key: str, timeout: Optional[float], readonly: bool, models: bool
) -> Optional["Weights"]:
    """The state dict published under key (lazily mapped), looked up again
    while its GPU regions turn out to be a newer version's (_RETRIES times
    at most). With models, None where the key holds a model's manifest
    instead."""
    for attempt in range(_RETRIES):
        t = client.lookup(key, timeout=timeout, readonly=readonly, lazy=True)
        try:
            if models:
                mv = memoryview(t)
                try:
                    if bytes(mv[: len(_MODEL_MAGIC)]) == _MODEL_MAGIC:
                        return None
                finally:
                    mv.release()
            return _state_dict_of(t, key, client)
        except _VersionChanged:
            if attempt == _RETRIES - 1:
                raise
        finally:
            t.release()
    raise AssertionError("unreachable")


def _state_dict_of(t, prefix: str, client=None) -> "Weights":
    """The Weights of the packed state dict in t (which the caller keeps
    and releases: the tensors hold references of their own). GPU regions
    are looked up through client; raises _VersionChanged when they are no
    longer the version t names (the caller starts again)."""
    manifest = _read_manifest(t)
    gpu = _gpu_regions(client, manifest, prefix)
    try:
        regions = []
        for i, r in enumerate(manifest["regions"]):
            if i in gpu:
                regions.append(_cuda_torch(gpu[i], prefix, r["key"])[: r["nbytes"]])
                continue
            o, n = r["offset"], r["nbytes"]
            regions.append(t[o : o + n].torch())
    finally:
        for g in gpu.values():
            g.release()  # each torch tensor holds a reference of its own
    typed: dict = {}
    ids = (t.storage_id,) + tuple(
        manifest["regions"][i]["storage_id"] for i in sorted(gpu)
    )
    out = Weights(prefix, t.storage_id, ids)
    for name, e in manifest["tensors"].items():
        ri = e["region"]
        dt = _TORCH_DTYPES[e["dtype"]]
        base = typed.get((ri, dt))
        if base is None:
            r = regions[ri]
            if dt != torch.uint8:
                isz = _itemsize(dt)
                r = r[: r.numel() // isz * isz].view(dt)
            base = typed[(ri, dt)] = r
        out[name] = torch.as_strided(
            base, e["shape"], e["stride"], e["storage_offset"]
        )
    return out


class Weights(dict):
    """The tensors of one version of published weights: a dict of names to
    torch tensors (``load_state_dict`` and ``load_safetensors`` return one),
    which also says what it holds.

    ``name``: the key (a state dict) or model name it came from.
    ``version``: which version of it: a model's version number (1, 2, ...
    as loads replace it); for a state dict, the id of its packed storage
    (ids grow with every storage a daemon makes, so a later publish has a
    larger one). ``storage_ids``: the storages its tensors lie in.
    ``metadata``: a model's checkpoint ``__metadata__`` (an index's
    ``metadata``); {} for a state dict.
    """

    def __init__(
        self,
        name: str,
        version: int,
        storage_ids: tuple,
        metadata: Optional[dict] = None,
    ) -> None:
        super().__init__()
        self.name = name
        self.version = version
        self.storage_ids = tuple(storage_ids)
        self.metadata = dict(metadata or {})

    def __repr__(self) -> str:
        return "<tensord.torch.Weights %r version %d: %d tensors>" % (
            self.name,
            self.version,
            len(self),
        )


def version_of(weights) -> Optional[int]:
    """The version a ``Weights`` dict holds (its ``.version``); None for a
    mapping that did not come from tensord."""
    return getattr(weights, "version", None)


def _open_weights(client, name: str, timeout: Optional[float] = 0) -> Weights:
    """The weights published under name, read-only (copy-on-write) and
    lazily mapped: a state dict (one lookup of the key, whose bytes say what
    it holds) or a model (its manifest's key: every tensor of one
    version)."""
    w = _lookup_state_dict(client, name, timeout, True, models=True)
    return w if w is not None else _open_model(client, name, timeout=timeout)


def _open_model(
    client, name: str, timeout: Optional[float] = 0, readonly: bool = True
) -> Weights:
    """Attaches one version of model name (Client.open_model) as Weights of
    torch tensors over its shard storages."""
    version, manifest, items = client.open_model(
        name, timeout=timeout, readonly=readonly, lazy=True
    )
    try:
        meta = json.loads(manifest).get("metadata") or {}
        ids = []
        for _, t in items:
            if t.storage_id not in ids:
                ids.append(t.storage_id)
        out = Weights(name, version, tuple(ids), meta)
        for tname, t in items:
            try:
                out[tname] = t.torch()
            except TypeError as e:  # a dtype torch 1.13 lacks
                raise TypeError(
                    "model %r: tensor %r: %s" % (name, tname, e)
                ) from None
        return out
    finally:
        for _, t in items:
            t.release()  # each torch tensor holds a reference of its own


_ST_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16",
    torch.bfloat16: "BF16", torch.int64: "I64", torch.int32: "I32",
    torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL",
}


def save_safetensors(
    tensors: Mapping[str, torch.Tensor],
    path: "str | os.PathLike",
    metadata: Optional[Mapping[str, str]] = None,
) -> None:
    """Writes tensors as one ``.safetensors`` file at path (what
    ``load_safetensors`` and ``tensorctl load`` read; Debian has no
    ``safetensors`` package).

    Each name gets its own copy of its tensor's bytes (tied tensors are
    written once per name, as the format has no ties); the header lists
    them in the mapping's order, the bytes lie widest dtype first (so that
    each is aligned to its element size, as the safetensors library does).
    ``metadata``: the header's ``__metadata__`` (str to str). The file is
    written to a temporary name in its directory, synced and
    renamed: path is whole or as it was. Raises TypeError for a tensor of
    a dtype safetensors lacks, ValueError for a bad name or metadata.
    """
    path = os.fspath(path)
    header: dict = {}
    if metadata is not None:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(
                    "save_safetensors: metadata %r: %r: keys and values must "
                    "be str" % (k, v)
                )
        header["__metadata__"] = dict(metadata)
    entries = []
    for name, t in tensors.items():
        if not isinstance(name, str) or not name or name == "__metadata__":
            raise ValueError("save_safetensors: tensor name %r" % (name,))
        if not isinstance(t, torch.Tensor):
            raise TypeError(
                "save_safetensors: %r is a %s, not a torch.Tensor"
                % (name, type(t).__name__)
            )
        st = _ST_DTYPES.get(t.dtype)
        if st is None:
            raise TypeError(
                "save_safetensors: %r: dtype %s has no safetensors name"
                % (name, t.dtype)
            )
        header[name] = {"dtype": st, "shape": list(t.shape)}
        entries.append((name, t))
    # The bytes widest dtype first, as the safetensors library lays them
    # out: each tensor then begins at a multiple of its element size (the
    # header is padded to 8), which views need. The header keeps the
    # mapping's order.
    entries.sort(key=lambda e: -_itemsize(e[1].dtype))
    flat = []
    off = 0
    for name, t in entries:
        b = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        header[name]["data_offsets"] = [off, off + b.numel()]
        flat.append(b)
        off += b.numel()
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=d)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(len(text).to_bytes(8, "little"))
            f.write(text)
            for b in flat:
                f.write(b.numpy())
            f.flush()
            os.fsync(f.fileno())
        mask = os.umask(0o022)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)  # as open() would have made it
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def load_safetensors(
    path: "str | os.PathLike",
    name: Optional[str] = None,
    device: "str | torch.device" = "cpu",
    client=None,
    force: bool = False,
) -> Weights:
    """The tensors of a safetensors checkpoint, loaded into tensord once per
    machine; a dict of names to zero-copy torch tensors.

    ``path``: one ``.safetensors`` file, a sharded checkpoint's
    ``*.index.json``, or a directory holding either. ``name``: the model's
    name in tensord (None: the file's stem, or the directory's name, as
    ``tensorctl load`` derives it). If the model is already loaded from
    this source (the same path, and each file's size and mtime), this
    attaches it; else it loads it (``Client.load_model``, as ``tensorctl
    load``: a new version, switched to atomically) and attaches that. When
    several processes call it at once, one loads and the others wait for
    it and attach: the machine holds one copy. ``force`` loads again even
    if the source is unchanged.

    The tensors are read-only in the sense of ``load_state_dict``: mapped
    copy-on-write (a write changes only this process's private copy of a
    page) and lazily (each page is mapped when first read). They keep
    their version alive; a later load does not change them. The result is
    a ``Weights``: ``.name``, ``.version``, ``.metadata`` (the checkpoint's
    ``__metadata__``). ``attach(model, weights)`` binds a module to them.

    ``device``: "cpu", or "cuda"/"cuda:K": the weights go into daemon-owned
    CUDA storages on that GPU (read through a pinned staging buffer of at
    most 256 MiB), and every process attaches the same device memory: the
    tensors are CUDA tensors, mapped read-only (device memory has no
    copy-on-write: an in-place write faults, and CUDA's error is sticky for
    the process's context; clone a tensor to change it). A model loaded on
    another device than asked is loaded again there (a new version). ``client``: the Client to use (None: the shared
    client of the default socket). Raises tensord.Error with the file, the
    tensor and the field for a checkpoint that breaks a rule of the format
    (nothing is left in tensord then), FileNotFoundError-like
    tensord.NotFound for a missing path.
    """
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(
            "load_safetensors: device %r: 'cpu', 'cuda' or 'cuda:K'"
            % str(device)
        )
    where = "cpu" if dev.type == "cpu" else "cuda:%d" % (dev.index or 0)
    client = client or client_for(None)
    r = client.load_model(
        os.fspath(path), name, force=force, wait=None, device=where
    )
    return _open_model(client, r["name"], timeout=0)


# --------------------------------------------------------------------------
# Building a module without weights of its own.

# torch's factory functions that take device= (what torch >= 2.0's
# `with torch.device(...)` redirects; *_like functions follow their input).
_FACTORIES = frozenset(
    f
    for f in (
        getattr(torch, n, None)
        for n in (
            "empty", "empty_strided", "zeros", "ones", "full", "eye",
            "arange", "range", "linspace", "logspace", "rand", "randn",
            "randint", "randperm", "normal", "tensor", "as_tensor",
            "scalar_tensor", "asarray", "tril_indices", "triu_indices",
            "bartlett_window", "blackman_window", "hamming_window",
            "hann_window", "kaiser_window", "sparse_coo_tensor",
        )
    )
    if f is not None
)


class _DefaultDevice(torch.overrides.TorchFunctionMode):
    def __init__(self, device) -> None:
        super().__init__()
        self.device = torch.device(device)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs = dict(kwargs, device=self.device)
        return func(*args, **kwargs)


def meta_device():
    """A context manager: the tensors torch's factory functions make inside
    it without a ``device=`` (the parameters and buffers of modules built
    there) are on the ``meta`` device: shapes and dtypes, no memory, no
    initialisation. What ``with torch.device("meta"):`` does in torch 2;
    torch 1.13 lacks it. Build the module inside, then ``attach`` weights::

        with tensord.torch.meta_device():
            model = Net()
        tensord.torch.attach(model, weights)

    A buffer that the constructor computes and that no state dict holds (a
    non-persistent one) is on meta too: attach refuses it unless the weights
    hold it (see ``attach``)."""
    return _DefaultDevice("meta")


# --------------------------------------------------------------------------
# Binding a module to shared tensors.


class Mismatch(
    collections.namedtuple(
        "Mismatch", ["name", "expected_shape", "expected_dtype", "shape", "dtype"]
    )
):
    """A tensor of the weights whose shape or dtype the module's differs
    from: ``expected_*`` the module's, ``shape``/``dtype`` the weights'."""

    def __str__(self) -> str:
        return "%r: the module has %s %s, the weights %s %s" % (
            self.name,
            tuple(self.expected_shape),
            _dtype_name(self.expected_dtype),
            tuple(self.shape),
            _dtype_name(self.dtype),
        )


class IncompatibleKeys(
    collections.namedtuple(
        "IncompatibleKeys", ["missing_keys", "unexpected_keys", "mismatched_keys"]
    )
):
    """What ``attach`` could not bind, as torch's ``load_state_dict``
    reports it, and the shape/dtype mismatches (a list of ``Mismatch``)."""

    def __repr__(self) -> str:
        if not any(self):
            return "<All keys matched successfully>"
        return super().__repr__()

    __str__ = __repr__


class AttachError(RuntimeError):
    """attach() refused: the weights do not fit the module. ``.report`` is
    the IncompatibleKeys (missing, unexpected, mismatched) behind it."""

    def __init__(self, message: str, report: Optional[IncompatibleKeys] = None):
        super().__init__(message)
        self.report = report


class _Slot:
    """One parameter or buffer object of a module, and every place (module,
    attribute, dotted name) that holds it: several for tied weights and
    shared submodules."""

    __slots__ = ("obj", "places", "names", "persistent")

    def __init__(self, obj: torch.Tensor) -> None:
        self.obj = obj
        self.places: list = []
        self.names: list = []
        self.persistent = False


def _slots(model: torch.nn.Module):
    """Every parameter and every buffer of model, each once however many
    names it has, in named_parameters()/named_buffers() order."""
    params: Dict[int, _Slot] = {}
    buffers: Dict[int, _Slot] = {}
    for prefix, mod in model.named_modules(remove_duplicate=False):
        pre = prefix + "." if prefix else ""
        for n, p in mod._parameters.items():
            if p is not None:
                sl = params.setdefault(id(p), _Slot(p))
                sl.places.append((mod, n))
                sl.names.append(pre + n)
                sl.persistent = True
        for n, b in mod._buffers.items():
            if b is not None:
                sl = buffers.setdefault(id(b), _Slot(b))
                sl.places.append((mod, n))
                sl.names.append(pre + n)
                if n not in mod._non_persistent_buffers_set:
                    sl.persistent = True
    return list(params.values()), list(buffers.values())


def _describe(t: torch.Tensor) -> str:
    return "%s %s" % (tuple(t.shape), _dtype_name(t.dtype))


def attach(
    model: torch.nn.Module,
    weights: "Mapping[str, torch.Tensor] | str",
    strict: bool = True,
    client=None,
) -> IncompatibleKeys:
    """Binds model's parameters and buffers to the tensors of weights,
    without copying them.

    ``weights``: a mapping of names to torch tensors (``load_state_dict``,
    ``load_safetensors``, a state dict), or the key of a published state
    dict or the name of a loaded model (attached read-only through
    ``client``, None: the shared client of the default socket). Each parameter becomes ``torch.nn.Parameter(tensor,
    requires_grad=False)`` over the weights' tensor (the same memory:
    ``data_ptr()`` equal) and each buffer the weights' tensor itself, in
    every module and under every name that held it: a tied parameter (one
    Parameter under several names, as ``state_dict()`` lists them) gets one
    new Parameter, bound from
    the first of its names that the weights hold, so a checkpoint that
    stores a tie once (``lm_head.weight`` left out for ``embed.weight``)
    binds both. The module's own tensors are dropped: a module built
    normally frees its weights (if nothing else holds them), one built on
    the meta device (``meta_device()``, ``device="meta"``) never had any.

    Names are matched as ``named_parameters()``/``named_buffers()`` give
    them (= ``state_dict()`` keys; modules' ``_load_from_state_dict``
    hooks do not run). The module's shapes and dtypes must be the weights'
    (nothing is cast). A non-persistent buffer is bound if the weights
    hold it and kept otherwise, but one on the meta device that the
    weights lack is refused (``AttachError`` naming it, with ``strict``
    either way): the module could not run.

    ``strict=True``: a name of the module that the weights lack (missing),
    a name of the weights that the module lacks (unexpected) or a shape or
    dtype mismatch raises ``AttachError`` naming each and both shapes and
    dtypes, and nothing is bound. ``strict=False`` binds what fits and
    reports the rest. Returns ``IncompatibleKeys(missing_keys,
    unexpected_keys, mismatched_keys)``, empty lists where all fit.

    Parameters that the weights hold in a read-only (copy-on-write)
    mapping, as ``load_state_dict`` makes by default, may be written: the
    writer gets a private copy of each page it writes; other processes
    never see it.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError("attach: model must be an nn.Module, not a %s"
                        % type(model).__name__)
    if isinstance(weights, str):
        weights = _open_weights(client or client_for(None), weights)
    elif not isinstance(weights, collections.abc.Mapping):
        raise TypeError(
            "attach: weights must be a mapping of names to tensors "
            "(tensord.torch.load_state_dict, load_safetensors), the key of a "
            "published state dict or a model's name, not a %s"
            % type(weights).__name__
        )
    for k, v in weights.items():
        if not isinstance(v, torch.Tensor):
            raise TypeError(
                "attach: weights[%r] is a %s, not a torch.Tensor"
                % (k, type(v).__name__)
            )
    what = type(model).__name__
    params, buffers = _slots(model)
    missing: list = []
    mismatched: list = []
    meta_left: list = []
    known = set()
    bind: list = []  # (slot, tensor, is_parameter)
    for sl, is_param in [(p, True) for p in params] + [(b, False) for b in buffers]:
        known.update(sl.names)
        have = [n for n in sl.names if n in weights]
        if not have:
            if sl.persistent:
                missing.extend(sl.names)
            elif sl.obj.is_meta:
                meta_left.extend(sl.names)
            continue
        bad = False
        for n in have:
            t = weights[n]
            if t.shape != sl.obj.shape or t.dtype != sl.obj.dtype:
                mismatched.append(
                    Mismatch(n, tuple(sl.obj.shape), sl.obj.dtype,
                             tuple(t.shape), t.dtype)
                )
                bad = True
        if not bad:
            bind.append((sl, weights[have[0]], is_param))
    unexpected = [k for k in weights if k not in known]
    report = IncompatibleKeys(missing, unexpected, mismatched)
    if meta_left:
        raise AttachError(
            "attach: %s's non-persistent buffer%s %s %s on the meta device "
            "and not in the weights (no state dict holds a non-persistent "
            "buffer): build %s on the CPU (device='cpu' where it is made, "
            "even inside meta_device()), or pass the weights with %s added"
            % (
                what,
                "s" if len(meta_left) > 1 else "",
                ", ".join(repr(n) for n in meta_left),
                "are" if len(meta_left) > 1 else "is",
                "them" if len(meta_left) > 1 else "it",
                "them" if len(meta_left) > 1 else "it",
            ),
            report,
        )
    if strict and any(report):
        lines = ["attach: the weights do not fit %s:" % what]
        if missing:
            lines.append(
                "  missing (in the module, not in the weights): "
                + ", ".join(
                    "%r %s" % (n, _describe(_lookup_tensor(params, buffers, n)))
                    for n in missing
                )
            )
        if unexpected:
            lines.append(
                "  unexpected (in the weights, not in the module): "
                + ", ".join("%r %s" % (n, _describe(weights[n])) for n in unexpected)
            )
        for m in mismatched:
            lines.append("  mismatched: " + str(m))
        lines.append("(strict=False binds what fits and returns this report)")
        raise AttachError("\n".join(lines), report)
    for sl, t, is_param in bind:
        new = torch.nn.Parameter(t, requires_grad=False) if is_param else t
        for mod, n in sl.places:
            if is_param:
                mod._parameters[n] = new
            else:
                mod._buffers[n] = new
    return report


def _lookup_tensor(params, buffers, name: str) -> torch.Tensor:
    for sl in params + buffers:
        if name in sl.names:
            return sl.obj
    raise KeyError(name)


# --------------------------------------------------------------------------
# Following new versions.


class Follower:
    """What ``follow`` returns: the version of ``name`` in use now, kept
    current by a thread that waits for the daemon's events.

    ``weights``: the current ``Weights``; ``current``: what the callback
    returned for them (the weights themselves without a callback);
    ``version``: ``weights.version``; ``generation``: how many versions
    this follower has switched to (1 after ``follow`` returns); ``error``:
    the last exception of the thread (a callback's, a load's, or the
    daemon's going), None if none; ``alive``: the thread runs.
    """

    def __init__(
        self,
        name: str,
        callback: Optional[Callable[[Weights], Any]],
        client,
        timeout: Optional[float],
    ) -> None:
        self.name = name
        self._client = client
        self._callback = callback
        self._cond = threading.Condition()
        self._closing = False
        self.weights: Optional[Weights] = None
        self.current: Any = None
        self.generation = 0
        self.error: Optional[BaseException] = None
        # The watch first: a version published after it is an event, one
        # published before is what the first load gets.
        self._watch = client.watch(name)
        try:
            w = _open_weights(client, name, timeout=timeout)
            self._switch(w, raise_errors=True)
        except BaseException:
            self._watch.close()
            raise
        self._thread = threading.Thread(
            target=self._run, name="tensord follow %s" % name, daemon=True
        )
        self._thread.start()

    @property
    def version(self) -> Optional[int]:
        w = self.weights
        return None if w is None else w.version

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _switch(self, weights: Weights, raise_errors: bool = False) -> None:
        """Makes weights the current version: the callback's value first,
        then one assignment of each attribute. On the callback's exception
        the version in use stays (the exception raises, or is kept in
        .error)."""
        try:
            cur = weights if self._callback is None else self._callback(weights)
        except BaseException as e:
            if raise_errors:
                raise
            # The traceback as text: a log record that kept the exception
            # would keep its frames, and the version that failed with them.
            logging.getLogger("tensord").error(
                "follow %r: the callback raised for version %d; version %s "
                "stays in use\n%s", self.name, weights.version, self.version,
                traceback.format_exc().rstrip(),
            )
            self._keep_error(e)
            return
        with self._cond:
            self.weights = weights
            self.current = cur
            self.generation += 1
            self._cond.notify_all()

    def _keep_error(self, e: BaseException) -> None:
        """Keeps e in .error without its traceback, whose frames would keep
        the version that failed (and everything else they saw) alive."""
        self.error = e.with_traceback(None)
        e.__context__ = e.__cause__ = None

    def _run(self) -> None:
        w = self._watch
        while True:
            try:
                ev = w.next()  # blocks without the GIL until an event
                check = False
                while ev is not None:
                    # A publish of the key itself is a new version; lost
                    # events (dropped) may have been one. Those already
                    # here are taken in the same check.
                    if ev.dropped or (ev.type == "publish" and ev.key == self.name):
                        check = True
                    ev = w.next(timeout=0)
            except tensord.Closed as e:
                if not self._closing:
                    self._keep_error(e)  # tensord has gone
                break
            except BaseException as e:  # pragma: no cover - unexpected
                self._keep_error(e)
                break
            if check:
                self._update()

    def _update(self) -> None:
        """Loads the version published now and switches to it if it is not
        the one in use. (A method of its own: the thread keeps no reference
        to a version while it waits.)"""
        try:
            new = _open_weights(self._client, self.name)
        except tensord.NotFound:
            return  # unpublished since: keep what we have
        except BaseException as e:
            self._keep_error(e)
            return
        cur = self.weights
        if cur is not None and new.storage_ids == cur.storage_ids:
            return  # the version in use (its event came after the load)
        self._switch(new)

    def wait(self, generation: int, timeout: Optional[float] = None) -> bool:
        """Waits until this follower has switched to its generation-th
        version (``.generation >= generation``) or timeout seconds have
        passed; returns whether it has."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.generation >= generation or self._closing, timeout
            ) and self.generation >= generation

    def close(self) -> None:
        """Stops following: ends the watch, joins the thread (after a
        callback that runs now) and drops the follower's references to the
        current version, which goes once nothing else holds it. Idempotent;
        from the callback itself it does not join."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._watch.close()
        if threading.current_thread() is not self._thread:
            self._thread.join()
        self.weights = None
        self.current = None

    def __enter__(self) -> "Follower":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<tensord.torch.Follower %r version %s, generation %d%s>" % (
            self.name,
            self.version,
            self.generation,
            "" if self.alive else " (stopped)",
        )


def follow(
    name: str,
    callback: Optional[Callable[[Weights], Any]] = None,
    client=None,
    timeout: Optional[float] = 0,
) -> Follower:
    """Follows the versions published under ``name`` (a state dict's key or
    a model's name), without polling.

    Opens a watch on ``name`` (``Client.watch``: a connection of its own
    that the daemon tells of each publish), loads the version published now
    (read-only, like ``load_state_dict``; waiting up to ``timeout`` seconds
    for a first one, None forever) and calls ``callback(weights)`` for it in
    this thread, so that an error raises here. Then a thread waits for the
    daemon's events; at each publish of ``name`` it loads the new version
    and calls ``callback(weights)`` in that thread; the callback's return
    value becomes ``Follower.current`` (the weights without a callback). A
    callback that raises leaves the version in use as it was (the
    exception is kept in ``Follower.error``). Versions published faster
    than they load are skipped to the latest.

    ``client``: the Client to load through (None: the shared client of the
    default socket). Returns a ``Follower``; ``close()`` it (or use it as a
    context manager) to stop: that joins the thread and drops its
    references, so the last version goes once nothing else holds it.

    Swap between requests: make the callback build what serves a version,
    e.g. a module built on meta and attached to the weights, and let each
    request take ``follower.current`` once at its start and use only that::

        def build(weights):
            with tensord.torch.meta_device():
                model = Net()
            tensord.torch.attach(model, weights)
            return model.eval()

        follower = tensord.torch.follow("model", build)

        def handle(request):
            model = follower.current  # this request's version
            with torch.no_grad():
                return model(request)

    A request never sees a mix; an old version is freed when the last
    request that took it finishes.
    """
    if not isinstance(name, str):
        raise TypeError("follow: name must be a str, not a %s" % type(name).__name__)
    return Follower(name, callback, client or client_for(None), timeout)
