#!/usr/bin/env bash
# Unpack a Debian package into DEST and print the path of its binary:
#   install.sh [DEST [PACKAGE]]
#   PACKAGE prometheus (default; DEST .venv/opt/prometheus): prometheus and promtool
#   PACKAGE prometheus-alertmanager (DEST .venv/opt/alertmanager): prometheus-alertmanager and amtool
#
# `apt-get install` would also start it as a system service (each package ships an init script);
# tests and `pdserve up --prometheus/--alertmanager` want binaries they start and stop themselves, so
# the package is downloaded with apt and unpacked, not installed. Needs Debian's apt and its package
# lists (refreshed with `apt-get update` when the download fails and we are root).
#
# Debian's alertmanager build reads its default notification templates from a fixed path,
# /usr/share/prometheus/alertmanager/default.tmpl (Debian patch "Do not embed blobs"), and will not
# start without them: they are copied there from the unpacked package when missing (needs root).
set -euo pipefail
dest="${1:-.venv/opt/prometheus}"
package="${2:-prometheus}"
case "$package" in
  prometheus) bin="$dest/usr/bin/prometheus" ;;
  prometheus-alertmanager) bin="$dest/usr/bin/prometheus-alertmanager" ;;
  *) echo "install.sh: unknown package $package (prometheus or prometheus-alertmanager)" >&2; exit 2 ;;
esac
templates=/usr/share/prometheus/alertmanager
place_templates() {
  [ "$package" = prometheus-alertmanager ] || return 0
  [ -f "$templates/default.tmpl" ] && return 0
  if mkdir -p "$templates" 2>/dev/null && cp "$dest$templates"/*.tmpl "$templates"/ 2>/dev/null; then
    echo "install.sh: copied Debian's alertmanager templates into $templates (it reads them there)" >&2
  else
    echo "install.sh: Debian's alertmanager needs $templates/default.tmpl and cannot write it here" \
      "(run this as root, or apt-get install prometheus-alertmanager)" >&2
    return 3
  fi
}
if [ -x "$bin" ]; then place_templates; echo "$bin"; exit 0; fi
command -v apt-get >/dev/null || { echo "install.sh: apt-get not found (not a Debian system)" >&2; exit 2; }
work="$(mktemp -d)"
chmod 755 "$work"  # apt downloads as its _apt user when it can write here
trap 'rm -rf "$work"' EXIT
download() { (cd "$work" && timeout 300 apt-get download -q "$package") >&2; }
if ! download; then
  [ "$(id -u)" = 0 ] || { echo "install.sh: apt-get download failed and we are not root" >&2; exit 2; }
  timeout 300 apt-get update -q >&2
  download
fi
mkdir -p "$dest"
dpkg-deb -x "$work"/"${package}"_*.deb "$dest"
place_templates
"$bin" --version >&2
echo "$bin"
