"""tensord.distributed: one copy per node over torch.distributed.

tensord is node-local: one daemon per machine. Across machines the engine is
torch.distributed (Gloo on CPUs, NCCL on GPUs), which a job runs anyway; this
module is the glue. The processes that talk to one tensord instance form a
node; the lowest rank of each node leads it. A state dict is broadcast among
the leaders only, straight into tensord storages, published on each node,
and every process attaches its node's single copy::

    import torch.distributed as dist
    from tensord import distributed as tdd

    dist.init_process_group("gloo")           # torchrun's environment
    sd = model.state_dict() if dist.get_rank() == 0 else None
    weights = tdd.broadcast_state_dict(sd, "llm/weights")
    tensord.torch.attach(model, weights)

Everything is documented in docs/distributed.md.
"""

from __future__ import annotations

import datetime
import json
import mmap
import os
import threading
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch
import torch.distributed as dist

import tensord
from . import torch as _tt

__all__ = [
    "BUCKET_MAX",
    "NodeError",
    "broadcast_state_dict",
    "load_safetensors_distributed",
    "node_groups",
]

BUCKET_MAX = 256 << 20  # bytes of one collective call at most


class NodeError(RuntimeError):
    """A collective across nodes failed: a rank had no tensord, a node's
    leader died or failed, or the broadcast among the leaders broke. The
    message says which node, which rank and what it was doing; nothing of
    the failed attempt stays in any tensord."""


# --------------------------------------------------------------------------
# Which ranks share a machine.


class _Nodes:
    """The node layout of one group: which ranks talk to which tensord."""

    def __init__(self, world, group, nodes: List[List[int]], instances: list,
                 paths: list) -> None:
        self.world = world  # the default group these groups belong to
        self.group = group
        self.nodes = nodes  # per node, its global ranks, ascending
        self.instances = instances  # per node, its tensord instance
        self.paths = paths  # per node, the leader's socket path
        self.node_of = {r: n for n, rs in enumerate(nodes) for r in rs}
        self.leaders = [rs[0] for rs in nodes]
        self.local_groups: list = []
        self.leaders_group = None
        self.leaders_gloo = None  # the leaders over Gloo (CPU bytes)

    def leader_of(self, rank: int) -> int:
        return self.nodes[self.node_of[rank]][0]

    def describe(self, node: int) -> str:
        return "node %d (tensord instance %016x, ranks %s)" % (
            node, self.instances[node], ",".join(map(str, self.nodes[node])))


_cache: Dict[int, _Nodes] = {}
_cache_lock = threading.Lock()


def _timeout(timeout) -> datetime.timedelta:
    if timeout is None:
        return dist.default_pg_timeout
    if isinstance(timeout, datetime.timedelta):
        return timeout
    return datetime.timedelta(seconds=float(timeout))


def _group_ranks(group) -> List[int]:
    if group is None or group is dist.GroupMember.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def _node_layout(group, client, timeout) -> _Nodes:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "tensord.distributed: torch.distributed is not initialized: call "
            "torch.distributed.init_process_group first (torchrun sets its "
            "environment)"
        )
    world = dist.distributed_c10d._get_default_group()
    with _cache_lock:
        hit = _cache.get(id(group))
        if hit is not None and hit.world is world and hit.group is group:
            return hit
    # Every process of the world takes part, as in new_group(): each group
    # is made by all of them in the same order.
    mine: Tuple[Optional[int], str, Optional[str]]
    try:
        c = client if client is not None else _tt.client_for(None)
        mine = (c.instance, c.path, None)
    except tensord.Error as e:
        path = getattr(client, "path", None) or tensord.default_socket_path()
        mine = (None, path, "%s: %s" % (type(e).__name__, e))
    got: list = [None] * dist.get_world_size()
    dist.all_gather_object(got, mine)
    members = _group_ranks(group)
    bad = [(r, got[r]) for r in members if got[r][0] is None]
    if bad:
        raise NodeError(
            "tensord.distributed: %s" % "; ".join(
                "rank %d has no tensord at %s (%s)" % (r, g[1], g[2])
                for r, g in bad)
        )
    by_instance: Dict[int, List[int]] = {}
    for r in sorted(members):
        by_instance.setdefault(got[r][0], []).append(r)
    nodes = sorted(by_instance.values(), key=lambda rs: rs[0])
    out = _Nodes(world, group, nodes, [got[rs[0]][0] for rs in nodes],
                 [got[rs[0]][1] for rs in nodes])
    t = _timeout(timeout)
    for rs in nodes:
        out.local_groups.append(dist.new_group(rs, timeout=t))
    out.leaders_group = dist.new_group(out.leaders, timeout=t)
    if dist.get_backend() == "gloo":
        out.leaders_gloo = out.leaders_group
    else:  # NCCL moves device memory only: the CPU bytes go over Gloo
        out.leaders_gloo = dist.new_group(out.leaders, timeout=t, backend="gloo")
    with _cache_lock:
        _cache[id(group)] = out
    return out


def node_groups(group=None, client=None, timeout=None):
    """Which ranks share a machine: ``(local_group, leaders_group,
    is_leader)`` for the calling rank.

    Ranks share a node when they talk to the same tensord instance (the
    ``instance`` their Client reports), gathered from every rank with
    ``all_gather_object``: not host names, not LOCAL_RANK (two jobs on one
    host, containers, and two daemons on one machine all come out right).
    The lowest rank of each node leads it. ``local_group`` holds the
    calling rank's node; ``leaders_group`` every node's leader.

    ``group``: the ranks to divide (None: the world). As with
    ``torch.distributed.new_group``, every process of the world must call
    it, members of ``group`` or not (a non-member gets ``(None, None,
    False)``). ``client``: this rank's Client (None: the shared client of
    the default socket, ``$TENSORD_SOCKET``). ``timeout`` (seconds or a
    timedelta; None: torch's default) bounds every collective of the groups
    made. The result is cached per group; the first call is collective.
    Raises NodeError naming every rank that has no tensord.
    """
    nodes = _node_layout(group, client, timeout)
    me = dist.get_rank()
    if me not in nodes.node_of:
        return None, None, False
    n = nodes.node_of[me]
    return nodes.local_groups[n], nodes.leaders_group, me == nodes.leaders[n]


# --------------------------------------------------------------------------
# Broadcasting a state dict.


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return ("%d %s" if unit == "B" else "%.1f %s") % (n, unit)
        n /= 1024.0
    raise AssertionError("unreachable")


def _buckets(lo: int, hi: int, size: int) -> List[Tuple[int, int]]:
    return [(a, min(a + size, hi)) for a in range(lo, hi, size)]


def _stage_key(name: str, version: int, i: Optional[int]) -> str:
    return "%s@%d/stage" % (name, version) + ("" if i is None else str(i))


class _Failed(Exception):
    """A step of this rank failed: the message (for every rank to raise)."""


def _check_use(got: list, members: List[int], src: int, bucket: int) -> None:
    """Raises the same error on every rank for wrong use, from what each
    rank passed: (name, passed a dict, its plan error)."""
    if src not in members:
        raise ValueError(
            "broadcast_state_dict: src rank %d is not in the group (ranks %s)"
            % (src, ",".join(map(str, members))))
    names = {r: g[0] for r, g in zip(members, got)}
    for r, n in names.items():
        if not isinstance(n, str) or not n:
            raise TypeError(
                "broadcast_state_dict: rank %d passed name %r: a non-empty str"
                % (r, n))
    if len(set(names.values())) > 1:
        raise ValueError(
            "broadcast_state_dict: the ranks disagree on the name: %s; every "
            "rank must pass the same" % ", ".join(
                "rank %d %r" % (r, n) for r, n in sorted(names.items())))
    sizes = {g[3] for g in got}
    if len(sizes) > 1:
        raise ValueError(
            "broadcast_state_dict: the ranks disagree on bucket_bytes (%s)"
            % ", ".join(map(str, sorted(sizes))))
    has = {r: g[1] for r, g in zip(members, got)}
    if not has[src]:
        raise ValueError(
            "broadcast_state_dict %r: rank %d is src and passed None: the "
            "source rank passes its state dict (or path)" % (names[src], src))
    extra = sorted(r for r, h in has.items() if h and r != src)
    if extra:
        raise ValueError(
            "broadcast_state_dict %r: rank%s %s passed a state dict (or a "
            "path), but only src (rank %d) may: the others pass None" % (
                names[src], "s" if len(extra) > 1 else "",
                ",".join(map(str, extra)), src))
    err = got[members.index(src)][2]
    if err is not None:
        kind, msg = err
        raise (TypeError if kind == "TypeError" else ValueError)(
            "broadcast_state_dict %r: rank %d's state dict: %s"
            % (names[src], src, msg))
    if not 0 < bucket <= BUCKET_MAX:
        raise ValueError(
            "broadcast_state_dict: bucket_bytes %d: from 1 to %d"
            % (bucket, BUCKET_MAX))


class _Leader:
    """What one node's leader does: make the node's storages, have them
    filled (by itself, by src on its node, or by the broadcast among the
    leaders), publish them. ``phase`` says what it is doing, for errors."""

    def __init__(self, client, nodes: _Nodes, name: str, spec: dict,
                 src: int, bucket: int) -> None:
        self.c = client
        self.nodes = nodes
        self.name = name
        self.src = src
        self.bucket = bucket
        self.me = dist.get_rank()
        self.node = nodes.node_of[self.me]
        self.local = nodes.local_groups[self.node]
        self.packing = _tt._Packing(name, spec["tensors"], spec["regions"])
        self.packed = None
        self.gpu: dict = {}
        self.scope = None
        self.phase = "making the storages"

    def release(self) -> None:
        if self.scope is not None:
            try:
                self.c.scope_close(self.scope)
            except tensord.Error:
                pass
            self.scope = None
        for g in self.gpu.values():
            g.release()
        self.gpu.clear()
        if self.packed is not None:
            self.packed.release()
            self.packed = None

    def make(self) -> None:
        p = self.packing
        self.packed = self.c.empty((p.total,), "uint8", uninit=True)
        if p.on_gpu:
            if not torch.cuda.is_available():
                raise _Failed(
                    "the state dict has %d regions on a GPU, and this rank's "
                    "torch (%s) has no CUDA" % (len(p.on_gpu), torch.__version__))
            dev = "cuda:%d" % torch.cuda.current_device()
            for i in p.on_gpu:
                n = p.specs[i][1]
                self.gpu[i] = self.c.empty((max(n, 1),), "uint8", uninit=True,
                                           device=dev)

    def stage(self) -> Dict[str, Any]:
        """Publishes the storages for src (on this node, not its leader) to
        fill, in a scope of ours: if we die, the keys and storages go."""
        self.scope = self.c.scope_open()
        v = self.packed.storage_id
        keys = {"packed": _stage_key(self.name, v, None), "gpu": {}}
        self.c.publish(keys["packed"], self.packed, scope=self.scope)
        for i, g in self.gpu.items():
            keys["gpu"][i] = _stage_key(self.name, v, i)
            self.c.publish(keys["gpu"][i], g, scope=self.scope)
        return keys

    def send_or_receive(self) -> int:
        """The bytes after the header among the leaders, in buckets of at
        most self.bucket bytes; returns how many collective calls."""
        src_leader = self.nodes.leader_of(self.src)
        sending = self.me == src_leader
        p = self.packing
        plan = [(None, lo, hi) for lo, hi in _buckets(p.start, p.total, self.bucket)]
        for i in p.on_gpu:
            plan += [(i, lo, hi) for lo, hi in _buckets(0, p.specs[i][1], self.bucket)]
        whom = "node %d's leader (rank %d)" % (self.nodes.node_of[src_leader],
                                               src_leader)
        buf = self.packed.torch()
        gbuf = {i: g.torch() for i, g in self.gpu.items()}
        try:
            for k, (i, lo, hi) in enumerate(plan):
                self.phase = "%s bucket %d of %d (%s, bytes %d-%d%s) %s" % (
                    "sending" if sending else "receiving", k + 1, len(plan),
                    _human(hi - lo), lo, hi,
                    "" if i is None else " of GPU region %d" % i,
                    "to the other nodes' leaders" if sending else "from " + whom)
                if i is None:
                    dist.broadcast(buf[lo:hi], src=src_leader,
                                   group=self.nodes.leaders_gloo)
                else:
                    dist.broadcast(gbuf[i][lo:hi], src=src_leader,
                                   group=self.nodes.leaders_group)
            if gbuf:
                torch.cuda.synchronize()
        finally:
            del buf, gbuf
        return len(plan)

    def publish(self) -> int:
        self.phase = "publishing %r on its tensord" % self.name
        v = self.packed.storage_id
        head = self.packing.header(v, {i: g.storage_id for i, g in self.gpu.items()})
        buf = self.packed.torch()
        buf[: len(head)].copy_(torch.frombuffer(bytearray(head), dtype=torch.uint8))
        del buf
        _tt._switch(self.c, self.name, self.packed, self.gpu)
        return v


def _fill_from(client, keys: dict, packing, regions: list) -> None:
    """src, on a node it does not lead: writes its regions into the storages
    its leader staged under keys."""
    got = []
    try:
        t = client.lookup(keys["packed"], timeout=0)
        got.append(t)
        buf = t.torch()
        packing.fill(buf, regions)
        del buf
        for i, k in keys["gpu"].items():
            g = client.lookup(k, timeout=0)
            got.append(g)
            r = regions[int(i)]
            if r.nbytes:
                with torch.no_grad():
                    d = g.torch()
                    d[: r.nbytes].copy_(r.torch_bytes())
                    torch.cuda.synchronize(d.device)
                    del d
    finally:
        for t in got:
            t.release()


def _local_bcast(obj, src: int, group) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _local_gather(obj, group, size: int) -> list:
    box: list = [None] * size
    dist.all_gather_object(box, obj, group=group)
    return box


def broadcast_state_dict(
    state_dict: "Optional[Mapping[str, torch.Tensor] | torch.nn.Module]",
    name: str,
    src: int = 0,
    group=None,
    client=None,
    timeout=None,
    bucket_bytes: int = BUCKET_MAX,
) -> "_tt.Weights":
    """Broadcasts src's state dict so that every node holds one copy in its
    tensord, published under ``name``; returns this rank's zero-copy
    tensors of its node's copy (a ``Weights``, as ``load_state_dict``).

    Collective: every rank of ``group`` (None: the world) calls it with the
    same ``name``; rank ``src`` (a global rank) passes its state dict (or an
    nn.Module), every other rank None. Each node's leader makes the packed
    storage of the state dict in its tensord (the layout of
    ``publish_state_dict``) and receives the bytes with
    ``torch.distributed.broadcast`` among the leaders straight into it, in
    buckets of at most ``bucket_bytes`` (≤ 256 MiB) each; src's node fills
    its copy from src's tensors. Once every leader has every byte, each
    publishes its copy under ``name`` (atomically replacing an older
    version), and the node's other ranks attach it. The bytes cross the
    network once per node. CPU regions travel over Gloo; regions on a GPU
    go into daemon-owned CUDA storages on each leader's current device,
    over the default backend (NCCL).

    ``client``: this rank's Client (None: the shared client of the default
    socket). ``timeout`` (seconds, a timedelta): applies to the groups
    node_groups() makes on the first call for ``group``, and so bounds how
    long a rank waits for a dead peer. Raises ValueError/TypeError on every
    rank for wrong use (src passing None, another rank passing a dict, ranks
    disagreeing on the name), NodeError when a rank has no tensord or a
    leader failed or died (naming the node, the leader and what it was
    doing); then nothing of the attempt stays in any tensord.
    """
    return _broadcast(state_dict, name, src, group, client, timeout,
                      bucket_bytes, None, None, state_dict is not None)


def _check_name(name: str, nregions: int) -> None:
    longest = max(_stage_key(name, _tt._NO_ID, nregions),
                  _tt._region_key(name, _tt._NO_ID, nregions), key=len)
    if len(longest.encode()) > tensord.KEY_MAX:
        raise ValueError(
            "name %r of %d bytes leaves no room for its staging and region "
            "keys (%s; a key has at most %d bytes)" % (
                name, len(name.encode()), longest, tensord.KEY_MAX))


def _broadcast(state_dict, name, src, group, client, timeout, bucket_bytes,
               read_error: Optional[str], metadata: Optional[dict],
               passed: bool):
    nodes = _node_layout(group, client, timeout)
    me = dist.get_rank()
    members = _group_ranks(group)
    if me not in members:
        raise ValueError(
            "broadcast_state_dict: rank %d is not in the group (ranks %s)"
            % (me, ",".join(map(str, members))))
    c = client if client is not None else _tt.client_for(None)

    spec = regions = None
    err = None
    if read_error is not None and me == src:
        err = ("ValueError", read_error)
    elif me == src and state_dict is not None:
        try:
            tensors, regions = _tt._plan(state_dict, "broadcast_state_dict")
            spec = {"tensors": tensors, "metadata": metadata or {},
                    "regions": [(r.device, r.nbytes) for r in regions]}
            if isinstance(name, str):
                _check_name(name, len(regions))
        except (TypeError, ValueError) as e:
            err = (type(e).__name__, str(e))
    got = _local_gather((name, passed, err, int(bucket_bytes)), group,
                        len(members))
    _check_use(got, members, src, int(bucket_bytes))
    spec = _local_bcast(spec, src, group)

    n = nodes.node_of[me]
    local = nodes.local_groups[n]
    leader = nodes.leaders[n]
    src_here = nodes.node_of[src] == n
    where = nodes.describe(n)

    if me == leader:
        version = _lead(c, nodes, name, spec, src, int(bucket_bytes), regions)
    else:
        try:
            if src_here and src != leader:  # staged for src to fill
                keys = _local_bcast(None, leader, local)
                fill_err = None
                if me == src and keys is not None:
                    try:
                        _fill_from(c, keys, _tt._Packing(name, spec["tensors"],
                                                         spec["regions"]), regions)
                    except Exception as e:  # noqa: BLE001 - the leader must hear it
                        fill_err = "rank %d writing its state dict: %s: %s" % (
                            me, type(e).__name__, e)
                _local_gather(fill_err, local, len(nodes.nodes[n]))
            status = _local_bcast(None, leader, local)
        except RuntimeError as e:
            raise NodeError(
                "broadcast_state_dict %r: %s: its leader (rank %d) died or "
                "failed while this rank waited for it to receive and publish "
                "the state dict: %s" % (name, where, leader, e)) from None
        if status[0] != "ok":
            raise NodeError(status[1])
        version = status[1]
    w = _tt._lookup_state_dict(c, name, 0, True, models=False)
    if w.version != version:
        raise NodeError(
            "broadcast_state_dict %r: %s: the key was replaced meanwhile "
            "(version %d instead of the %d just broadcast): another publisher "
            "under the same name" % (name, where, w.version, version))
    w.metadata = dict(spec.get("metadata") or {})
    return w


def _lead(c, nodes: _Nodes, name: str, spec: dict, src: int, bucket: int,
          regions) -> int:
    """A node leader's part of broadcast_state_dict; returns the version
    published on this node. Reports the outcome to the node's other ranks
    in every case."""
    me = dist.get_rank()
    n = nodes.node_of[me]
    local = nodes.local_groups[n]
    size = len(nodes.nodes[n])
    where = nodes.describe(n)
    L = _Leader(c, nodes, name, spec, src, bucket)
    status: Tuple[str, Any] = ("failed", "")
    try:
        try:
            err = None
            try:
                L.make()
            except (tensord.Error, _Failed) as e:
                err = "%s: its leader (rank %d) failed %s: %s" % (
                    where, me, L.phase, e)
            if nodes.node_of[src] == n:
                # Every failure here becomes err, so that the leaders still
                # agree below: the others hear the cause, not a timeout.
                try:
                    if me == src:
                        if err is None:
                            L.phase = "copying the state dict into its tensord"
                            L.packing.fill(L.packed.torch(), regions)
                            for i, g in L.gpu.items():
                                with torch.no_grad():
                                    d = g.torch()
                                    d[: regions[i].nbytes].copy_(
                                        regions[i].torch_bytes())
                                    del d
                            if L.gpu:
                                torch.cuda.synchronize()
                    else:
                        L.phase = "waiting for rank %d to write the state dict" % src
                        keys = None
                        if err is None:
                            try:
                                keys = L.stage()
                            except tensord.Error as e:
                                err = "%s: its leader (rank %d) failed staging " \
                                      "its storages: %s" % (where, me, e)
                        _local_bcast(keys, me, local)
                        errs = [e for e in _local_gather(None, local, size) if e]
                        if err is None and errs:
                            err = "%s: %s" % (where, errs[0])
                        if L.scope is not None:
                            c.scope_close(L.scope)
                            L.scope = None
                except (tensord.Error, RuntimeError) as e:
                    if err is None:
                        err = "%s: its leader (rank %d) failed %s: %s" % (
                            where, me, L.phase, e)
            if len(nodes.leaders) > 1:
                L.phase = "agreeing with the other leaders to start"
                errs = [e for e in _local_gather(err, nodes.leaders_group,
                                                 len(nodes.leaders)) if e]
                if errs:
                    raise _Failed("broadcast_state_dict %r: %s" % (name, errs[0]))
                L.send_or_receive()
                L.phase = "agreeing with the other leaders that every node has every byte"
                _local_gather(True, nodes.leaders_group, len(nodes.leaders))
            elif err is not None:
                raise _Failed("broadcast_state_dict %r: %s" % (name, err))
            version = L.publish()
            status = ("ok", version)
            return version
        except _Failed as e:
            status = ("failed", str(e))
            raise NodeError(str(e)) from None
        except (RuntimeError, tensord.Error) as e:
            status = ("failed", "broadcast_state_dict %r: %s: its leader (rank "
                      "%d) failed while %s: %s" % (name, where, me, L.phase, e))
            raise NodeError(status[1]) from None
        finally:
            if size > 1:
                try:
                    _local_bcast(status, me, local)
                except RuntimeError:
                    pass  # a local rank died: it needs no answer
    finally:
        L.release()


# --------------------------------------------------------------------------
# A checkpoint on one machine's disk.


def _read_safetensors(path: str) -> Tuple[Dict[str, torch.Tensor], dict]:
    """The tensors of a safetensors file (or a sharded checkpoint's
    index.json), as read-only torch tensors over the file's pages (mmap:
    no copy), and its metadata. Raises ValueError naming the file, the
    tensor and the field for a file that breaks a rule of the format."""
    if os.path.isdir(path):
        found = sorted(f for f in os.listdir(path)
                       if f.endswith(".safetensors.index.json"))
        if not found:
            found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
            if len(found) != 1:
                raise ValueError(
                    "%s: a directory with one .safetensors file or an index, "
                    "not %d files" % (path, len(found)))
        path = os.path.join(path, found[0])
    if path.endswith(".json"):
        with open(path) as f:
            index = json.load(f)
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict):
            raise ValueError("%s: no weight_map object" % path)
        out: Dict[str, torch.Tensor] = {}
        base = os.path.dirname(path)
        for shard in sorted(set(wm.values())):
            ts, _ = _read_safetensors(os.path.join(base, shard))
            out.update(ts)
        missing = sorted(set(wm) - set(out))
        if missing:
            raise ValueError("%s: %d tensors of the weight_map are in no shard, "
                             "first %r" % (path, len(missing), missing[0]))
        meta = index.get("metadata") or {}
        return out, meta if isinstance(meta, dict) else {}
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError("%s: %d bytes: no safetensors header" % (path, size))
        hlen = int.from_bytes(f.read(8), "little")
        if hlen > min(size - 8, 100 << 20):
            raise ValueError("%s: header of %d bytes in a file of %d"
                             % (path, hlen, size))
        try:
            header = json.loads(f.read(hlen))
        except ValueError as e:
            raise ValueError("%s: header is not JSON: %s" % (path, e)) from None
        mm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if size > 8 + hlen else None
    if not isinstance(header, dict):
        raise ValueError("%s: header is not a JSON object" % path)
    meta = header.pop("__metadata__", None) or {}
    data = size - 8 - hlen
    with warnings.catch_warnings():  # read-only pages: only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        raw = (torch.frombuffer(mm, dtype=torch.uint8, offset=8 + hlen)
               if mm is not None else torch.empty(0, dtype=torch.uint8))
    out = {}
    names = {v: k for k, v in _tt._ST_DTYPES.items()}
    for tname, e in header.items():
        what = "%s: tensor %r" % (path, tname)
        if not isinstance(e, dict):
            raise ValueError("%s: not an object" % what)
        dt = names.get(e.get("dtype"))
        if dt is None:
            raise ValueError("%s: dtype %r: not one of %s"
                             % (what, e.get("dtype"), ", ".join(sorted(names))))
        shape, offs = e.get("shape"), e.get("data_offsets")
        if not (isinstance(shape, list) and all(
                isinstance(d, int) and d >= 0 for d in shape)):
            raise ValueError("%s: shape %r: a list of sizes >= 0" % (what, shape))
        if not (isinstance(offs, list) and len(offs) == 2 and all(
                isinstance(o, int) for o in offs) and 0 <= offs[0] <= offs[1] <= data):
            raise ValueError("%s: data_offsets %r: [begin, end] within the %d "
                             "bytes of data" % (what, offs, data))
        isz = _tt._itemsize(dt)
        numel = 1
        for d in shape:
            numel *= d
        if offs[1] - offs[0] != numel * isz:
            raise ValueError("%s: data_offsets %r hold %d bytes; shape %s of %s "
                             "needs %d" % (what, offs, offs[1] - offs[0], shape,
                                           e["dtype"], numel * isz))
        b = offs[0]
        if b % isz == 0:  # a view of the file's pages
            t = raw.view(dt) if isz == 1 else raw[: data // isz * isz].view(dt)
            t = t[b // isz : b // isz + numel]
        else:  # misaligned for its dtype: a copy of its own
            t = raw[b : b + numel * isz].clone().view(dt)
        out[tname] = t.view(shape)
    return out, meta if isinstance(meta, dict) else {}


def load_safetensors_distributed(
    path: "Optional[str | os.PathLike]",
    name: str,
    src: int = 0,
    group=None,
    client=None,
    timeout=None,
    bucket_bytes: int = BUCKET_MAX,
) -> "_tt.Weights":
    """One rank reads a safetensors checkpoint; every node gets one copy.

    For jobs where only one machine has the checkpoint on local disk: rank
    ``src`` passes ``path`` (a ``.safetensors`` file, a sharded
    checkpoint's ``*.index.json``, or a directory holding either), every
    other rank passes None. src maps the file (no read into memory of its
    own) and broadcast_state_dict() does the rest: the result, errors and
    arguments are its. The weights are published as a state dict under
    ``name`` (``load_state_dict`` attaches them later); every rank's result
    has the checkpoint's ``__metadata__`` in ``.metadata``.
    """
    sd = None
    meta: dict = {}
    err = None
    if dist.is_initialized() and dist.get_rank() == src and path is not None:
        try:
            sd, meta = _read_safetensors(os.fspath(path))
        except (OSError, ValueError) as e:  # every rank raises it
            err = "reading %s: %s" % (os.fspath(path), e)
    return _broadcast(sd, name, src, group, client, timeout, bucket_bytes,
                      err, meta, path is not None)
