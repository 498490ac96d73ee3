#!/usr/bin/env bash
# Run tests several times in a row with every core kept busy (one spinning process per
# core), on each database: races that hide on an idle machine show here.
#
#   scripts/under-load.sh                      # 3 runs of the shutdown/takeover modules
#   RUNS=5 DBWORKER_TEST_DATABASES=postgres scripts/under-load.sh tests/test_crash.py
#
# Prints pytest's summary line of every run (its whole output stays in
# $TMPDIR/dbworker-under-load-<db>-<run>.log); exits non-zero if any run failed.
set -uo pipefail
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-3}
DATABASES=${DBWORKER_TEST_DATABASES:-sqlite postgres mysql}
if [ $# -eq 0 ]; then
  set -- tests/test_crash.py tests/test_runworkers.py tests/test_faults.py tests/test_stress.py
fi

spinners=()
for _ in $(seq "$(nproc)"); do
  "$PY" -c 'while True: pass' & spinners+=($!)
done
trap 'kill "${spinners[@]}" 2>/dev/null' EXIT

status=0
summary=()
for db in $DATABASES; do
  for run in $(seq "$RUNS"); do
    started=$(date +%s)
    log=${TMPDIR:-/tmp}/dbworker-under-load-$db-$run.log
    DBWORKER_TEST_DB=$db "$PY" -m pytest -q -p no:cacheprovider "$@" >"$log" 2>&1
    rc=$?
    [ "$rc" -ne 0 ] && status=1
    summary+=("$db run $run/$RUNS ($(( $(date +%s) - started ))s, exit $rc): $(tail -1 "$log")")
    echo "${summary[-1]}"
  done
done
echo "=================== under load ($(nproc) spinning processes) ==================="
printf '%s\n' "${summary[@]}"
exit $status
