#!/usr/bin/env python3
"""Builds rserve's container images as OCI image layouts, without a container engine.

    scripts/image.py cpu  --binary target/static/.../rserve --out target/image/cpu
    scripts/image.py cuda --binary target/cuda/release/rserve --cuda-lib DIR --out target/image/cuda
                          [--model DIR]   # bakes a model in (its own layer) and serves it by default

Each run writes an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`) under --out and
the same layout as one tar, `--out`.tar (`oci-archive:` for skopeo and podman; it also carries
Docker's `manifest.json`, so `docker load` takes it). Layers are gzipped tars with fixed times and
owners, so the same inputs give the same digests. Every layer's contents are printed and written to
`--out`/layers.txt.

The CPU image is FROM scratch: the static binary, CA certificates, a non-root user (65532) with a
home and a /tmp. The CUDA image adds the glibc closure of the binary and of the CUDA libraries it
loads (taken from this machine's system packages) and those libraries themselves (cuBLAS,
cuBLASLt, cudart, cuRAND from the toolchain's PyPI wheels). The driver, libcuda.so.1, is left to
the NVIDIA container runtime, which injects it. Standard library only.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

UID = 65532
USER = "rserve"
HOME = f"/home/{USER}"
CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# libraries that the NVIDIA container runtime mounts into the container
DRIVER_LIBS = ("libcuda.so", "libnvidia-", "linux-vdso")
LIB_DIR = "/usr/lib/x86_64-linux-gnu"
CUDA_LIB_DIR = "/usr/local/rserve/lib"


@dataclass
class Layer:
    """One image layer: a tar with fixed metadata, entries in a stable order."""

    name: str
    entries: dict[str, tuple] = field(default_factory=dict)

    def dir(self, path: str, mode: int = 0o755, owner: int = 0) -> None:
        parent = os.path.dirname(path.rstrip("/"))
        if parent not in ("", "/") and parent not in self.entries:
            self.dir(parent)
        self.entries[path] = ("dir", mode, owner, None)

    def file(self, path: str, data: bytes | Path, mode: int = 0o644) -> None:
        self.dir(os.path.dirname(path))
        self.entries[path] = ("file", mode, 0, data)

    def symlink(self, path: str, target: str) -> None:
        self.dir(os.path.dirname(path))
        self.entries[path] = ("link", 0o777, 0, target)

    def tar(self) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
            for path in sorted(self.entries):
                kind, mode, owner, data = self.entries[path]
                info = tarfile.TarInfo(path.lstrip("/"))
                info.mtime, info.mode, info.uid, info.gid = 0, mode, owner, owner
                info.uname = info.gname = USER if owner == UID else "root"
                if kind == "dir":
                    info.type = tarfile.DIRTYPE
                    tf.addfile(info)
                elif kind == "link":
                    info.type, info.linkname = tarfile.SYMTYPE, data
                    tf.addfile(info)
                else:
                    if isinstance(data, Path):
                        with open(data, "rb") as f:
                            info.size = os.fstat(f.fileno()).st_size
                            tf.addfile(info, f)
                    else:
                        info.size = len(data)
                        tf.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    def listing(self) -> list[str]:
        rows = []
        for path in sorted(self.entries):
            kind, _, _, data = self.entries[path]
            if kind == "file":
                size = data.stat().st_size if isinstance(data, Path) else len(data)
                rows.append(f"{size:>12,}  {path}")
            elif kind == "link":
                rows.append(f"{'':>12}  {path} -> {data}")
        return rows


def base_layer() -> Layer:
    """Users, a home, /tmp and CA certificates: what every image starts from."""
    layer = Layer("base: non-root user, /tmp, CA certificates")
    layer.file("/etc/passwd", f"root:x:0:0:root:/root:/sbin/nologin\n{USER}:x:{UID}:{UID}:{USER}:{HOME}:/sbin/nologin\n".encode())
    layer.file("/etc/group", f"root:x:0:\n{USER}:x:{UID}:\n".encode())
    layer.file("/etc/nsswitch.conf", b"hosts: files dns\n")
    if CA_BUNDLE.is_file():
        layer.file(str(CA_BUNDLE), CA_BUNDLE)
    layer.dir("/tmp", 0o1777)
    layer.dir(HOME, 0o755, UID)
    layer.dir(f"{HOME}/.cache", 0o755, UID)
    return layer


def needed_closure(binaries: list[Path], search: list[Path]) -> dict[str, Path]:
    """Every shared library the binaries load (by `ldd`), except the driver's."""
    env = dict(os.environ, LD_LIBRARY_PATH=":".join(map(str, search)))
    found: dict[str, Path] = {}
    for b in binaries:
        out = subprocess.run(["ldd", str(b)], env=env, capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if not parts or parts[0].startswith(DRIVER_LIBS):
                continue
            if "=>" in parts and len(parts) >= 3:
                if parts[2] == "not":
                    sys.exit(f"{b}: {parts[0]} not found (searched {search})")
                found[parts[0]] = Path(parts[2])
            elif parts[0].startswith("/"):
                found[os.path.basename(parts[0])] = Path(parts[0])
    return found


def cuda_layers(binary: Path, cuda_lib: Path) -> list[Layer]:
    """The glibc closure (from this machine) and the CUDA libraries the binary links."""
    deps = needed_closure([binary], [cuda_lib])
    cuda = {n: p for n, p in deps.items() if p.resolve().parent == cuda_lib.resolve()}
    system = {n: p for n, p in deps.items() if n not in cuda}
    # the CUDA libraries' own system dependencies (libdl, librt, libpthread, ...)
    system.update(
        (n, p) for n, p in needed_closure(sorted(cuda.values()), [cuda_lib]).items() if n not in cuda
    )
    glibc = Layer("glibc and the C++ runtime, from the build machine's system packages")
    for name, path in sorted(system.items()):
        if name.startswith("ld-linux"):
            glibc.file(f"/lib64/{name}", path.resolve(), 0o755)
        else:
            glibc.file(f"{LIB_DIR}/{name}", path.resolve(), 0o755)
    glibc.symlink("/lib/x86_64-linux-gnu", LIB_DIR)
    libs = Layer("CUDA runtime libraries (cuBLAS, cuBLASLt, cudart, cuRAND), from the pinned PyPI wheels")
    for name, path in sorted(cuda.items()):
        libs.file(f"{CUDA_LIB_DIR}/{name}", path.resolve(), 0o755)
    return [glibc, libs]


def model_layer(model: Path) -> Layer:
    layer = Layer(f"model: {model.name}")
    for p in sorted(model.rglob("*")):
        if p.is_file():
            layer.file(f"/models/{model.name}/{p.relative_to(model)}", p.resolve())
    return layer


def write_blob(root: Path, data: bytes) -> dict:
    digest = hashlib.sha256(data).hexdigest()
    path = root / "blobs" / "sha256" / digest
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return {"digest": f"sha256:{digest}", "size": len(data)}


def build(layers: list[Layer], out: Path, tag: str, entrypoint: list[str], cmd: list[str], env: list[str], level: int = 9) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    for old in (out / "blobs" / "sha256").glob("*"):
        old.unlink()
    descriptors, diff_ids, history, listing = [], [], [], []
    for layer in layers:
        raw = layer.tar()
        gz = gzip.compress(raw, compresslevel=level, mtime=0)
        d = write_blob(out, gz)
        descriptors.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", **d})
        diff_ids.append("sha256:" + hashlib.sha256(raw).hexdigest())
        history.append({"created": "1970-01-01T00:00:00Z", "created_by": f"scripts/image.py: {layer.name}"})
        listing.append(f"## {layer.name}\n{d['digest']}  {len(raw):,} bytes, {d['size']:,} gzipped")
        listing.extend(layer.listing())
        print(f"layer {layer.name}: {len(raw) / 2**20:.1f} MiB, {d['size'] / 2**20:.1f} MiB gzipped", file=sys.stderr)
    config = {
        "created": "1970-01-01T00:00:00Z",
        "architecture": "amd64",
        "os": "linux",
        "config": {
            "User": f"{UID}:{UID}",
            "Env": env,
            "Entrypoint": entrypoint,
            "Cmd": cmd,
            "WorkingDir": HOME,
            "ExposedPorts": {"8000/tcp": {}},
            "Labels": {"org.opencontainers.image.title": "rserve", "org.opencontainers.image.source": "https://github.com/rserve/rserve"},
        },
        "rootfs": {"type": "layers", "diff_ids": diff_ids},
        "history": history,
    }
    cfg = write_blob(out, json.dumps(config, sort_keys=True).encode())
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", **cfg},
        "layers": descriptors,
    }
    man = write_blob(out, json.dumps(manifest, sort_keys=True).encode())
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            **man,
            "annotations": {"org.opencontainers.image.ref.name": tag.rsplit(":", 1)[-1], "io.containerd.image.name": tag},
        }],
    }
    (out / "index.json").write_text(json.dumps(index, sort_keys=True))
    (out / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    # docker load (before it read index.json) looks for this
    (out / "manifest.json").write_text(json.dumps([{
        "Config": f"blobs/sha256/{cfg['digest'][7:]}",
        "RepoTags": [tag],
        "Layers": [f"blobs/sha256/{d['digest'][7:]}" for d in descriptors],
    }]))
    (out / "layers.txt").write_text("\n".join(listing) + "\n")
    archive = out.with_name(out.name + ".tar")
    with tarfile.open(archive, "w") as tf:
        for p in sorted(out.rglob("*")):
            if p.name == "layers.txt":
                continue
            info = tf.gettarinfo(str(p), str(p.relative_to(out)))
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "root", "root"
            if p.is_file():
                with open(p, "rb") as f:
                    tf.addfile(info, f)
            else:
                tf.addfile(info)
    compressed = sum(d["size"] for d in descriptors) + cfg["size"] + man["size"]
    summary = {"tag": tag, "layout": str(out), "archive": str(archive), "manifest": man["digest"],
               "layers": len(descriptors), "compressed_bytes": compressed}
    print(json.dumps(summary))
    return summary


def workspace_version() -> str:
    """The version in the workspace's Cargo.toml (`[workspace.package]`)."""
    text = (Path(__file__).resolve().parent.parent / "Cargo.toml").read_text()
    section = text.split("[workspace.package]", 1)[-1]
    for line in section.splitlines():
        if line.startswith("version"):
            return line.split("=", 1)[1].strip().strip('"')
    return "latest"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=["cpu", "cuda"])
    ap.add_argument("--binary", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="the OCI layout directory; the archive is OUT.tar")
    ap.add_argument("--tag", help="image name and tag (default rserve:VERSION-KIND)")
    ap.add_argument("--cuda-lib", type=Path, help="where the CUDA libraries are (the toolchain's lib/)")
    ap.add_argument("--model", type=Path, help="a model directory to bake in, served by default")
    ap.add_argument("--compresslevel", type=int, default=9, choices=range(1, 10), help="gzip level of the layers")
    args = ap.parse_args()
    if not args.binary.is_file():
        sys.exit(f"{args.binary}: no such binary")
    tag = args.tag or f"rserve:{workspace_version()}-{args.kind}"
    env = ["PATH=/usr/local/bin", f"HOME={HOME}", "RSERVE_HOST=0.0.0.0", f"SSL_CERT_FILE={CA_BUNDLE}"]
    layers = [base_layer()]
    if args.kind == "cpu":
        ldd = subprocess.run(["ldd", str(args.binary)], capture_output=True, text=True, check=False)
        if "not a dynamic executable" not in ldd.stdout + ldd.stderr and "statically linked" not in ldd.stdout + ldd.stderr:
            sys.exit(f"{args.binary} is dynamically linked; the CPU image needs the static build (make static)")
    else:
        if args.cuda_lib is None:
            sys.exit("the CUDA image needs --cuda-lib (the CUDA toolchain's lib directory)")
        layers += cuda_layers(args.binary, args.cuda_lib)
        env += [f"LD_LIBRARY_PATH={CUDA_LIB_DIR}:{LIB_DIR}", "NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility", f"CUDA_CACHE_PATH={HOME}/.cache/nv"]
    binary = Layer("the rserve binary")
    binary.file("/usr/local/bin/rserve", args.binary.resolve(), 0o755)
    layers.append(binary)
    cmd: list[str] = []
    if args.model:
        layers.append(model_layer(args.model))
        cmd = [f"/models/{args.model.name}"]
    build(layers, args.out, tag, ["/usr/local/bin/rserve", "serve"], cmd, env, args.compresslevel)


if __name__ == "__main__":
    main()
