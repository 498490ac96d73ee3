#!/usr/bin/env bash
# Debian packages the test suite needs: headers to build mysqlclient, chromium for the
# browser test (Playwright drives it; its own browser download is not used), and
# libfaketime for the test of a host whose clock is off (tests/test_one_clock.py).
# Skipped when already present or when apt-get is not available (install them yourself).
set -euo pipefail
have_mysql_headers() {
  pkg-config --exists mysqlclient 2>/dev/null || pkg-config --exists libmariadb 2>/dev/null
}
have_faketime() {
  compgen -G '/usr/lib/*/faketime/libfaketime.so.1' >/dev/null
}
if have_mysql_headers && [ -x /usr/bin/chromium ] && have_faketime; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-libmysqlclient-dev pkg-config build-essential chromium libfaketime >/dev/null
else
  echo "The tests need mysqlclient's headers and a Chromium: install default-libmysqlclient-dev, pkg-config, chromium and libfaketime (Debian) or mysql-devel and chromium (Fedora)" >&2
fi
