#!/bin/sh
# check-clean.sh BUILD_DIR: after the suite, no tensord started by BUILD_DIR's
# tests still runs and no segment of one is left in /dev/shm. Exits 1,
# naming what is left, otherwise.
#
# Several builds may run their suites on one machine at once, so only this
# build's daemons are judged: the harness puts their directories under
# /tmp/tensord-test.<tag>.* and records each instance they ran in
# /tmp/tensord-test.<tag>.instances, where <tag> is BUILD_DIR's (written to
# BUILD_DIR/tests/tdt-tag at configure time). With TD_CHECK_CLEAN_ALL=1 (CI,
# where nothing else runs) any test tensord and any tensord segment counts.
usage() {
  echo "usage: tests/check-clean.sh BUILD_DIR" >&2
  exit 2
}
[ $# -eq 1 ] || usage
if ! tag=$(cat "$1/tests/tdt-tag" 2>/dev/null) || [ -z "$tag" ]; then
  echo "check-clean: $1/tests/tdt-tag missing: configure $1 with tests" >&2
  exit 2
fi
all=${TD_CHECK_CLEAN_ALL:-0}
instances=/tmp/tensord-test.$tag.instances
status=0

if [ "$all" = 1 ]; then
  pattern='/tensord-test\.'
else
  pattern="/tensord-test\\.$tag\\."
fi
procs=$(pgrep -f "$pattern" 2>/dev/null | while read -r p; do
  [ "$(cat /proc/"$p"/comm 2>/dev/null)" = tensord ] && echo "$p"; done)
if [ -n "$procs" ]; then
  echo "check-clean: tensord started by the tests still running: pid(s)" \
    $procs >&2
  status=1
fi

left=
if [ -f "$instances" ]; then
  for inst in $(sort -u "$instances"); do
    # Its storages' segments and its recycling pool's.
    for f in /dev/shm/tensord."$inst".* /dev/shm/tensord."$inst"-pool.*; do
      [ -e "$f" ] && left="$left ${f#/dev/shm/}"
    done
  done
fi
if [ "$all" = 1 ]; then
  left=$(ls /dev/shm 2>/dev/null | grep '^tensord\.' || true)
fi
if [ -n "$left" ]; then
  echo "check-clean: segments left in /dev/shm:" $left >&2
  status=1
fi

if [ $status = 0 ]; then
  # Judged: the next run starts a fresh record.
  rm -f "$instances"
  echo "check-clean: /dev/shm clean, no tensord left running ($1)"
fi
exit $status
