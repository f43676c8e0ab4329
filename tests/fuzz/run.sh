#!/bin/sh
# run.sh TARGET SECONDS [libFuzzer args...]: runs a fuzz target (fuzz_request
# or fuzz_state, by the name of its binary) for SECONDS from its committed
# seeds and regressions (`make fuzz` calls it for each). New inputs go to a
# scratch corpus, never into the committed ones. Exits 1 if libFuzzer found
# a crash, leaving the crashing inputs in a kept directory whose path and
# bytes it prints; copy each into the target's regressions with its fix.
set -u
bin=$1
secs=$2
shift 2
here=$(cd "$(dirname "$0")" && pwd)
case $(basename "$bin") in
fuzz_safetensors*)
  mkdir -p "$here/safetensors_regressions"
  seeds="$here/safetensors_corpus $here/safetensors_regressions"
  replay=fuzz_safetensors_replay
  regressions=tests/fuzz/safetensors_regressions ;;
fuzz_state*)
  seeds="$here/state_corpus $here/state_regressions"
  replay=fuzz_state_replay
  regressions=tests/fuzz/state_regressions ;;
*)
  seeds="$here/corpus $here/regressions"
  replay=fuzz_replay
  regressions=tests/fuzz/regressions ;;
esac
scratch=$(mktemp -d "${TMPDIR:-/tmp}/tensord-fuzz.XXXXXX")
mkdir "$scratch/corpus" "$scratch/artifacts"

# shellcheck disable=SC2086 # $seeds is a list of directories
"$bin" -max_total_time="$secs" -max_len=4096 -timeout=10 \
  -print_final_stats=1 -artifact_prefix="$scratch/artifacts/" "$@" \
  "$scratch/corpus" $seeds &
pid=$!
trap 'kill $pid 2>/dev/null' INT TERM
wait $pid
rc=$?
# A crash can leave what the target made behind: fuzz_request's daemon's
# segments (named tensord.f022<pid>..., see fuzz_request.c), fuzz_state's
# private directory (see fuzz_state.c).
rm -f /dev/shm/tensord.f022$(printf %06x $((pid & 0xffffff)))* 2>/dev/null
rm -rf /dev/shm/tensord-fuzz-state.$pid /tmp/tensord-fuzz-state.$pid

found=$(ls "$scratch/artifacts")
if [ $rc -eq 0 ] && [ -z "$found" ]; then
  echo "fuzz: $(basename "$bin"): no crash in ${secs}s" \
    "($(ls "$scratch/corpus" | wc -l) new inputs)"
  rm -rf "$scratch"
  exit 0
fi
echo "fuzz: libFuzzer exited $rc; crashing inputs kept in $scratch/artifacts:" >&2
for f in "$scratch"/artifacts/*; do
  [ -f "$f" ] || continue
  echo "== $f" >&2
  od -A d -t x1 "$f" | head -40 >&2
done
echo "fuzz: replay one with: TD_FUZZ_VERBOSE=1 TD_FUZZ_LOG=debug $bin FILE" \
  "(or build/tests/fuzz/$replay FILE); once fixed, add it to $regressions/" \
  "(ctest replays them)" >&2
rm -rf "$scratch/corpus"
exit 1
