#!/bin/sh
# test_check_clean.sh CHECK_CLEAN: tests/check-clean.sh, the suite's last
# word on leaks, finds what a daemon of this build leaves in /dev/shm: a
# storage's segment and a pooled one (tensord.<instance>-pool.*), with and
# without TD_CHECK_CLEAN_ALL. Works on a build directory and an instance of
# its own, so it judges nothing another test made.
set -u
[ $# -eq 1 ] || { echo "usage: test_check_clean.sh CHECK_CLEAN" >&2; exit 2; }
check=$1
dir=$(mktemp -d /tmp/tensord-checkclean.XXXXXX) || exit 1
mkdir -p "$dir/tests"
tag=cc$$
echo "$tag" >"$dir/tests/tdt-tag"
inst=$(printf 'ffff%012x' $$)
fail=0
cleanup() {
  rm -f /dev/shm/tensord."$inst".* /dev/shm/tensord."$inst"-pool.* \
    /tmp/tensord-test."$tag".instances
  rm -rf "$dir"
}
trap cleanup EXIT

# expect STATUS LEFTOVER ALL: check-clean.sh, with LEFTOVER in /dev/shm
# (none if empty) and TD_CHECK_CLEAN_ALL=ALL, exits STATUS.
expect() {
  want=$1 left=$2 all=$3
  echo "$inst" >/tmp/tensord-test."$tag".instances
  [ -n "$left" ] && : >"/dev/shm/$left"
  out=$(TD_CHECK_CLEAN_ALL=$all sh "$check" "$dir" 2>&1)
  got=$?
  [ -n "$left" ] && rm -f "/dev/shm/$left"
  if [ "$got" != "$want" ]; then
    echo "FAIL: with '${left:-nothing}' left (TD_CHECK_CLEAN_ALL=$all):" \
      "exit $got, not $want: $out"
    fail=1
  fi
}

expect 0 "" 0
expect 1 "tensord.$inst.7" 0
expect 1 "tensord.$inst-pool.3" 0
expect 1 "tensord.$inst-pool.3" 1
exit $fail
