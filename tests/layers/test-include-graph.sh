#!/bin/sh
# test-include-graph.sh: include_graph.py catches what it is there to catch,
# on small trees made here: a floor that includes the one above it, a circle
# of 4 modules inside a floor, and a header name taken twice all fail; a
# circle of 3 passes. Exits 1 naming the case that went wrong.
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d) || exit 2
trap 'rm -rf "$tmp"' EXIT
status=0

# mod DIR NAME INCLUDES...: DIR/NAME.c including NAME.h, and NAME.h
# including each of INCLUDES (header names).
mod() {
  d=$1 n=$2
  shift 2
  mkdir -p "$tmp/$d"
  printf '#include "%s.h"\n' "$n" >"$tmp/$d/$n.c"
  : >"$tmp/$d/$n.h"
  for h in "$@"; do printf '#include "%s"\n' "$h" >>"$tmp/$d/$n.h"; done
}

# expect CASE WANT(0|1) DIR...: include_graph.py --max 3 on DIRs exits WANT.
expect() {
  what=$1 want=$2
  shift 2
  (cd "$tmp" && python3 "$here/include_graph.py" --max 3 "$@") >"$tmp/out" 2>&1
  got=$?
  if [ "$got" != "$want" ]; then
    echo "test-include-graph: $what: exit $got, wanted $want" >&2
    sed 's/^/  /' "$tmp/out" >&2
    status=1
  fi
  rm -rf "${tmp:?}"/a "${tmp:?}"/b
}

mod a reg
mod b conn reg.h ops.h
mod b ops conn.h
expect "a circle of 2 in the upper floor" 0 a b

mod a reg conn.h
mod b conn reg.h
expect "the lower floor including the upper" 1 a b

mod b w x.h
mod b x y.h
mod b y w.h
expect "a circle of 3" 0 b

mod b w x.h
mod b x y.h
mod b y z.h
mod b z w.h
expect "a circle of 4" 1 b

mod a events
mod b events
expect "two headers named events.h" 1 a b

[ $status = 0 ] && echo "test-include-graph: every case caught"
exit $status
