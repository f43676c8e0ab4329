"""find() racing the last release of a storage, run by test_find_race.py.

usage: _find_race.py SOCKET [ROUNDS] [FILLERS]

For each of ROUNDS storages, a thread of its own that never holds the GIL
(started with pthread_create, as torch frees a tensor from C++) runs the
DLPack deleter holding the storage's last reference, while the main thread
calls find() on the storage's address without pause until it has joined. FILLERS other handles,
registered after the targets, sit before them in the registry that find()
scans, so find() is usually mid-scan, holding the registry's lock, when the
deleter drops the count to zero: the window in which a find() that revives a
count of zero hands out a store that the deleter then frees. Every hit is
read through (its numpy() byte), so a freed store or its unmapped pages crash
the process. Prints "rounds R hits H" and exits 0 when nothing went wrong.
"""

import ctypes
import sys

import tensord


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device_type", ctypes.c_int32),
        ("device_id", ctypes.c_int32),
        ("ndim", ctypes.c_int32),
        ("dtype_code", ctypes.c_uint8),
        ("dtype_bits", ctypes.c_uint8),
        ("dtype_lanes", ctypes.c_uint16),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_get_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_get_pointer.restype = ctypes.c_void_p
_get_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]
_set_name = ctypes.pythonapi.PyCapsule_SetName
_set_name.restype = ctypes.c_int
_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
# The capsule keeps a pointer to its name: one buffer that outlives them all.
_USED = ctypes.create_string_buffer(b"used_dltensor")

_libc = ctypes.CDLL(None, use_errno=True)
_pthread_create = _libc.pthread_create
_pthread_create.restype = ctypes.c_int
_pthread_create.argtypes = [
    ctypes.POINTER(ctypes.c_ulong), ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p,
]
_tryjoin = _libc.pthread_tryjoin_np
_tryjoin.restype = ctypes.c_int
_tryjoin.argtypes = [ctypes.c_ulong, ctypes.c_void_p]


def consume(cap) -> "tuple":
    """Takes the DLManagedTensor out of a capsule, as a consumer does (the
    capsule's destructor then leaves it alone); returns (deleter's address,
    the DLManagedTensor's)."""
    m = _get_pointer(cap, b"dltensor")
    if _set_name(cap, _USED) != 0:
        raise RuntimeError("PyCapsule_SetName failed")
    return DLManagedTensor.from_address(m).deleter, m


def main() -> None:
    sock = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    fillers = int(sys.argv[3]) if len(sys.argv) > 3 else 2000
    c = tensord.connect(sock)
    targets = []
    for _ in range(rounds):
        t = c.empty((4096,), "uint8")
        targets.append((t.data_ptr, consume(t.__dlpack__())))
        t.release()  # the DLPack export holds the storage's last reference
    filler = c.empty((1,), "uint8")
    held = [c.open(filler.storage_id) for _ in range(fillers)]

    hits = 0
    for ptr, (deleter, m) in targets:
        # void deleter(DLManagedTensor *) as a thread's void *(*)(void *).
        tid = ctypes.c_ulong()
        err = _pthread_create(ctypes.byref(tid), None, deleter, m)
        if err:
            raise OSError(err, "pthread_create")
        while True:
            hit = tensord.find(ptr)
            if hit is not None:
                t, off = hit
                t.numpy()[off]  # a freed store, unmapped pages: a crash
                t.release()
                hits += 1
            if _tryjoin(tid.value, None) == 0:
                break
    for h in held:
        h.release()
    filler.release()
    c.ping()
    left = [s["id"] for s in c.ls()]
    if left:
        raise SystemExit("storages left: %s" % left)
    c.close()
    print("rounds %d hits %d" % (rounds, hits))


if __name__ == "__main__":
    main()
