#!/usr/bin/python3
"""run: runs the Python benchmarks (`make bench` calls it after tests/bench/run.sh).

Usage: /usr/bin/python3 python/bench/run.py [BUILD_DIR] [--quick]

Runs bench_handoff.py, bench_dataloader.py, bench_weights.py,
bench_models.py and bench_distributed.py, each with its own private tensord from BUILD_DIR (default
build/): $TENSORD_BIN defaults to BUILD_DIR/daemon/tensord and the package comes
from BUILD_DIR/python. Prints
their tables and how long each took; exits non-zero if one failed.
TD_BENCH_ONLY="bench_weights.py ..." runs only those (names with .py: bare
names are the C benchmarks, which tests/bench/run.sh runs); TD_BENCH_SCALE
scales every time budget as for the C benchmarks.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
BENCHES = ["bench_handoff.py", "bench_dataloader.py", "bench_weights.py", "bench_models.py",
           "bench_distributed.py"]


def main(argv: list[str]) -> int:
    quick = "--quick" in argv
    rest = [a for a in argv if a != "--quick"]
    build = os.path.abspath(rest[0] if rest else os.path.join(REPO, "build"))
    env = dict(os.environ)
    env["TENSORD_BUILD"] = build
    env.setdefault("TENSORD_BIN", os.path.join(build, "daemon", "tensord"))
    pp = os.path.join(build, "python")
    env["PYTHONPATH"] = pp + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    only = os.environ.get("TD_BENCH_ONLY", "").split()
    benches = [b for b in only if b.endswith(".py")] if only else BENCHES
    for b in benches:
        if b not in BENCHES:
            print(f"run.py: no Python benchmark {b} (there are: {' '.join(BENCHES)})",
                  file=sys.stderr)
            return 2
    try:
        subprocess.run([sys.executable, "-c", "import torch, numpy"], env=env, check=True,
                       capture_output=True)
    except subprocess.CalledProcessError as e:
        print(f"run.py: {sys.executable} cannot import torch and numpy; the Python "
              f"benchmarks need python3-torch and python3-numpy:\n"
              f"{e.stderr.decode(errors='replace').strip()}", file=sys.stderr)
        return 1
    failed = 0
    t0 = time.monotonic()
    for b in benches:
        print(flush=True)
        rc = subprocess.run([sys.executable, os.path.join(HERE, b)] +
                            (["--quick"] if quick else []), env=env).returncode
        if rc != 0:
            print(f"run.py: {b} failed (exit status {rc})", file=sys.stderr)
            failed = 1
    print(f"all Python benchmarks: {time.monotonic() - t0:.0f} s")
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
