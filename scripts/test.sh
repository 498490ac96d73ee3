#!/usr/bin/env bash
# Run the whole suite once per database: SQLite always, PostgreSQL and MariaDB/MySQL when
# reachable. With CI=true an unreachable server is a failure, never a skip.
set -uo pipefail
PY=${PY:-.venv/bin/python}
DATABASES=${DBWORKER_TEST_DATABASES:-sqlite postgres mysql}
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

for db in $DATABASES; do
  if [ "$db" != sqlite ] && ! reachable "$db"; then
    if [ "${CI:-}" = "true" ]; then
      echo "FAIL: $db is unreachable and CI=true"; status=1; summary+=("$db: UNREACHABLE (failure)")
    else
      echo "NOT RUN: $db is unreachable (set CI=true to make this a failure)"; summary+=("$db: not run (unreachable)")
    fi
    continue
  fi
  echo "=================== tests on $db ==================="
  DBWORKER_TEST_DB=$db "$PY" -m pytest "$@"
  rc=$?
  [ $rc -ne 0 ] && status=1
  summary+=("$db: pytest exit $rc")
done
echo "=================== summary ==================="
printf '%s\n' "${summary[@]}"
exit $status
