#!/usr/bin/env bash
# Make sure the local PostgreSQL and MariaDB the tests use are up, starting them when
# they are installed here and down. Tests decide what an unreachable server means
# (a skip locally, a failure with CI=true).
set -uo pipefail
up() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }
wait_for() { for _ in $(seq 1 30); do up "$1" && return 0; sleep 1; done; return 1; }

if ! up 5432 && command -v pg_ctlcluster >/dev/null 2>&1; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start || true
  wait_for 5432 || echo "PostgreSQL did not come up"
fi
if ! up 3306 && [ -x /usr/sbin/mariadbd ]; then
  echo "starting MariaDB"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd || true
  wait_for 3306 || echo "MariaDB did not come up"
fi
exit 0
