#!/usr/bin/env bash
# The CUDA container image on a GPU machine without a container engine: builds it with
# scripts/image.py from the bundle's binary and this machine's CUDA libraries, unpacks its layers,
# adds the driver libraries as the NVIDIA container runtime would, and runs `rserve bench startup`
# inside it (chroot, as the image's user, the image's environment, CUDA_CACHE_DISABLE=1).
#   scripts/gpu/check_image.sh BINARY CUDA_LIB_DIR OUT [MODEL_DIR]
set -euo pipefail
BIN=$1 LIBS=$2 OUT=$3 MODEL=${4:-}
WORK=/tmp/rserve-image
rm -rf "$WORK" && mkdir -p "$WORK/rootfs"
python3 scripts/image.py cuda --binary "$BIN" --cuda-lib "$LIBS" --out "$WORK/cuda" --compresslevel 1 | tee "$OUT/image.json"
cp "$WORK/cuda/layers.txt" "$OUT/image-layers.txt"
python3 - "$WORK" <<'PY'
import json, sys, tarfile
from pathlib import Path
work = Path(sys.argv[1])
index = json.loads((work / "cuda/index.json").read_text())
blob = lambda d: work / "cuda/blobs/sha256" / d.split(":")[1]
manifest = json.loads(blob(index["manifests"][0]["digest"]).read_text())
for layer in manifest["layers"]:
    with tarfile.open(blob(layer["digest"])) as tf:
        tf.extractall(work / "rootfs", numeric_owner=True)
config = json.loads(blob(manifest["config"]["digest"]).read_text())["config"]
(work / "env").write_text("\n".join(config["Env"]) + "\n")
PY
ROOT=$WORK/rootfs
# what the NVIDIA container runtime injects: the driver's user-space libraries and device nodes
for lib in libcuda.so.1 libnvidia-ptxjitcompiler.so.1 libnvidia-nvvm.so.4; do
  src=$(ldconfig -p | awk -v l="$lib" '$1 == l {print $NF; exit}')
  [[ -n "$src" ]] && cp -L "$src" "$ROOT/usr/lib/x86_64-linux-gnu/$lib"
done
if [[ -n "$MODEL" ]]; then mkdir -p "$ROOT/models" && cp -r "$MODEL" "$ROOT/models/" && chmod -R a+rX "$ROOT/models" && MODEL=/models/$(basename "$MODEL"); fi
du -sh "$ROOT" | tee "$OUT/image-rootfs-size.txt"
mkdir -p "$ROOT/dev" "$ROOT/proc" "$ROOT/sys"
mount --bind /dev "$ROOT/dev" && mount -t proc proc "$ROOT/proc" && mount --bind /sys "$ROOT/sys"
trap 'umount "$ROOT/dev" "$ROOT/proc" "$ROOT/sys" 2>/dev/null || true' EXIT
CHROOT=$(command -v chroot)
env -i $(cat "$WORK/env") CUDA_CACHE_DISABLE=1 "$CHROOT" --userspec=65532:65532 "$ROOT" \
  /usr/local/bin/rserve bench startup $MODEL --runs 2 -- --gpu-memory-utilization 0.85 | tee "$OUT/image-startup.txt"
