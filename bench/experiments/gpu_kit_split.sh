#!/usr/bin/env bash
# Re-split a packed GPU kit (../shared/gpu-kit/pack.sh, 60 MB parts) into parts small enough
# to travel beside this working tree: the device tool carries 64 MiB, the tree included
# (8.5 MB at da4c549 made a 60 MB part fail, NOTES #122). The kit's own install.sh joins
# the parts in order and checks the whole archive's sha256, which re-splitting keeps; the
# part count in each manifest follows. The third part (35 MB) still cannot travel beside the
# suite archive (.gpu-cache/suite-caches.tar.xz, 33 MiB with the recorded cuTile variants).
#   bash bench/experiments/gpu_kit_split.sh [KIT_DIR [PART_BYTES]]
set -euo pipefail
kit=${1:-.gpu-kit}
size=${2:-50000000}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
source "$kit/1/manifest"
for ((i = 1; i <= parts; i++)); do cat "$kit/$i/part.$i"; done > "$work/kit.tar.xz"
[ "$(sha256sum "$work/kit.tar.xz" | cut -d' ' -f1)" = "$sha256" ] || {
  echo "parts of $kit do not join to the manifest's sha256" >&2; exit 1; }
(cd "$work" && split -b "$size" -d -a 1 kit.tar.xz part.)
n=$(ls "$work"/part.* | wc -l)
for ((i = 1; i <= n; i++)); do
  mkdir -p "$kit/$i"
  rm -f "$kit/$i"/part.*
  mv "$work/part.$((i - 1))" "$kit/$i/part.$i"
  [ "$i" = 1 ] || cp "$kit/1/install.sh" "$kit/1/check.py" "$kit/$i/"
  printf 'parts=%s\nsha256=%s\n' "$n" "$sha256" > "$kit/$i/manifest"
done
for ((i = n + 1; i <= parts; i++)); do rm -rf "${kit:?}/$i"; done
du -sb "$kit"/*
echo "$n parts of at most $size bytes in $kit"
