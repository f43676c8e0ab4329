#!/bin/sh
# crash_cleanup.sh FUZZ_STATE_REPLAY CORPUS: fuzz_state_replay that crashes
# (TD_FUZZ_STATE_CRASH=1: SIGSEGV with its private directory made) fails,
# and leaves no tensord-fuzz-state.<pid> directory in /dev/shm or /tmp.
# Directories of processes still alive (another build's replay) are not
# judged.
set -u
[ $# -eq 2 ] || { echo "usage: crash_cleanup.sh FUZZ_STATE_REPLAY CORPUS" >&2; exit 2; }
dead_dirs() {
  for d in /dev/shm/tensord-fuzz-state.* /tmp/tensord-fuzz-state.*; do
    [ -e "$d" ] || continue
    pid=${d##*.}
    kill -0 "$pid" 2>/dev/null || echo "$d"
  done | sort
}
before=$(dead_dirs)
TD_FUZZ_STATE_CRASH=1 "$1" "$2" >/dev/null 2>&1
rc=$?
after=$(dead_dirs)
left=$(printf '%s\n' "$after" | grep -vxF -e "$before" | grep . || true)
[ -z "$before" ] && left=$after
status=0
if [ "$rc" = 0 ]; then
  echo "FAIL: fuzz_state_replay exited 0 after a crash"
  status=1
fi
if [ -n "$left" ]; then
  echo "FAIL: a crashed fuzz_state_replay left:" $left
  rm -rf $left
  status=1
fi
exit $status
