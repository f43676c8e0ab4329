#!/usr/bin/env python3
"""include_graph.py: the daemon's include graph, module by module.

A module is a .c file and its .h (conn.c + conn.h is "conn"); module A
depends on B when A.c or A.h includes B.h (by its name in quotes). Prints,
for each folder given, its modules, lines, and every circle (strongly
connected component of more than one module); with --max N exits 1 if a
circle inside a folder has more than N modules or if any circle spans two
folders (a floor must never call back up).

  include_graph.py [--max N] DIR...
"""
import os
import re
import sys

INC = re.compile(r'^\s*#\s*include\s*"([^"]+)"', re.M)


def modules(dirs):
    """Each folder's modules, their files, and the header names taken twice
    (an include by bare name would then depend on the include path)."""
    mods, where, twice = {}, {}, []
    for d in dirs:
        for f in sorted(os.listdir(d)):
            stem, ext = os.path.splitext(f)
            if ext not in (".c", ".h"):
                continue
            key = (d, stem)
            mods.setdefault(key, []).append(os.path.join(d, f))
            if ext == ".h":
                if f in where:
                    twice.append("%s/%s and %s/%s" % (where[f][0], f, d, f))
                where[f] = key
    edges = {}
    for key, files in mods.items():
        out = set()
        for path in files:
            with open(path, encoding="utf-8") as fh:
                for h in INC.findall(fh.read()):
                    dep = where.get(os.path.basename(h))
                    if dep is not None and dep != key:
                        out.add(dep)
        edges[key] = out
    return mods, edges, twice


def circles(edges):
    """Tarjan's strongly connected components, iteratively."""
    index, low, on, stack, out, n = {}, {}, set(), [], [], 0
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = n
        n += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = n
                    n += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def main(argv):
    limit = None
    if argv[:1] == ["--max"]:
        limit, argv = int(argv[1]), argv[2:]
    mods, edges, twice = modules(argv)
    status = 0
    for t in twice:
        print("include_graph: two headers of one name: %s" % t, file=sys.stderr)
        status = 1
    for d in argv:
        ms = [k for k in mods if k[0] == d]
        lines = sum(sum(1 for _ in open(p, encoding="utf-8"))
                    for k in ms for p in mods[k])
        print("%s: %d modules, %d files, %d lines" %
              (d, len(ms), sum(len(mods[k]) for k in ms), lines))
    for comp in circles(edges):
        floors = sorted({d for d, _ in comp})
        names = " ".join("%s/%s" % (d.rsplit("/", 1)[-1], m) for d, m in comp)
        print("circle of %d modules: %s" % (len(comp), names))
        if limit is not None and len(floors) > 1:
            print("include_graph: a circle spans %s: a floor includes one above it"
                  % " and ".join(floors), file=sys.stderr)
            status = 1
        elif limit is not None and len(comp) > limit:
            print("include_graph: a circle of %d modules in %s (at most %d)"
                  % (len(comp), floors[0], limit), file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
