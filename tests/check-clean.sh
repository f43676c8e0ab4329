#!/bin/sh
# After the suite: no tensord started by the tests still runs, and no segment
# of tensord is left in /dev/shm. Exits 1, naming what is left, otherwise.
status=0
procs=$(pgrep -f 'tests/tmp|/tensord-test\.' 2>/dev/null | while read -r p; do
  [ "$(cat /proc/$p/comm 2>/dev/null)" = tensord ] && echo "$p"; done)
if [ -n "$procs" ]; then
  echo "check-clean: tensord started by the tests still running: pid(s)" $procs >&2
  status=1
fi
left=$(ls /dev/shm 2>/dev/null | grep '^tensord\.' || true)
if [ -n "$left" ]; then
  if pgrep -x tensord >/dev/null 2>&1; then
    echo "check-clean: a tensord not started by the tests runs; not judging /dev/shm"
  else
    echo "check-clean: segments left in /dev/shm:" $left >&2
    status=1
  fi
fi
[ $status = 0 ] && echo "check-clean: /dev/shm clean, no tensord left running"
exit $status
