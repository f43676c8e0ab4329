#!/bin/sh
# test_exports.sh: libtensord.so exports exactly the functions of tensord.h.
# Usage: test_exports.sh LIBTENSORD_SO TENSORD_H CC
# Fails if the library exports a name that is not td_<lower-case> (protobuf-c
# code, td__ internals), a td_ name the header does not declare, or if the
# header declares a function the library does not export.
set -eu
lib=$1 header=$2 cc=$3
tmp=$(mktemp -d "${TMPDIR:-/tmp}/td-exports.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

nm -D --defined-only "$lib" | awk '{ print $NF }' | sort -u >"$tmp/exported"
[ -s "$tmp/exported" ] || { echo "FAIL: $lib exports nothing"; exit 1; }

# Functions the header declares: preprocess it (which drops the comments) and
# take every td_ name followed by '('. A typedef of a function pointer, as
# (*td_list_cb)(...), has ')' before its '(' and is not taken.
"$cc" -E -P -x c "$header" | grep -oE '\btd_[a-z0-9_]*[[:space:]]*\(' |
  sed 's/[[:space:]]*($//' | sort -u >"$tmp/declared"
[ -s "$tmp/declared" ] || { echo "FAIL: no function found in $header"; exit 1; }

status=0
bad=$(grep -vE '^td_[a-z]' "$tmp/exported" || true)
if [ -n "$bad" ]; then
  echo "FAIL: $lib exports $(echo "$bad" | wc -l) names outside td_[a-z]*" \
       "(protobuf-c code or td__ internals), e.g.:"
  echo "$bad" | head -20 | sed 's/^/  /'
  status=1
fi
extra=$(comm -23 "$tmp/exported" "$tmp/declared" | grep -E '^td_[a-z]' || true)
if [ -n "$extra" ]; then
  echo "FAIL: $lib exports td_ names that $header does not declare:"
  echo "$extra" | sed 's/^/  /'
  status=1
fi
missing=$(comm -13 "$tmp/exported" "$tmp/declared")
if [ -n "$missing" ]; then
  echo "FAIL: $header declares functions that $lib does not export:"
  echo "$missing" | sed 's/^/  /'
  status=1
fi
[ $status -eq 0 ] &&
  echo "ok: $(wc -l <"$tmp/exported") functions exported, all of tensord.h"
exit $status
