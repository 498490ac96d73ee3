#!/usr/bin/env bash
# Debian packages the test suite needs: headers to build mysqlclient.
# Skipped when already present or when apt-get is not available (install them yourself).
set -euo pipefail
if pkg-config --exists mysqlclient 2>/dev/null || pkg-config --exists libmariadb 2>/dev/null; then
  exit 0
fi
if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq default-libmysqlclient-dev pkg-config build-essential >/dev/null
else
  echo "mysqlclient needs its headers: install default-libmysqlclient-dev and pkg-config (Debian) or mysql-devel (Fedora)" >&2
fi
