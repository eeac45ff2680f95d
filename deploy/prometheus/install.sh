#!/usr/bin/env bash
# Unpack Debian's `prometheus` package into DEST (default: .venv/opt/prometheus) and print the binary's path.
#
# `apt-get install prometheus` would also start it as a system service (the package ships an init
# script); tests and `pdserve up --prometheus` want a binary they start and stop themselves, so the
# package is downloaded with apt and unpacked, not installed. Needs Debian's apt and its package lists
# (refreshed with `apt-get update` when the download fails and we are root).
set -euo pipefail
dest="${1:-.venv/opt/prometheus}"
bin="$dest/usr/bin/prometheus"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi
command -v apt-get >/dev/null || { echo "install.sh: apt-get not found (not a Debian system)" >&2; exit 2; }
work="$(mktemp -d)"
chmod 755 "$work"  # apt downloads as its _apt user when it can write here
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && timeout 300 apt-get download -q prometheus) >&2; }
if ! download; then
  [ "$(id -u)" = 0 ] || { echo "install.sh: apt-get download failed and we are not root" >&2; exit 2; }
  timeout 300 apt-get update -q >&2
  download
fi
mkdir -p "$dest"
dpkg-deb -x "$work"/prometheus_*.deb "$dest"
"$bin" --version >&2
echo "$bin"
