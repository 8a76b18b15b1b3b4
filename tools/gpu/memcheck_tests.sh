#!/usr/bin/env bash
# compute-sanitizer memcheck over pytest tests, one process per test (two tests in one
# sanitized process crashed at the second, 2026-11-22, while each alone reported 0
# errors), XLA allocating each buffer on its own so that overruns show.
#   bash tools/gpu/memcheck_tests.sh LOGDIR TEST...   (JQ_SANITIZER_TIMEOUT: seconds per test)
set -u
logdir=$1; shift; mkdir -p "$logdir"
PY=${PY:-python3}
for t in "$@"; do
  log="$logdir/memcheck_${t##*::}.txt"; log=${log//[\[\]]/_}
  XLA_PYTHON_CLIENT_ALLOCATOR=platform timeout "${JQ_SANITIZER_TIMEOUT:-240}" \
    compute-sanitizer --tool memcheck --error-exitcode 9 \
    $PY -m pytest -q -p no:cacheprovider "$t" > "$log" 2>&1
  echo "compute-sanitizer memcheck $t rc=$?"
  grep -E "passed|failed|ERROR SUMMARY" "$log" | tail -n 3
done
