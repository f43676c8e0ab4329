#!/bin/sh
# leakcheck.sh BUILD_DIR: proves that the integration tests catch a daemon
# that leaks. BUILD_DIR is configured with -DTD_TEST_LEAK=ON: its tensord
# never unlinks a segment. Runs the suites that check each daemon only when
# their tests end (core, views, badinput, keys, cli) and succeeds only if
# every one of them goes red and the check the harness makes as each test
# ends (tdt_stop) failed at least one test, naming the tests that failed. The
# harness removes the leaked segments; tests/check-clean.sh confirms it.
set -u
[ $# -eq 1 ] || { echo "usage: tests/leakcheck.sh BUILD_DIR" >&2; exit 2; }
build=$1
if ! grep -q '^TD_TEST_LEAK:BOOL=ON' "$build/CMakeCache.txt" 2>/dev/null; then
  echo "leakcheck: $build is not configured with -DTD_TEST_LEAK=ON" >&2
  exit 2
fi
suites="test_core test_views test_badinput test_keys test_cli"
regex="^($(echo $suites | tr ' ' '|'))\$"
out=$build/leakcheck.log
ctest --test-dir "$build" -L integration -R "$regex" --output-on-failure \
  -j 2 >"$out" 2>&1
rc=$?
status=0
echo "leakcheck: tests that failed against a tensord that leaks every segment"
# Criterion prints a test's failed assertions just before its [FAIL] line;
# these are tdt_stopped's.
awk '/segment\(s\) of this tensord left in|tensord exited with|tensord left its socket|the test leaked -?[0-9]+ fd/ { end = 1 }
     /^\[FAIL\] / { name = $2; sub(/:$/, "", name);
                     print "  " name (end ? "  <- by the check at its end" : "")
                     end = 0 }' "$out" | sort >"$out.failed"
cat "$out.failed"
caught=$(grep -c 'by the check at its end' "$out.failed")
echo "leakcheck: $(grep -c . "$out.failed") failed, $caught of them by the" \
  "check at the end of the test"
if [ "$caught" -eq 0 ]; then
  echo "leakcheck: FAIL: no test was failed by the check at its end" >&2
  status=1
fi
if [ $rc -eq 0 ]; then
  echo "leakcheck: FAIL: the suites passed against a leaking tensord" >&2
  status=1
fi
for s in $suites; do
  if ! grep -Eq "^[[:space:]]*[0-9]+ - $s \(Failed\)" "$out"; then
    echo "leakcheck: FAIL: $s passed against a leaking tensord" >&2
    status=1
  fi
done
tests/check-clean.sh "$build" || status=1
[ $status = 0 ] && echo "leakcheck: PASS: every suite went red (log: $out)"
exit $status
