#!/usr/bin/env bash
# Installs the programs Shoal's tests and demo use (Debian packages).
# Idempotent: does nothing when everything is already there.
set -euo pipefail
need=()
command -v fio >/dev/null || need+=(fio)
command -v curl >/dev/null || need+=(curl)
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
command -v nbdfuse >/dev/null || need+=(libnbd-bin)
command -v nbdkit >/dev/null || need+=(nbdkit)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v fusermount3 >/dev/null || need+=(fuse3)
command -v losetup >/dev/null || need+=(mount)
command -v python3 >/dev/null || need+=(python3)
# The partition tests: network namespaces, bridges, and packet drops.
command -v ip >/dev/null || need+=(iproute2)
command -v iptables >/dev/null || need+=(iptables)
# NBD TLS-PSK: the system's OpenSSL 3 to build against (rustls has no
# pre-shared keys), and GnuTLS's psktool (key files) and gnutls-cli for
# its tests.
dpkg -s libssl-dev >/dev/null 2>&1 || need+=(libssl-dev)
command -v pkg-config >/dev/null || need+=(pkg-config)
command -v psktool >/dev/null || need+=(gnutls-bin)
command -v gnutls-cli >/dev/null || need+=(gnutls-bin)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo=sudo
  echo "installing: ${need[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
# FUSE and loop devices for the ext4-on-a-volume test.
[ -e /dev/fuse ] || modprobe fuse 2>/dev/null || true
[ -e /dev/loop-control ] || modprobe loop 2>/dev/null || true
