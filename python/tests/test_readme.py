"""README.md's Python example runs as written and prints what it says."""

import os
import re
import subprocess
import sys

from conftest import TOP


def readme_example():
    with open(os.path.join(TOP, "README.md")) as f:
        text = f.read()
    at = text.index("\n## In Python\n")
    start = text.index("\n```python\n", at) + len("\n```python\n")
    return text[start:text.index("\n```\n", start) + 1]


def test_readme_python_example(daemon, client):
    env = dict(os.environ, TENSORD_SOCKET=daemon)
    out = subprocess.run([sys.executable, "-c", readme_example()], env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert re.fullmatch(
        r"tensord\.Tensor\(float32\[1024, 1024\] stride \(1024, 1\) offset 0, "
        r"storage \d+, key 'batch/7'\) 1025\.5", first), first
    assert second == "(1022, 512) (1024, 2)"
    # It took the key: nothing is left.
    assert client.ls() == []
