#!/bin/sh
# run.sh BUILD_DIR: runs every benchmark against a private tensord on a
# temporary socket and prints their tables; always stops the daemon and
# leaves nothing of it in /dev/shm. Exits non-zero if a benchmark failed.
# Runs bench_handoff, bench_ops and bench_rss, then any other bench_* program
# built there. TD_BENCH_SCALE=0.2 shortens every run (a smoke test);
# TD_BENCH_ONLY="bench_ops ..." runs only those. bench_cuda_attach (built
# only with TENSORD_CUDA, else skipped with a message) starts a tensord of
# its own, whose driver it chooses (a GPU's, else the driver's test double).
set -u

build=${1:?usage: tests/bench/run.sh BUILD_DIR}
build=$(cd "$build" && pwd) || exit 2
daemon=$build/daemon/tensord
benches=${TD_BENCH_ONLY:-}
if [ -z "$benches" ]; then
  benches="bench_handoff bench_ops bench_rss"
  for f in "$build"/tests/bench/bench_*; do
    b=${f##*/}
    case " $benches " in *" $b "*) continue ;; esac
    [ -f "$f" ] && [ -x "$f" ] && benches="$benches $b"
  done
fi
# bench_cuda_attach is built only with TENSORD_CUDA (the toolkit's headers).
if [ ! -x "$build/tests/bench/bench_cuda_attach" ] &&
   grep -q '^TENSORD_CUDA:BOOL=OFF' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "bench_cuda_attach: skipped (built with TENSORD_CUDA=OFF: no CUDA" \
       "toolkit headers)"
  kept=
  for b in $benches; do
    [ "$b" = bench_cuda_attach ] || kept="$kept $b"
  done
  benches=$kept
  [ -n "$benches" ] || exit 0
fi
for b in $benches; do
  if [ ! -x "$build/tests/bench/$b" ]; then
    echo "run.sh: $build/tests/bench/$b not built (configure with tests on," \
         "then build)" >&2
    exit 2
  fi
done
[ -x "$daemon" ] || { echo "run.sh: $daemon not built" >&2; exit 2; }

dir=$(mktemp -d /tmp/tensord-bench.XXXXXX) || exit 2
sock=$dir/tensord.sock
pid=
bpid=

stop() {
  status=$?
  trap - EXIT INT TERM
  if [ -n "$bpid" ] && kill -0 "$bpid" 2>/dev/null; then
    kill -TERM "$bpid" 2>/dev/null # its children die with it
    wait "$bpid" 2>/dev/null
    rm -f /dev/shm/tdbench."$bpid".*
  fi
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    i=0
    while kill -0 "$pid" 2>/dev/null && [ $i -lt 100 ]; do
      sleep 0.1
      i=$((i + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
      echo "run.sh: tensord (pid $pid) ignored SIGTERM for 10 s; killing it" >&2
      kill -KILL "$pid" 2>/dev/null
      status=1
    fi
    wait "$pid" 2>/dev/null
  fi
  # tensord unlinks its segments when it stops; remove any a crash left.
  if [ -s "$dir/instance" ]; then
    inst=$(cat "$dir/instance")
    left=$(ls /dev/shm 2>/dev/null | grep -c "^tensord\.$inst\." || true)
    if [ "$left" -gt 0 ]; then
      echo "run.sh: removing $left segment(s) tensord left in /dev/shm" >&2
      rm -f /dev/shm/tensord."$inst".*
      status=1
    fi
  fi
  if [ -s "$dir/tensord.log" ]; then
    echo "---- tensord's log (warnings and errors) ----" >&2
    cat "$dir/tensord.log" >&2
  fi
  rm -rf "$dir"
  exit $status
}
trap stop EXIT
trap 'exit 130' INT TERM

# Capacity: all of /dev/shm, so that only /dev/shm itself limits the 1 GiB
# handoffs (the default is half of it).
cap=$(df -P -k /dev/shm 2>/dev/null | awk 'NR == 2 { print $2 "K" }')
"$daemon" --socket "$sock" --log-level warn ${cap:+--capacity "$cap"} \
  2>"$dir/tensord.log" &
pid=$!
i=0
while [ ! -S "$sock" ]; do
  if ! kill -0 "$pid" 2>/dev/null || [ $i -ge 100 ]; then
    echo "run.sh: tensord did not start" >&2
    exit 1
  fi
  sleep 0.1
  i=$((i + 1))
done

echo "tensord $("$daemon" --version | cut -d' ' -f2) (pid $pid) on $sock;" \
     "$(nproc) CPU(s), /dev/shm $(df -h -P /dev/shm | awk 'NR == 2 { print $2 }')"
export TD_BENCH_INSTANCE_FILE="$dir/instance"
failed=0
t0=$(date +%s)
for b in $benches; do
  start=$(date +%s)
  "$build/tests/bench/$b" "$sock" &
  bpid=$!
  if ! wait $bpid; then
    echo "run.sh: $b failed" >&2
    failed=1
  fi
  # bench_rss's baseline segments, should it have died before unlinking them.
  rm -f /dev/shm/tdbench."$bpid".*
  bpid=
  echo "  ($b: $(( $(date +%s) - start )) s)"
done
echo "all benchmarks: $(( $(date +%s) - t0 )) s"
exit $failed
