#!/usr/bin/env bash
# Run the whole suite once per database -- SQLite always, PostgreSQL and MariaDB/MySQL when
# reachable -- and SQLite once more on the other supported Python and Django
# (scripts/test-combos.sh), each suite a "lane" of its own, several lanes at once.
# With CI=true an unreachable server is a failure, never a skip.
#
#   scripts/test.sh                                 # every lane, one after another
#   scripts/test.sh -q tests/test_smoke.py          # arguments go to every lane's pytest
#   DBWORKER_TEST_LANES=3 scripts/test.sh           # 3 lanes at a time (a bigger machine)
#   DBWORKER_TEST_DATABASES=postgres DBWORKER_TEST_WITH_COMBOS=0 scripts/test.sh
#
# DBWORKER_TEST_LANES   how many lanes run at once (default 1: one after another, output live)
# DBWORKER_TEST_DATABASES  which databases (default "sqlite postgres mysql")
# DBWORKER_TEST_WITH_COMBOS  0: leave out the Python/Django combos lane (default 1)
#
# Running lanes side by side is safe: every run has test databases of its own (named after
# its pid, tests/settings.py; DBWORKER_TEST_RUN_ID, when set, gets the lane's name added),
# each server is stopped and started only by its own database's suite (tests/test_outage.py),
# PgBouncer and the failover clusters are used by the PostgreSQL lane alone, namespace hosts
# take a subnet each under a lock (tests/hosts.py), and the release build works on a copy.
#
# Why one at a time by default (measured on the 2-core CI machine). Unloaded, the suites
# take about: PostgreSQL 900 s, MariaDB 735 s, SQLite 640 s, combos 475 s, and the whole
# run in a row 2,824 s (stop 42's CI). Three lanes at once did not shorten it there: the
# same run took 3,012 s, every lane stretched about 3 times (PostgreSQL 2,732 s, MariaDB
# 2,555 s, SQLite 1,923 s), because the suites are mostly CPU -- spawned children that
# import Django, spinners of the under-load tests -- not waiting. Stretched that far, the
# chaos tests' children were killed faster than a loaded machine could start them, and two
# of them timed out. Lanes side by side are for a machine with cores to spare.
# A lane's output goes to a log file while it runs (one line says when each lane starts
# and ends); when all have ended each log is printed whole, in a fixed order (sqlite,
# postgres, mysql, combos), then the summary. The exit status is non-zero if any lane
# failed. Ctrl-C (or SIGTERM) interrupts every lane's pytest, which stops its workers.
set -uo pipefail
PY=${PY:-.venv/bin/python}
DATABASES=${DBWORKER_TEST_DATABASES:-sqlite postgres mysql}
LANES=${DBWORKER_TEST_LANES:-1}
WITH_COMBOS=${DBWORKER_TEST_WITH_COMBOS:-1}
HERE=$(dirname "$0")
case $LANES in ''|*[!0-9]*|0) echo "DBWORKER_TEST_LANES=$LANES: give a number >= 1" >&2; exit 2;; esac
status=0
summary=()

reachable() {
  "$PY" - "$1" <<'PYEOF'
import os, socket, sys
from urllib.parse import urlsplit
db = sys.argv[1]
url = {"postgres": os.environ.get("DBWORKER_TEST_POSTGRES_URL", "postgresql://root@127.0.0.1:5432/test"),
       "mysql": os.environ.get("DBWORKER_TEST_MYSQL_URL", "mysql://root@127.0.0.1:3306/test")}[db]
parts = urlsplit(url)
try:
    socket.create_connection((parts.hostname, parts.port or {"postgres": 5432, "mysql": 3306}[db]), timeout=3).close()
except OSError as exc:
    print(f"{db}: {parts.hostname}:{parts.port} unreachable ({exc})")
    sys.exit(1)
PYEOF
}

# The lanes to run, in the order their logs are printed.
order=()
for db in $DATABASES; do
  case $db in
    sqlite|postgres|mysql) ;;
    *) echo "FAIL: DBWORKER_TEST_DATABASES names $db: use sqlite, postgres or mysql"
       status=1; summary+=("$db: UNKNOWN (failure)"); continue;;
  esac
  if [ "$db" != sqlite ] && ! reachable "$db"; then
    if [ "${CI:-}" = "true" ]; then
      echo "FAIL: $db is unreachable and CI=true"; status=1; summary+=("$db: UNREACHABLE (failure)")
    else
      echo "NOT RUN: $db is unreachable (set CI=true to make this a failure)"; summary+=("$db: not run (unreachable)")
    fi
    continue
  fi
  order+=("$db")
done
[ "$WITH_COMBOS" != 0 ] && order+=(combos)

# One lane, its output on stdout; a subshell, so what it exports stays in it.
lane() (
  name=$1; shift
  if [ -n "${DBWORKER_TEST_RUN_ID:-}" ]; then  # one id for every lane would be one SQLite file
    export DBWORKER_TEST_RUN_ID="${DBWORKER_TEST_RUN_ID}_$name"
  fi
  if [ "$name" = combos ]; then
    "$HERE/test-combos.sh" "$@"
  else
    echo "=================== tests on $name ==================="
    # The slowest tests of each lane, so every CI log says where its time went.
    DBWORKER_TEST_DB=$name "$PY" -m pytest --durations=25 "$@"
  fi
)

# Side by side, longest first (the usual durations, see above), so the short ones fill in
# at the end; one at a time, in the order given, as before.
start_order=()
if [ "$LANES" -eq 1 ]; then
  start_order=("${order[@]}")
else
  for name in postgres mysql sqlite combos; do
    for wanted in "${order[@]}"; do [ "$wanted" = "$name" ] && start_order+=("$name"); done
  done
fi

started=$(date +%s)
elapsed() { echo $(( $(date +%s) - started )); }
rcs=()      # rcs[i], took[i]: lane start_order[i]'s exit status and seconds
took=()

if [ "$LANES" -eq 1 ]; then
  for i in "${!start_order[@]}"; do
    t0=$(date +%s)
    lane "${start_order[$i]}" "$@"
    rcs[i]=$?; took[i]=$(( $(date +%s) - t0 ))
  done
else
  logs=$(mktemp -d "${TMPDIR:-/tmp}/dbworker-lanes.XXXXXX") || exit 1
  # Job control: each lane in a process group of its own, which also keeps SIGINT from being
  # ignored in it (as it is for background commands without job control), so an interrupt
  # reaches pytest as KeyboardInterrupt and its fixtures stop the workers it started.
  set -m
  pids=()    # pids[i]: lane i's process (and process group); "" once it has ended
  t0s=()
  interrupt() {  # stop the lanes, then show how far each had come
    trap - INT TERM
    echo "interrupted: stopping the lanes" >&2
    for pid in "${pids[@]}"; do [ -n "$pid" ] && kill -INT -- "-$pid" 2>/dev/null; done
    wait
    for i in "${!pids[@]}"; do
      echo "################### lane: ${start_order[$i]} (interrupted) ###################"
      cat "$logs/$i.log"
    done
    rm -rf "$logs"
    exit 130
  }
  trap interrupt INT TERM
  next=0; running=0
  while [ "$next" -lt "${#start_order[@]}" ] || [ "$running" -gt 0 ]; do
    while [ "$running" -lt "$LANES" ] && [ "$next" -lt "${#start_order[@]}" ]; do
      lane "${start_order[$next]}" "$@" >"$logs/$next.log" 2>&1 </dev/null &
      pids[next]=$!; t0s[next]=$(date +%s)
      printf '[%5ss] %s: started\n' "$(elapsed)" "${start_order[$next]}"
      next=$((next + 1)); running=$((running + 1))
    done
    # Polled rather than `wait -n` (bash 4.3; which lane ended needs 5.1's -p): any bash
    # does, and a second is nothing against lanes of minutes.
    sleep 1
    for i in "${!pids[@]}"; do
      pid=${pids[$i]}
      if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
        wait "$pid"; rcs[i]=$?; took[i]=$(( $(date +%s) - t0s[i] ))
        pids[i]=""; running=$((running - 1))
        printf '[%5ss] %s: ended, exit %s (%ss)\n' "$(elapsed)" "${start_order[$i]}" "${rcs[$i]}" "${took[$i]}"
      fi
    done
  done
  trap - INT TERM
  set +m
  for name in "${order[@]}"; do
    for i in "${!start_order[@]}"; do
      [ "${start_order[$i]}" = "$name" ] || continue
      echo "################### lane: $name (exit ${rcs[$i]}, ${took[$i]}s) ###################"
      cat "$logs/$i.log"
    done
  done
  rm -rf "$logs"
fi

for name in "${order[@]}"; do
  for i in "${!start_order[@]}"; do
    [ "${start_order[$i]}" = "$name" ] || continue
    [ "${rcs[$i]}" -ne 0 ] && status=1
    if [ "$name" = combos ]; then
      summary+=("combos (scripts/test-combos.sh): exit ${rcs[$i]} (${took[$i]}s)")
    else
      summary+=("$name: pytest exit ${rcs[$i]} (${took[$i]}s)")
    fi
  done
done
echo "=================== summary ($(elapsed)s, ${LANES} lane(s) at a time) ==================="
printf '%s\n' "${summary[@]}"
exit $status
