#!/bin/sh
# check-layers.sh: the include graph follows the layers of docs/design.md.
#   include/ (public API)  <- common/ <- proto/ <- client/, daemon/
#                             common/ <- cuda/ (the driver loader) <- client/, daemon/
# and the Python binding (python/tensord/) and tensorctl (client/tensorctl/)
# see include/ only, besides their own headers; libtensord (client/) never
# sees tensorctl's. client/ and daemon/ never see each other, and the
# daemon's engine (daemon/engine/) never sees libuv or its server
# (daemon/server/), and neither floor has a circle of more than 3 modules
# (include_graph.py). Exits 1, naming each include that crosses a layer,
# otherwise 0.
here=$(cd "$(dirname "$0")" && pwd)
top=${1:-$here/../..}
cd "$top" || exit 2
status=0

allowed() { # layer -> the layers its files may include from
  case $1 in
  include) echo "include" ;;
  common) echo "include common" ;;
  proto) echo "include common proto" ;;
  cuda) echo "include common cuda" ;;
  client) echo "include common proto cuda client" ;;
  daemon/engine) echo "include common proto cuda daemon/engine" ;;
  daemon/server) echo "include common proto cuda daemon/engine daemon/server" ;;
  client/tensorctl) echo "include client/tensorctl" ;;
  python/tensord) echo "include" ;;
  esac
}

owner() { # header name -> the layer that has it
  case "$1" in # generated from proto/*.proto in the build tree
  tensord.pb-c.h | handover.pb-c.h) echo proto; return ;;
  esac
  for l in include common proto cuda client client/tensorctl daemon/engine \
           daemon/server; do
    [ -f "$l/$1" ] && { echo "$l"; return; }
  done
  echo unknown
}

for layer in include common proto cuda client client/tensorctl daemon/engine \
             daemon/server python/tensord; do
  ok=$(allowed $layer)
  for f in "$layer"/*.[ch]; do
    [ -f "$f" ] || continue
    # Bindings name the public header as a system one (<tensord.h>), as a
    # program built against an installed libtensord does: there every
    # include counts that one of our layers has (system headers do not).
    if [ "$layer" = python/tensord ]; then
      incs=$(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*["<]\([^">]*\)[">].*/\1/p' "$f")
    else
      incs=$(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f")
    fi
    for h in $incs; do
      o=$(owner "$h")
      [ "$layer" = python/tensord ] && [ "$o" = unknown ] && continue
      case " $ok " in
      *" $o "*) ;;
      *) echo "check-layers: $f includes \"$h\" from $o/, outside its layers ($ok)" >&2
         status=1 ;;
      esac
    done
  done
done

closure() { # file -> every header of ours it includes, transitively
  todo=$1 seen=""
  while [ -n "$todo" ]; do
    set -- $todo; f=$1; shift; todo=$*
    case " $seen " in *" $f "*) continue ;; esac
    seen="$seen $f"
    for h in $(sed -n 's/^[[:space:]]*#[[:space:]]*include[[:space:]]*"\([^"]*\)".*/\1/p' "$f"); do
      o=$(owner "$h")
      [ -f "$o/$h" ] && todo="$todo $o/$h"
    done
  done
  echo "$seen"
}
# The engine: no libuv, even through another header.
for f in daemon/engine/*.[ch]; do
  for g in $(closure "$f"); do
    if grep -q '^[[:space:]]*#[[:space:]]*include[[:space:]]*<uv\.h>' "$g"; then
      echo "check-layers: $f reaches libuv through $g" >&2
      status=1
    fi
  done
done

# The daemon's floors, module by module (X.c with X.h): no circle of
# includes spans the two, none inside one has more than 3 modules, and no
# header name is taken twice. Prints each folder's size and its circles.
python3 "$here/include_graph.py" --max 3 daemon/engine daemon/server ||
  status=1

[ $status = 0 ] && echo "check-layers: every include stays within its layers"
exit $status
