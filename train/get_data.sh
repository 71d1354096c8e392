#!/bin/sh
# Installs the Debian packages that hold the training text and builds data/train.txt and
# data/val.txt (plus .gz copies that travel to the GPU machine, stats.json and the document
# lists). Run from the repository root, as root or with sudo available. Debian 12 (bookworm).
# Usage: train/get_data.sh [train/prepare_data.py options]
usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; }
case "${1:-}" in -h|--help) usage; exit 0 ;; esac
set -eu
cd "$(dirname "$0")/.."
PKGS="python3.11-doc bible-kjv-text bible-kjv"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update
    # shellcheck disable=SC2086
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y --no-install-recommends $missing
fi
python3 train/prepare_data.py --out data "$@"
