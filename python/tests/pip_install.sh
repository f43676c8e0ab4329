#!/bin/sh
# pip_install.sh PYTHON BUILD_DIR TENSORD_BIN: `pip install
# --no-build-isolation ./python` into a temporary directory, linked with
# BUILD_DIR's libtensord.a, then imports tensord from there (away from the
# source and build trees) and round-trips a tensor through a tensord of its
# own. Run from the top of the source tree (ctest python-install).
set -eu
py=$1 build=$(cd "$2" && pwd) bin=$(cd "$(dirname "$3")" && pwd)/$(basename "$3")
tag=python
[ -n "${TDT_TAG_FILE:-}" ] && [ -s "$TDT_TAG_FILE" ] && tag=$(cat "$TDT_TAG_FILE")
tmp=$(mktemp -d "/tmp/tensord-test.$tag.XXXXXX")
pid=
cleanup() {
  if [ -n "$pid" ]; then
    kill -TERM "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  fi
  rm -rf "$tmp"
}
trap cleanup EXIT
fail() { echo "FAIL: $*"; exit 1; }

# pip builds in the directory it is given (setuptools' build/ and
# egg-info): a copy of ./python, so that suites running at once in other
# build trees never share one. TENSORD_SOURCE_DIR leads setup.py back to
# include/.
mkdir "$tmp/src"
cp -R python/setup.py python/pyproject.toml python/README.md python/tensord \
  "$tmp/src/"
rm -rf "$tmp/src/tensord/__pycache__" "$tmp"/src/tensord/*.so
echo "-- pip install --no-build-isolation --target $tmp/site ./python (a copy)"
TENSORD_SOURCE_DIR=$(pwd) TENSORD_BUILD_DIR=$build "$py" -m pip install \
  --no-build-isolation --no-deps --no-index --no-cache-dir \
  --target "$tmp/site" "$tmp/src" >"$tmp/pip.log" 2>&1 ||
  { cat "$tmp/pip.log"; fail "pip install"; }
ls "$tmp"/site/tensord/_tensord*.so >/dev/null || fail "no extension installed"
# Static: the installed module needs no libtensord.so.
if ldd "$tmp"/site/tensord/_tensord*.so | grep -q libtensord; then
  fail "the installed module loads libtensord.so"
fi

"$bin" --socket "$tmp/tensord.sock" --log-level info 2>"$tmp/tensord.log" &
pid=$!
echo "-- import tensord from $tmp/site, against tensord $pid"
cd "$tmp"
PYTHONPATH=$tmp/site "$py" - "$tmp" "$tag" <<'PY' || { cat "$tmp/tensord.log"; fail "smoke"; }
import os, sys, time
tmp, tag = sys.argv[1], sys.argv[2]
import tensord
assert tensord.__file__.startswith(tmp), tensord.__file__
sock = os.path.join(tmp, "tensord.sock")
for _ in range(1000):
    try:
        c = tensord.connect(sock)
        break
    except tensord.Error:
        time.sleep(0.01)
else:
    raise SystemExit("tensord did not answer within 10 s")
with c:
    with open(f"/tmp/tensord-test.{tag}.instances", "a") as f:
        f.write("%016x\n" % c.stat()["instance"])
    t = c.share(bytes(range(16)), key="smoke")
    u = c.lookup("smoke", timeout=0)
    assert u.storage_id == t.storage_id and bytes(memoryview(u)) == bytes(range(16))
    c.unpublish("smoke")
print("python-install: tensord", tensord.__version__, "from", os.path.dirname(tensord.__file__))
PY
