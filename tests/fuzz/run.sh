#!/bin/sh
# run.sh FUZZ_REQUEST SECONDS [libFuzzer args...]: runs the fuzz target for
# SECONDS from the committed seeds and regressions (`make fuzz` calls it).
# New inputs go to a scratch corpus, never into tests/fuzz/corpus. Exits 1
# if libFuzzer found a crash, leaving the crashing inputs in a kept directory
# whose path and bytes it prints; copy each into tests/fuzz/regressions/ with
# its fix.
set -u
bin=$1
secs=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/tensord-fuzz.XXXXXX")
mkdir "$scratch/corpus" "$scratch/artifacts"

"$bin" -max_total_time="$secs" -max_len=4096 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$scratch/artifacts/" "$@" \
  "$scratch/corpus" "$here/corpus" "$here/regressions" &
pid=$!
trap 'kill $pid 2>/dev/null' INT TERM
wait $pid
rc=$?
# A crash can leave the segments of the daemon it ran (named
# tensord.f022<pid>..., see fuzz_request.c) in /dev/shm.
rm -f /dev/shm/tensord.f022$(printf %06x $((pid & 0xffffff)))* 2>/dev/null

found=$(ls "$scratch/artifacts")
if [ $rc -eq 0 ] && [ -z "$found" ]; then
  echo "fuzz: no crash in ${secs}s ($(ls "$scratch/corpus" | wc -l) new inputs)"
  rm -rf "$scratch"
  exit 0
fi
echo "fuzz: libFuzzer exited $rc; crashing inputs kept in $scratch/artifacts:" >&2
for f in "$scratch"/artifacts/*; do
  [ -f "$f" ] || continue
  echo "== $f" >&2
  od -A d -t x1 "$f" | head -40 >&2
done
echo "fuzz: replay one with: TD_FUZZ_VERBOSE=1 TD_FUZZ_LOG=debug $bin FILE;" \
  "once fixed, add it to tests/fuzz/regressions/ (fuzz_replay runs them)" >&2
rm -rf "$scratch/corpus"
exit 1
