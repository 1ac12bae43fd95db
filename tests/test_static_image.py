"""The static binary and the CPU container image, checked as a user runs them.

- the binary has no dynamic dependencies and serves the embedded model from a root filesystem that
  holds nothing else (chroot);
- `scripts/image.py cpu` writes an OCI layout and archive that skopeo inspects and umoci unpacks,
  and runc runs the unpacked bundle: it serves a chat completion as the image's non-root user, with
  the image's entrypoint and environment;
- the Kubernetes manifests in examples/ parse and probe /health on the port the container serves.

Environment: RSERVE_STATIC_BIN, the static server binary (scripts/test.sh builds one; `make static`
builds the release one). Chroot, unpacking and runc need root; skopeo, umoci and runc come from
Debian (scripts/test.sh installs them).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from support.rserve_process import REPO_ROOT, free_port

CHROOT = shutil.which("chroot") or "/usr/sbin/chroot"
STARTUP_TIMEOUT = 60.0


def static_binary() -> Path:
    env = os.environ.get("RSERVE_STATIC_BIN")
    if not env:
        pytest.skip("RSERVE_STATIC_BIN is not set (scripts/test.sh and `make static` build one)")
    path = Path(env).resolve()
    assert path.is_file(), f"RSERVE_STATIC_BIN={env} does not exist"
    return path


def need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("chroot and unpacking with owners need root")


def need_tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (apt-get install {name})")
    return path


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return json.load(r)


def serve_and_ask(args: list[str], env: dict[str, str], port: int, log: Path) -> dict:
    """Starts `args`, waits for /health, asks one chat completion, stops the server."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd="/")
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the server exited with {proc.returncode}:\n{log.read_text(errors='replace')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"/health did not answer:\n{log.read_text(errors='replace')}")
            time.sleep(0.05)
        models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=10))
        return post_json(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {"model": models["data"][0]["id"], "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8},
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_static_binary_has_no_dynamic_dependencies():
    out = subprocess.run(["ldd", str(static_binary())], capture_output=True, text=True)
    text = out.stdout + out.stderr
    assert "statically linked" in text or "not a dynamic executable" in text, text
    # no program interpreter: nothing for the kernel to load first
    with open(static_binary(), "rb") as f:
        assert b"ld-linux-x86-64.so" not in f.read(1 << 16)


def test_serves_the_embedded_model_from_an_empty_root(tmp_path: Path):
    need_root()
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy2(static_binary(), root / "rserve")
    assert sorted(p.name for p in root.iterdir()) == ["rserve"]
    port = free_port()
    reply = serve_and_ask(
        [CHROOT, str(root), "/rserve", "serve", "--port", str(port)], {}, port, tmp_path / "chroot.log"
    )
    assert reply["choices"][0]["message"]["role"] == "assistant"
    assert reply["usage"]["completion_tokens"] == 8
    # the embedded model's weights were written inside the root (no HOME: the temporary directory)
    assert list(root.glob("tmp/rserve/rserve-tiny-*/model.safetensors"))


@pytest.fixture(scope="module")
def cpu_image(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("image") / "cpu"
    subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "image.py"), "cpu", "--binary", str(static_binary()),
         "--out", str(out), "--tag", "rserve:test-cpu", "--compresslevel", "1"],
        check=True,
    )
    return out


def test_image_layout_is_valid_oci(cpu_image: Path):
    skopeo = need_tool("skopeo")
    for ref in (f"oci:{cpu_image}:test-cpu", f"oci-archive:{cpu_image}.tar:test-cpu"):
        info = json.loads(subprocess.run([skopeo, "inspect", ref], capture_output=True, text=True, check=True).stdout)
        assert info["Os"] == "linux" and info["Architecture"] == "amd64"
        assert len(info["Layers"]) == 2
        config = json.loads(
            subprocess.run([skopeo, "inspect", "--config", ref], capture_output=True, text=True, check=True).stdout
        )["config"]
        assert config["Entrypoint"] == ["/usr/local/bin/rserve", "serve"]
        assert config["User"] == "65532:65532"
        assert "RSERVE_HOST=0.0.0.0" in config["Env"]
    # docker load's index of the same archive
    manifest = json.loads((cpu_image / "manifest.json").read_text())
    assert manifest[0]["RepoTags"] == ["rserve:test-cpu"]
    assert all((cpu_image / p).is_file() for p in [manifest[0]["Config"], *manifest[0]["Layers"]])


def test_unpacked_image_serves_as_its_user(cpu_image: Path, tmp_path: Path):
    need_root()
    umoci = need_tool("umoci")
    bundle = tmp_path / "bundle"
    subprocess.run([umoci, "unpack", "--image", f"{cpu_image}:test-cpu", str(bundle)], check=True, capture_output=True)
    rootfs = bundle / "rootfs"
    names = {str(p.relative_to(rootfs)) for p in rootfs.rglob("*")}
    assert {"usr/local/bin/rserve", "etc/passwd", "etc/group", "tmp", "home/rserve"} <= names
    assert (rootfs / "tmp").stat().st_mode & 0o1777 == 0o1777
    assert (rootfs / "home/rserve").stat().st_uid == 65532
    assert "rserve:x:65532:65532" in (rootfs / "etc/passwd").read_text()
    # run it as a runtime does: the OCI config's user, environment and entrypoint (runc from
    # Debian, on the host's network so the test can reach it; chroot where runc is missing)
    config = json.loads((bundle / "config.json").read_text())
    process = config["process"]
    assert process["user"]["uid"] == 65532 and process["args"][:2] == ["/usr/local/bin/rserve", "serve"]
    port = free_port()
    env = dict(e.split("=", 1) for e in process["env"])
    env.update(RSERVE_PORT=str(port), RSERVE_HOST="127.0.0.1")
    runc = shutil.which("runc")
    if runc:
        process.update(terminal=False, env=[f"{k}={v}" for k, v in env.items()])
        config["linux"]["namespaces"] = [n for n in config["linux"]["namespaces"] if n["type"] != "network"]
        (bundle / "config.json").write_text(json.dumps(config))
        name = f"rserve-test-{port}"
        try:
            reply = serve_and_ask([runc, "run", "--bundle", str(bundle), name], {}, port, tmp_path / "image.log")
        finally:
            subprocess.run([runc, "delete", "--force", name], capture_output=True)
    else:
        reply = serve_and_ask(
            [CHROOT, "--userspec=65532:65532", str(rootfs), *process["args"]], env, port, tmp_path / "image.log"
        )
    assert reply["usage"]["completion_tokens"] == 8
    # the embedded model went into the user's home, not the read-only parts of the image
    assert list(rootfs.glob("home/rserve/.cache/rserve/rserve-tiny-*/model.safetensors"))


def test_kubernetes_manifests_probe_health_on_the_served_port():
    files = sorted((REPO_ROOT / "examples" / "kubernetes").glob("*.yaml"))
    assert files
    for f in files:
        docs = [d for d in yaml.safe_load_all(f.read_text()) if d]
        kinds = {d["kind"]: d for d in docs}
        assert {"Deployment", "Service"} <= set(kinds), f
        dep, svc = kinds["Deployment"], kinds["Service"]
        pod = dep["spec"]["template"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert pod["spec"]["securityContext"]["runAsUser"] == 65532
        (c,) = pod["spec"]["containers"]
        ports = {p["name"]: p["containerPort"] for p in c["ports"]}
        env = {e["name"]: e["value"] for e in c.get("env", [])}
        assert env.get("RSERVE_HOST") == "0.0.0.0"
        assert int(env.get("RSERVE_PORT", "8000")) == ports["http"]
        for probe in ("readinessProbe", "startupProbe", "livenessProbe"):
            assert c[probe]["httpGet"] == {"path": "/health", "port": "http"}, (f, probe)
        assert svc["spec"]["ports"][0]["targetPort"] == "http"
        # writable places for the model cache under a read-only root
        if c["securityContext"].get("readOnlyRootFilesystem"):
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert {"/tmp", "/home/rserve/.cache"} <= mounts
