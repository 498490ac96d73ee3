#!/usr/bin/env bash
# Make sure the local PostgreSQL and MariaDB the tests use are up, starting them when
# they are installed here and down. Tests decide what an unreachable server means
# (a skip locally, a failure with CI=true).
#
# Also a PgBouncer in transaction pooling mode on 127.0.0.1:6432 in front of the local
# PostgreSQL (tests/test_pgbouncer.py), and the tools tests/hosts.py needs to make
# network-namespace "hosts" (iproute2's ip, socat). These are installed with apt-get when
# missing (root only). With CI=true a failure to set them up is a failure (exit 1).
set -uo pipefail
up() { timeout 2 bash -c "</dev/tcp/127.0.0.1/$1" 2>/dev/null; }
wait_for() { for _ in $(seq 1 30); do up "$1" && return 0; sleep 1; done; return 1; }
status=0
problem() {
  echo "$1" >&2
  if [ "${CI:-}" = "true" ]; then status=1; fi
}

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

# -- Debian packages: pgbouncer, iproute2 (ip netns, tc), socat ---------------------------
missing=()
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v ip >/dev/null 2>&1 || [ -x /usr/sbin/ip ] || [ -x /sbin/ip ] || missing+=(iproute2)
command -v socat >/dev/null 2>&1 || missing+=(socat)
if [ ${#missing[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "installing ${missing[*]}"
    apt-get update -qq || true
    # The package's own pgbouncer service is not wanted (policy-rc.d usually denies it).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null \
      || problem "apt-get could not install ${missing[*]}"
  else
    problem "missing ${missing[*]}: install them (Debian: apt-get install ${missing[*]})"
  fi
fi

# -- PgBouncer, transaction pooling, on 127.0.0.1:6432 -----------------------------------
PGBOUNCER_DIR=${DBWORKER_PGBOUNCER_DIR:-/run/dbworker-pgbouncer}
PGBOUNCER=$(command -v pgbouncer 2>/dev/null || echo /usr/sbin/pgbouncer)
if up 6432; then
  : # one already listens: leave it
elif [ ! -x "$PGBOUNCER" ]; then
  problem "pgbouncer is not installed: tests/test_pgbouncer.py cannot run"
elif ! up 5432; then
  problem "PostgreSQL is not up: not starting PgBouncer"
else
  echo "starting PgBouncer (transaction pooling) on 127.0.0.1:6432"
  mkdir -p "$PGBOUNCER_DIR"
  # Trust: the local PostgreSQL trusts 127.0.0.1 too. Any database name is passed on.
  cat >"$PGBOUNCER_DIR/pgbouncer.ini" <<INI
[databases]
* = host=127.0.0.1 port=5432

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = 6432
unix_socket_dir =
pool_mode = transaction
auth_type = trust
auth_file = $PGBOUNCER_DIR/userlist.txt
admin_users = root
max_client_conn = 500
default_pool_size = 40
ignore_startup_parameters = extra_float_digits,options
server_reset_query =
logfile = $PGBOUNCER_DIR/pgbouncer.log
pidfile = $PGBOUNCER_DIR/pgbouncer.pid
INI
  printf '"%s" ""\n' root postgres "${USER:-root}" | sort -u >"$PGBOUNCER_DIR/userlist.txt"
  runas=()
  # PgBouncer refuses to run as root: drop to the postgres user when there is one.
  if [ "$(id -u)" = 0 ]; then
    if id postgres >/dev/null 2>&1; then
      chown -R postgres: "$PGBOUNCER_DIR"; runas=(-u postgres)
    else
      problem "PgBouncer cannot run as root and there is no postgres user"
    fi
  fi
  "$PGBOUNCER" -d "${runas[@]}" "$PGBOUNCER_DIR/pgbouncer.ini" \
    || problem "PgBouncer did not start (see $PGBOUNCER_DIR/pgbouncer.log)"
  wait_for 6432 || problem "PgBouncer did not come up on 6432 (see $PGBOUNCER_DIR/pgbouncer.log)"
fi
exit $status
