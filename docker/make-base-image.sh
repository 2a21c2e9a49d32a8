#!/usr/bin/env bash
# A local base image made from Debian packages, for machines that reach no image registry
# (so `FROM python:3.11-slim` cannot be pulled) but do reach a Debian mirror:
#
#   docker/make-base-image.sh [NAME]          # default NAME: pagedserve-base:bookworm
#   docker build --build-arg BASE_IMAGE=pagedserve-base:bookworm -t pagedserve .
#
# debootstrap --variant=minbase bookworm, plus python3 (3.11, as in python:3.11-slim),
# python3-venv, python3-pip, gcc and libc6-dev (the CPU kernels are compiled at first start),
# then `docker import`. Needs root, debootstrap and a running Docker engine; about a minute.
# DEBIAN_MIRROR picks the mirror (default: deb.debian.org); DOCKER the client (default: docker).
set -euo pipefail
name=${1:-pagedserve-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}
packages=python3,python3-venv,python3-pip,gcc,libc6-dev,ca-certificates

[ "$(id -u)" = 0 ] || { echo "error: debootstrap needs root" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "error: debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d "${TMPDIR:-/tmp}/pagedserve-base.XXXXXX")
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm ($mirror) into $root ..." >&2
debootstrap --variant=minbase --include="$packages" bookworm "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# What a container never needs: downloaded .debs, package lists, docs.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
       "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/*
# The same apt sources the image would have had from the registry's Debian images.
printf 'deb %s bookworm main\ndeb %s bookworm-updates main\n' "$mirror" "$mirror" >"$root/etc/apt/sources.list"

tar -C "$root" -c . | "$docker" import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$name" >/dev/null
echo "$name"
