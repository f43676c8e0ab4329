"""tensord: tensors shared between processes through tensord, without copies.

    import tensord
    with tensord.connect() as c:          # the default socket, or path=...
        t = c.empty((4, 3), "float32")    # a new storage, zeroed
        t.numpy()[:] = 1                  # numpy over the same bytes
        c.publish("weights", t)
        u = c.lookup("weights", timeout=1.0, readonly=True)
        u.torch()                         # torch over the same bytes

    # Channels: a FIFO of storages between processes (docs/channels.md).
    with c.channel("frames", slots=4, slot_bytes=1 << 20) as ch:
        s = ch.loan()                     # a free slot, uint8[slot_bytes]
        s.numpy()[:3] = 1
        ch.send(s)                        # hands the slot over
    # elsewhere: c.channel("frames", side="recv").recv(timeout=1.0)

Everything is documented in docs/python.md. The core (Client, Tensor, the
errors) is the C extension tensord._tensord over libtensord; this module adds
alookup() and the dtype helpers. tensord.torch has the PyTorch integration.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
from multiprocessing.reduction import ForkingPickler
from typing import Optional

from . import _tensord
from ._tensord import (
    KEY_MAX,
    BrokenPipe,
    Channel,
    Closed,
    Error,
    Exists,
    NotFound,
    OutOfMemory,
    PermissionDenied,
    QuotaExceeded,
    Tensor,
    Timeout,
    Watch,
    WatchEvent,
    default_socket_path,
    dtype_name,
    dtype_size,
    find,
    watch,
)

__all__ = [
    "KEY_MAX",
    "BrokenPipe",
    "Channel",
    "Client",
    "Closed",
    "Error",
    "Exists",
    "NotFound",
    "OutOfMemory",
    "PermissionDenied",
    "QuotaExceeded",
    "Tensor",
    "Timeout",
    "Watch",
    "WatchEvent",
    "connect",
    "default_socket_path",
    "dtype_name",
    "dtype_size",
    "find",
    "watch",
]

__version__ = _tensord.libtensord_version

# The threads alookup() waits in: a pool of its own, so that waits do not
# take the event loop's default executor, remade in a forked child (a pool's
# threads do not survive fork()).
_pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
_pool_pid = 0
_pool_lock = threading.Lock()


def _executor() -> concurrent.futures.ThreadPoolExecutor:
    global _pool, _pool_pid
    with _pool_lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=64, thread_name_prefix="tensord-alookup"
            )
            _pool_pid = os.getpid()
        return _pool


if hasattr(os, "register_at_fork"):

    def _reset_lock_in_child() -> None:
        global _pool_lock
        _pool_lock = threading.Lock()

    os.register_at_fork(after_in_child=_reset_lock_in_child)


class Client(_tensord.Client):
    """A connection to tensord (see tensord.connect)."""

    def watch(self, prefix: str = "") -> Watch:
        """tensord.watch(prefix, path=self.path): this daemon's events whose
        key begins with prefix, on a connection of the Watch's own."""
        return Watch(prefix, self.path)

    async def alookup(
        self,
        key: str,
        timeout: Optional[float] = None,
        readonly: bool = False,
        take: bool = False,
    ) -> Tensor:
        """lookup() for asyncio: waits in a thread, not in the event loop.

        Cancelling the awaiting task cancels the wait (within
        tensord._tensord.SLICE_MS ms). If the lookup succeeded as it was
        cancelled, the Tensor is released, and with take=True the key is
        published again first (as an ordinary key), so nothing is lost.
        """
        cancel = threading.Event()
        cf = _executor().submit(
            self.lookup, key, timeout, readonly, take, _cancel=cancel
        )
        try:
            return await asyncio.wrap_future(cf)
        except asyncio.CancelledError:
            cancel.set()
            cf.add_done_callback(
                lambda f: _undo_lookup(self, key, take, f)
            )
            raise


def _undo_lookup(
    client: Client, key: str, take: bool, f: concurrent.futures.Future
) -> None:
    """Gives back what a cancelled alookup got after all: releases the
    Tensor and, for a take, publishes the key again first. A value published
    under the key meanwhile is newer than ours and stays (a scoped publish
    never replaces); ours then goes with the Tensor."""
    if f.cancelled() or f.exception() is not None:
        return
    t = f.result()
    try:
        if take:
            token = client.scope_open()
            try:
                client.publish(key, t, scope=token)
                client.publish(key, t)  # an ordinary key again
            except Exists:
                pass
            finally:
                client.scope_close(token)
    except Error:
        pass  # the client closed meanwhile: its keys went with it
    finally:
        t.release()


# -- multiprocessing -----------------------------------------------------------
#
# A multiprocessing.Queue pickles what put() was given later, in its feeder
# thread ("QueueFeederThread"): an exception raised there is printed and the
# object dropped, after put() has returned, and the consumer's get() waits
# forever for it. So a reducer that cannot send something raises where the
# caller pickles (a Pipe's send(), a SimpleQueue's put(), a spawned process's
# arguments), and in a feeder thread pickles the error instead: the
# consumer's get() raises it.


def _raise_unsent(cls: type, message: str) -> None:
    raise cls(message)


def _unsendable(exc: BaseException):
    """What a ForkingPickler reducer returns for what it cannot send: raises
    exc, except in a multiprocessing.Queue's feeder thread, where it returns
    a reduction whose unpickling raises exc's class with its message."""
    if threading.current_thread().name != "QueueFeederThread":
        raise exc
    cls = type(exc)
    if not (cls.__module__ == "builtins" or issubclass(cls, Error)):
        cls = TypeError  # one the receiver is sure to be able to unpickle
    msg = (
        "not sent: %s (process %d pickled it in its multiprocessing.Queue's "
        "feeder thread, after put() had returned)" % (exc, os.getpid())
    )
    return (_raise_unsent, (cls, msg))


def _reduce_tensor(t: Tensor):
    """ForkingPickler's reducer of a Tensor while tensord.torch.install() is
    not in effect: it cannot be sent."""
    return _unsendable(
        TypeError(
            "tensord.Tensor cannot be pickled: publish it under a key, or "
            "call tensord.torch.install() to send it through multiprocessing"
        )
    )


ForkingPickler.register(Tensor, _reduce_tensor)


def connect(path: Optional[str] = None, name: Optional[str] = None) -> Client:
    """Connects to tensord at path (None: $TENSORD_SOCKET, else
    $XDG_RUNTIME_DIR/tensord.sock, else /tmp/tensord-<uid>/tensord.sock).

    name: what tensorctl ls, info, top and watch call this client (at most
    63 bytes of printable ASCII are kept; others show as '?'). None: the
    default, $TENSORD_CLIENT_NAME if set, else the program's name (the
    script, "train.py", not "python3"). Client.name says which it got.

    The Client is a context manager, may be used from several threads at
    once, and reconnects by itself in a forked child, with the same name.
    """
    return Client(path, name)

