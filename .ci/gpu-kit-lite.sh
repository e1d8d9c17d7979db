#!/usr/bin/env bash
# Pack what the GPU host lacks to run tilenorm's cuTile kernels, in ONE part that fits a
# single device call (the shared gpu-kit needs three calls; it also carries the baselines,
# which only the peer benchmark needs):
#   cuda-tile (cp312 wheel) + the CUDA 13.4 cuTile compiler (tileiras, ptxas, libnvvm).
#
#   bash .ci/gpu-kit-lite.sh            -> .gpu-kit-lite/ (git-ignored), ~58 MiB
# On the GPU host:  bash .gpu-kit-lite/install.sh && source /tmp/gpu-kit-lite/env.sh
set -euo pipefail
OUT=.gpu-kit-lite
CUDA_VERSION=13.4.92
WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" cuda-tile==1.7.0 \
  nvidia-cuda-tileiras==$CUDA_VERSION nvidia-cuda-nvcc==$CUDA_VERSION nvidia-nvvm==$CUDA_VERSION
mkdir -p "$WORK/tc"
for w in "$WORK"/whl/nvidia_*.whl; do
  unzip -q -o "$w" 'nvidia/cu13/bin/tileiras' 'nvidia/cu13/bin/ptxas' \
    'nvidia/cu13/lib/libnvvm.so.4' -d "$WORK/tc" 2>/dev/null || true
done
rm -rf "$OUT"; mkdir -p "$OUT"
tar -C "$WORK/tc/nvidia" -cf - cu13/bin/tileiras cu13/bin/ptxas cu13/lib/libnvvm.so.4 \
  | xz -9e -T0 > "$OUT/toolchain.tar.xz"
cp "$WORK"/whl/cuda_tile-*.whl "$OUT/"
cat > "$OUT/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Unpack into /tmp/gpu-kit-lite (no-op when already there) and write env.sh.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
KIT=/tmp/gpu-kit-lite
[[ -f $KIT/env.sh ]] && { echo "gpu-kit-lite: already installed"; exit 0; }
mkdir -p "$KIT/site" "$KIT/bin"
tar -C "$KIT" -xJf "$HERE/toolchain.tar.xz"
python3 -m zipfile -e "$HERE"/cuda_tile-*.whl "$KIT/site"
# tileiras must not see CUDA_HOME: it would take the host's CUDA 13.0 ptxas and libnvvm.
cat > "$KIT/bin/tileiras" <<'WRAP'
#!/usr/bin/env bash
exec env -u CUDA_HOME -u CUDA_PATH PATH="/tmp/gpu-kit-lite/cu13/bin:$PATH" \
  /tmp/gpu-kit-lite/cu13/bin/tileiras "$@"
WRAP
chmod +x "$KIT/bin/tileiras" "$KIT/cu13/bin/"*
cat > "$KIT/env.sh" <<ENV
export PYTHONPATH=$KIT/site\${PYTHONPATH:+:\$PYTHONPATH}
export PATH=$KIT/bin:\$PATH
ENV
echo "gpu-kit-lite: installed into $KIT"
INSTALL
du -sh "$OUT"
