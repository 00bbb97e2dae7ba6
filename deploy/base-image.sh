#!/bin/sh
# Make a Debian bookworm base image from Debian's own packages, for Docker hosts that cannot pull
# from an image registry:
#
#   sudo deploy/base-image.sh [TAG]             # default TAG: llmfleet-base:bookworm
#   docker build -f deploy/Dockerfile --build-arg BASE_IMAGE=llmfleet-base:bookworm ...
#
# Or in two steps, the root filesystem first (no Docker needed; `make compose-prefetch` does it):
#
#   sudo deploy/base-image.sh --tar FILE        # the root filesystem as a tar
#   deploy/base-image.sh --from FILE [TAG]      # that tar imported as TAG
#
# debootstrap --variant=minbase installs Essential and apt only; the result is close to the
# upstream debian:bookworm-slim (no docs, man pages or locales; no recommended packages), so
# every Dockerfile here builds the same on either. Bookworm's python3 is 3.11, the version the
# worker's wheels (torch cp311) are built for.
#
# Needs root, debootstrap and a Debian mirror (DEBIAN_MIRROR overrides debootstrap's default).
# Takes about half a minute.
set -eu

import_tar() {  # FILE (- for standard input) TAG
  docker import --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' "$1" "$2" >/dev/null
  echo "$2"
}

TAR=
case "${1:-}" in
  --from) import_tar "$2" "${3:-llmfleet-base:bookworm}"; exit ;;
  --tar) TAR=$2 ;;
  *) TAG=${1:-llmfleet-base:bookworm} ;;
esac
SUITE=bookworm
ROOTFS=$(mktemp -d /tmp/llmfleet-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$ROOTFS" ${DEBIAN_MIRROR:-}

# The same size trims the upstream slim images make: no documentation, no recommends.
cat >"$ROOTFS/etc/dpkg/dpkg.cfg.d/docker-slim" <<'EOF'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
path-include /usr/share/locale/locale.alias
EOF
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-slim" <<'EOF'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
EOF
# Downloaded .debs and apt's package caches never stay in an image layer.
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
rm -rf "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/* \
       "$ROOTFS"/usr/share/doc/* "$ROOTFS"/usr/share/man/* "$ROOTFS"/usr/share/locale/*

if [ -n "$TAR" ]; then
  tar --numeric-owner -C "$ROOTFS" -cf "$TAR.partial" . && mv "$TAR.partial" "$TAR"
else
  tar --numeric-owner -C "$ROOTFS" -c . | import_tar - "$TAG"
fi
