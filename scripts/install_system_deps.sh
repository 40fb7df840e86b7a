#!/usr/bin/env bash
# System packages the tests and benchmarks use, from Debian's archive:
#   libssl-dev    OpenSSL's libcrypto: the peer layer's encrypted frames (the build needs it)
#   libipsec-mb-dev  intel-ipsec-mb: the same frames sealed 2-2.5x as fast (x86-64 only; optional)
#   liburing-dev  the io_uring backend of the packed store (without it _io builds with pread only)
#   redis-server  the Redis baseline in bench/ (its tests skip with a message when absent)
#   fio           the physical-limit baseline of the store benchmark
# Best effort: without root or without the archive the build still works, on the fallbacks.
set -u
pkgs="libssl-dev liburing-dev redis-server fio"
[ "$(uname -m)" = x86_64 ] && pkgs="$pkgs libipsec-mb-dev"
missing=""
for p in $pkgs; do dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"; done
if [ -z "$missing" ]; then
  echo "system packages present:$pkgs"
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null && SUDO="sudo"
if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing; }; then
  echo "warning: could not install$missing; continuing with the fallbacks" >&2
fi
exit 0
