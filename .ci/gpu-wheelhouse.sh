#!/usr/bin/env bash
# Every wheel that `pip install -e .` fetches on the GPU host, plus the peers the benchmarks
# compare against, in parts that each fit one device call (at most 60 MB a part; a call
# carries at most 64 MiB).
#
# The GPU host (CPython 3.12, x86-64, glibc 2.39) reaches no package index. Its venv
# (/opt/torch/.venv) already has torch 2.11.0 (CUDA 13.0) and the CUDA wheels it pulls,
# cuda-bindings, cuda-core, cuda-pathfinder, protobuf, setuptools...: HOST_HAS below is what
# `python -m pip list --format=freeze` printed there (2026-11-23) for every project in
# tilenorm's install plan. This script resolves tilenorm's dependencies (pyproject.toml) for
# that host with those versions held, and carries only what the plan adds: the CUDA
# $CUDA_VERSION compiler wheels (tileiras, nvcc, nvvm, crt), cuda-tile, the CuTe DSL's CUDA 13
# libraries (nvidia-cutlass-dsl-libs-cu13, -base, -core) and apache-tvm-ffi; then setuptools
# for the isolated build (pyproject's build-system.requires) and the peers, installed with
# --no-deps: quack-kernels, liger-kernel, tilegym, torch-c-dlpack-ext and the tiny
# nvidia-cutlass-dsl meta wheel (Quack imports `cutlass` through its .pth file).
# A wheel over the part size (nvidia-cutlass-dsl-libs-cu13 ~92 MB, nvidia-nvvm ~73 MB) is cut
# into chunks that install.sh joins again, checked against the index's sha256.
#
#   bash .ci/gpu-wheelhouse.sh            -> .gpu-wheelhouse/1, /2, ... (git-ignored)
#
# On the GPU host, one device call per part, in any order (carry: [".gpu-wheelhouse/N"]):
#   bash .gpu-wheelhouse/N/install.sh
# copies part N into /tmp/gpu-wheelhouse-parts and says which parts are still missing; once
# all are there it joins and verifies the wheels into /tmp/wheelhouse (idempotent: run again,
# it only checks). /tmp lasts only while the machine stays warm (it goes back after 30 s
# idle), so make the calls back to back, and the install in the same call as the last part.
# Then the README's commands, pointed at the local wheels (no index there):
#   PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheelhouse python -m pip install -e . && python -m tilenorm
#   python -m pip install --no-deps --no-index --find-links /tmp/wheelhouse \
#       quack-kernels liger-kernel tilegym torch-c-dlpack-ext nvidia-cutlass-dsl
# Use `python -m pip` there: a bare `pip` on that host is /usr/local/bin/pip, the system
# Python's, not the venv's that has torch.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=.gpu-wheelhouse
CUDA_VERSION=13.4.92        # the compiler trio (cuda-tile 1.7 takes 13.2 to 13.4)
PART_BYTES=60000000         # a part: its pieces, install.sh and the lists
PEERS=(quack-kernels==0.6.5 liger-kernel==0.8.5 tilegym==1.5.1 torch-c-dlpack-ext==0.1.5
       nvidia-cutlass-dsl==4.8.1)
PIP_VERSION=26.3            # resolves without downloading (>= 25.3), as tests/test_install.py
HOST_HAS='
cuda-bindings==13.3.1
cuda-core==1.2.0
cuda-pathfinder==1.8.1
cuda-toolkit==13.0.2
filelock==3.32.5
fsspec==2026.7.0
Jinja2==3.1.6
MarkupSafe==3.0.3
mpmath==1.3.0
networkx==3.6.1
nvidia-cublas==13.1.0.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.19.0.56
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.0
nvidia-nccl-cu13==2.28.9
nvidia-nvjitlink==13.0.88
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
protobuf==7.36.2
setuptools==81.0.0
sympy==1.14.0
torch==2.11.0
triton==3.6.0
typing_extensions==4.16.0
'
# The host's wheel tags: pip does not widen a --platform tag to older manylinux tags itself.
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp)
for minor in $(seq 39 -1 5); do PLAT+=(--platform "manylinux_2_${minor}_x86_64"); done
PLAT+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64
       --platform manylinux1_x86_64)

WORK=$(mktemp -d); trap 'rm -rf "$WORK"' EXIT
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1
python3 -m pip download -q --no-deps --only-binary=:all: -d "$WORK" "pip==$PIP_VERSION" \
  2> >(grep -v "is ignored" >&2)
PIP=(python3 "$WORK/pip-$PIP_VERSION-py3-none-any.whl/pip")
printf '%s\n' "$HOST_HAS" > "$WORK/host.txt"
printf '%s\n' "nvidia-cuda-tileiras==$CUDA_VERSION" "nvidia-cuda-nvcc==$CUDA_VERSION" \
  "nvidia-nvvm==$CUDA_VERSION" "nvidia-cuda-crt==$CUDA_VERSION" > "$WORK/toolchain.txt"
python3 - "$WORK" <<'PY'
import sys, tomllib
work = sys.argv[1]
with open("pyproject.toml", "rb") as f:
    project = tomllib.load(f)
open(f"{work}/deps.txt", "w").write("\n".join(project["project"]["dependencies"]) + "\n")
open(f"{work}/build.txt", "w").write("\n".join(project["build-system"]["requires"]) + "\n")
PY

# 1. The host's plan: tilenorm's dependencies with what the host has held at its versions
#    (pip keeps an installed version that satisfies), the compiler trio at $CUDA_VERSION.
"${PIP[@]}" install -q --dry-run --ignore-installed --use-feature=fast-deps \
  --report "$WORK/plan.json" "${PLAT[@]}" -c "$WORK/host.txt" -c "$WORK/toolchain.txt" \
  -r "$WORK/deps.txt" 2> >(grep -v -e 'is ignored' -e 'fast-deps' >&2)
python3 - "$WORK" <<'PY'
import json, re, sys
work = sys.argv[1]
norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()
host = dict(line.split("==") for line in open(f"{work}/host.txt").read().split())
host = {norm(name): version for name, version in host.items()}
carry, kept = [], []
for item in json.load(open(f"{work}/plan.json"))["install"]:
    name, version = item["metadata"]["name"], item["metadata"]["version"]
    if host.get(norm(name)) == version:
        kept.append(f"{name}=={version}")
        continue
    info = item["download_info"]
    carry.append((f"{name}=={version}", info["url"].rsplit("/", 1)[1],
                  info["archive_info"]["hashes"]["sha256"]))
print(f"on the host already: {len(kept)} of the plan's projects", file=sys.stderr)
print("carried:", " ".join(pin for pin, _, _ in carry), file=sys.stderr)
open(f"{work}/carry.txt", "w").write("".join(f"{pin}\n" for pin, _, _ in carry))
open(f"{work}/index-sums.txt", "w").write("".join(f"{s}  {f}\n" for _, f, s in carry))
PY

# 2. The wheels: the plan's additions, the build backend, the peers (all without their deps).
"${PIP[@]}" download -q --no-deps "${PLAT[@]}" -d "$WORK/whl" -r "$WORK/carry.txt" \
  -r "$WORK/build.txt" "${PEERS[@]}" 2> >(grep -v 'is ignored' >&2)
(cd "$WORK/whl" && sha256sum -c --quiet "$WORK/index-sums.txt")  # as the index lists them

# 3. Cut the wheels over a part into chunks, pack the pieces into parts (largest first).
rm -rf "$OUT"
python3 - "$WORK/whl" "$OUT" "$PART_BYTES" <<'PY'
import hashlib, os, shutil, sys
src, out, part_bytes = sys.argv[1], sys.argv[2], int(sys.argv[3])
room = part_bytes - 64 * 1024                 # left for install.sh and the lists
wheels = sorted(os.listdir(src))
sums = {w: hashlib.sha256(open(os.path.join(src, w), "rb").read()).hexdigest() for w in wheels}
pieces = []                                   # (name, bytes of the piece, wheel, offset)
for w in wheels:
    size = os.path.getsize(os.path.join(src, w))
    if size <= room:
        pieces.append((w, size, w, 0))
    else:
        for i, off in enumerate(range(0, size, room)):
            pieces.append((f"{w}.{i:03d}", min(room, size - off), w, off))
parts = []                                    # first fit, largest piece first
for piece in sorted(pieces, key=lambda p: -p[1]):
    for part in parts:
        if sum(p[1] for p in part) + piece[1] <= room:
            part.append(piece)
            break
    else:
        parts.append([piece])
listing = "".join(f"{n} {name}\n" for n, part in enumerate(parts, 1)
                  for name, *_ in sorted(part))
sumfile = "".join(f"{sums[w]}  {w}\n" for w in wheels)
for n, part in enumerate(parts, 1):
    folder = os.path.join(out, str(n), "pieces")
    os.makedirs(folder)
    for name, size, wheel, off in part:
        with open(os.path.join(src, wheel), "rb") as f, open(os.path.join(folder, name), "wb") as g:
            f.seek(off)
            g.write(f.read(size))
    open(os.path.join(out, str(n), "PIECES"), "w").write(listing)
    open(os.path.join(out, str(n), "SHA256SUMS"), "w").write(sumfile)
print(f"{len(wheels)} wheels in {len(pieces)} pieces, {len(parts)} parts", file=sys.stderr)
PY

cat > "$WORK/install.sh" <<'INSTALL'
#!/usr/bin/env bash
# Copy this part into $PARTS; once every part is there, join the wheels into $WHEELHOUSE and
# check each against SHA256SUMS. Idempotent; says which parts are still missing.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PARTS=${GPU_WHEELHOUSE_PARTS:-/tmp/gpu-wheelhouse-parts}
WHEELHOUSE=${GPU_WHEELHOUSE:-/tmp/wheelhouse}
mkdir -p "$PARTS" "$WHEELHOUSE"
cp -f "$HERE"/pieces/* "$HERE/PIECES" "$HERE/SHA256SUMS" "$PARTS/"
echo "gpu-wheelhouse: part $(basename "$HERE") copied into $PARTS"
missing=$(while read -r part piece; do
            [[ -f $PARTS/$piece ]] || echo "$part"
          done < "$PARTS/PIECES" | sort -nu | tr '\n' ' ')
if [[ -n $missing ]]; then
  echo "gpu-wheelhouse: still missing part(s): $missing(of $(cut -d' ' -f1 "$PARTS/PIECES" | sort -nu | wc -l))"
  exit 0
fi
while read -r sum wheel; do
  if [[ -f $WHEELHOUSE/$wheel ]] && echo "$sum  $WHEELHOUSE/$wheel" | sha256sum -c --status; then
    continue
  fi
  if [[ -f $PARTS/$wheel ]]; then
    cp -f "$PARTS/$wheel" "$WHEELHOUSE/$wheel.tmp"
  else
    cat "$PARTS/$wheel".[0-9][0-9][0-9] > "$WHEELHOUSE/$wheel.tmp"
  fi
  if ! echo "$sum  $WHEELHOUSE/$wheel.tmp" | sha256sum -c --status; then
    rm -f "$WHEELHOUSE/$wheel.tmp"
    echo "gpu-wheelhouse: $wheel does not match its sha256" >&2
    exit 1
  fi
  mv -f "$WHEELHOUSE/$wheel.tmp" "$WHEELHOUSE/$wheel"
done < "$PARTS/SHA256SUMS"
echo "gpu-wheelhouse: $(wc -l < "$PARTS/SHA256SUMS") wheels verified in $WHEELHOUSE"
INSTALL
for part in "$OUT"/*/; do
  install -m 755 "$WORK/install.sh" "$part/install.sh"
  printf '%s\t%s\n' "$(basename "$part")" "$(du -sb "$part" | cut -f1) bytes"
done
