#!/bin/sh
# run.sh BUILD_DIR [SECONDS] [--restart] [--upgrade]: runs the soak test for
# SECONDS (default 300) against a private tensord with --state-dir, on a
# socket every uid may use (soak runs some clients as other uids). A
# supervisor loop keeps the daemon up as systemd's Restart=on-failure would:
# whenever it dies of SIGKILL it is started again with the same socket and
# state dir; with --restart, soak SIGKILLs it every ~15 s. With --upgrade,
# soak runs $dir/upgrade (tensord --upgrade with the same options) every
# ~6 s under load; the old daemon exits 0 and the supervisor follows the new
# one by its pid (the end of a daemon it follows, not its child, counts as
# a SIGKILL: soak tells its own kills from others). Both may be given.
# Always stops the daemon, removes the state dir, and leaves no segment of
# any of its instances in /dev/shm. Exits with soak's status, or 1 if
# something had to be cleaned up after it or a daemon exited unexpectedly.
# $SOAK_OPTS adds options to soak; TDT_SEED and SOAK_CRIPPLE reach it
# through the environment (see soak --help).
set -u

usage() {
  echo "usage: tests/soak/run.sh BUILD_DIR [SECONDS] [--restart]" \
       "[--upgrade]" >&2
  exit 2
}
[ $# -ge 1 ] || usage
build=$(cd "$1" && pwd) || exit 2
shift
secs=300
restart=
upgrade=
for a in "$@"; do
  case $a in
  --restart) restart=--restart ;;
  --upgrade) upgrade=1 ;;
  '' | *[!0-9]*) usage ;;
  *) secs=$a ;;
  esac
done
daemon=$build/daemon/tensord
soak=$build/tests/soak/soak
for f in "$daemon" "$soak"; do
  if [ ! -x "$f" ]; then
    echo "run.sh: $f not built (configure with tests on, then build)" >&2
    exit 2
  fi
done
if [ "$(id -u)" != 0 ]; then
  echo "run.sh: not root: soak runs every client as uid $(id -u), without" \
       "the checks across uids" >&2
fi

# Other uids must reach the socket: the directory is 0755, the socket 0666.
dir=$(mktemp -d /tmp/tensord-soak.XXXXXX) || exit 2
chmod 0755 "$dir"
sock=$dir/tensord.sock
log=$dir/tensord.log
sup=
spid=
set -- --socket "$sock" --socket-mode 0666 --state-dir "$dir/state" \
  --log-level info

# soak runs this to upgrade live: the new daemon, its pid left for the
# supervisor in $dir/daemon.pid.new, logging where the first one does.
{
  echo '#!/bin/sh'
  echo "echo \$\$ >'$dir/daemon.pid.new'"
  echo "exec '$daemon' --upgrade $* 2>>'$log'"
} >"$dir/upgrade"
chmod 0755 "$dir/upgrade"

# Whether pid $1 is gone: no process, or a zombie nobody reaped yet (the
# daemons soak's upgrades start are soak's children).
gone() {
  st=$(sed 's/.*) //' "/proc/$1/stat" 2>/dev/null | cut -c1)
  [ -z "$st" ] || [ "$st" = Z ] || [ "$st" = X ]
}

# After an upgrade: follows the daemon that took over (the pid in
# $dir/daemon.pid.new, once the one before is gone) into $dir/daemon.pid,
# until one is gone and none newer serves. Returns at once when stopping.
follow() {
  while :; do
    cur=$(cat "$dir/daemon.pid")
    while ! gone "$cur"; do
      [ -e "$dir/stopping" ] && return
      sleep 0.05
    done
    next=$(cat "$dir/daemon.pid.new" 2>/dev/null)
    if [ -z "$next" ] || [ "$next" = "$cur" ] || gone "$next"; then
      return
    fi
    echo "$next" >"$dir/daemon.pid"
  done
}

# Starts tensord, and again whenever it dies of SIGKILL, until $dir/stopping
# exists. Appends each instance to $dir/instances (the daemon writes its
# segment prefix, /tensord.<instance>., first in $sock.instance before it
# listens).
supervise() {
  while :; do
    was=$(head -n 1 "$sock.instance" 2>/dev/null)
    "$daemon" "$@" 2>>"$log" &
    dpid=$!
    echo "$dpid" >"$dir/daemon.pid"
    i=0
    while [ $i -lt 100 ] && kill -0 "$dpid" 2>/dev/null; do
      now=$(head -n 1 "$sock.instance" 2>/dev/null)
      if [ -n "$now" ] && [ "$now" != "$was" ] && [ -S "$sock" ]; then
        echo "$now" >>"$dir/instances"
        break
      fi
      sleep 0.05
      i=$((i + 1))
    done
    wait "$dpid" 2>/dev/null # no "Killed" from the shell
    rc=$?
    [ -e "$dir/stopping" ] && exit 0
    if [ $rc -eq 0 ] && [ -n "$upgrade" ]; then
      next=$(cat "$dir/daemon.pid.new" 2>/dev/null)
      if [ -n "$next" ] && ! gone "$next"; then
        echo "$next" >"$dir/daemon.pid"
        follow # upgraded away: soak checks that the new one serves
        [ -e "$dir/stopping" ] && exit 0
        rc=137
      fi
    fi
    if [ $rc -ne 137 ]; then
      echo "run.sh: tensord (pid $dpid) exited with status $rc; not" \
           "restarting it" >&2
      exit 1
    fi
  done
}

stop() {
  status=$?
  trap - EXIT INT TERM
  if [ -n "$spid" ] && kill -0 "$spid" 2>/dev/null; then
    kill -KILL "$spid" 2>/dev/null # its clients die with it
    wait "$spid" 2>/dev/null
  fi
  touch "$dir/stopping"
  if [ -n "$sup" ]; then
    # SIGTERM whichever daemon runs (one may be starting), once each (a
    # second one would cut its shutdown short), until the supervisor is
    # gone; SIGKILL both after 10 s.
    i=0
    termed=
    while kill -0 "$sup" 2>/dev/null; do
      dpid=$(cat "$dir/daemon.pid" 2>/dev/null)
      if [ -n "$dpid" ] && [ "$dpid" != "$termed" ]; then
        kill -TERM "$dpid" 2>/dev/null
        termed=$dpid
      fi
      if [ $i -ge 100 ]; then
        echo "run.sh: tensord (pid $dpid) ignored SIGTERM for 10 s;" \
             "killing it" >&2
        kill -KILL "$dpid" "$sup" 2>/dev/null
        status=1
        break
      fi
      sleep 0.1
      i=$((i + 1))
    done
    wait "$sup" 2>/dev/null || status=1
  fi
  # The daemon unlinks what no key names when it stops; soak unpublished
  # every key, so nothing may be left. Remove what is, and say so.
  insts=$(cat "$dir/instances" "$sock.instance" 2>/dev/null |
    grep -o '[0-9a-f]\{16\}' | sort -u)
  for inst in $insts; do
    left=0
    for f in /dev/shm/tensord."$inst".*; do
      [ -e "$f" ] && left=$((left + 1))
    done
    if [ "$left" -gt 0 ]; then
      echo "run.sh: removing $left segment(s) of tensord instance $inst" \
           "left in /dev/shm" >&2
      rm -f /dev/shm/tensord."$inst".*
      status=1
    fi
  done
  if [ -s "$log" ]; then
    n=$(grep -c . "$log")
    echo "---- tensord's log: $n line(s); its warnings, errors and state" \
         "recoveries ----"
    grep -E ' (warn|error): |state: |listening on' "$log" | tail -n 60
  fi
  rm -rf "$dir"
  exit $status
}
trap stop EXIT
trap 'exit 130' INT TERM

supervise "$@" &
sup=$!
i=0
while [ ! -s "$dir/instances" ]; do
  if ! kill -0 "$sup" 2>/dev/null || [ $i -ge 100 ]; then
    echo "run.sh: tensord did not start" >&2
    exit 1
  fi
  sleep 0.1
  i=$((i + 1))
done

echo "tensord $("$daemon" --version | cut -d' ' -f2) on $sock, state in" \
     "$dir/state; $(nproc) CPU(s), /dev/shm" \
     "$(df -h -P /dev/shm | awk 'NR == 2 { print $2 }')"
# shellcheck disable=SC2086 # SOAK_OPTS is split on purpose
"$soak" --seconds "$secs" $restart ${upgrade:+--upgrade "$dir/upgrade"} \
  --instances-file "$dir/instances" ${SOAK_OPTS:-} "$sock" &
spid=$!
wait "$spid"
status=$?
spid=
exit $status
