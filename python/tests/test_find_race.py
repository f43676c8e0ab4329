"""find() against the last release of a storage on a thread without the GIL.

A DLPack deleter (torch frees tensors from C++, without the GIL) that drops
a storage's last reference used to drop the count to zero before taking the
registry's lock, so a find() in that window took a reference from zero and
handed out a Tensor of a store the deleter then freed: a use-after-free (a
segfault in numpy reading the unmapped pages, or glibc's "double free").
_find_race.py runs that race a few hundred times in a process of its own, so
that a crash fails this test rather than the suite. Under AddressSanitizer
(make asan-python) any use of a freed store is reported and fails it too.
"""

import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_find_never_revives_a_store_being_freed(daemon, client):
    p = subprocess.run(
        [sys.executable, os.path.join(HERE, "_find_race.py"), daemon, "300",
         "2000"],
        capture_output=True, text=True, timeout=300,
    )
    assert p.returncode == 0, "rc %d\n%s%s" % (p.returncode, p.stdout, p.stderr)
    assert p.stdout.startswith("rounds 300 hits "), p.stdout
    assert "ERROR: AddressSanitizer" not in p.stderr, p.stderr
