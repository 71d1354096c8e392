#!/usr/bin/env bash
# Makes sure the build tools are present (Debian): gcc, make, cmake, and what `entmaxkv serve`
# needs: libmicrohttpd-dev (the HTTP server library the CLI links) and curl (its tests).
# Installs them with apt-get when running as root, otherwise says what to install (without
# libmicrohttpd the CLI builds without serve, so only a warning). Sourced by the scripts.
# Extra arguments name further tools whose Debian package has the same name (pkg-config).
# Usage: . scripts/deps.sh; ekv_need_tools [TOOL...]   (a library of the other scripts)
if [ "${BASH_SOURCE[0]}" = "$0" ]; then # run, not sourced: only --help means something
  case "${1:-}" in -h|--help) awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0"; exit 0 ;; esac
fi
# shellcheck disable=SC2120 # the extra tools are optional
ekv_need_tools() {
  local missing=() tool
  command -v cc >/dev/null 2>&1 || command -v gcc >/dev/null 2>&1 || missing+=(gcc)
  command -v make >/dev/null 2>&1 || missing+=(make)
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  for tool in "$@"; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
  local serve=() # entmaxkv serve: the library it links and the client its test drives
  [ -e /usr/include/microhttpd.h ] || [ -e /usr/local/include/microhttpd.h ] || serve+=(libmicrohttpd-dev)
  command -v curl >/dev/null 2>&1 || serve+=(curl)
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    [ ${#serve[@]} -eq 0 ] || echo "warning: ${serve[*]} missing: entmaxkv serve (and its test) need them. On Debian: sudo apt-get install ${serve[*]}" >&2
  else
    missing+=("${serve[@]}")
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing build tools: ${missing[*]}" >&2
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2 || {
      echo "error: apt-get could not install ${missing[*]}" >&2; return 1; }
  else
    echo "error: missing build tools: ${missing[*]}. On Debian: sudo apt-get install ${missing[*]}" >&2
    return 1
  fi
}
