"""Replicas of the in-process engine behind Ray Serve (`rserve.ray`): two replicas of the
embedded model on a local Ray cluster answer the official `openai` client through Ray Serve's
proxy, streamed and not; requests spread over both; a replica killed mid-run is replaced while
its clients' requests finish or fail cleanly."""

from __future__ import annotations

import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from openai import APIError, OpenAI

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
rserve_ray = pytest.importorskip("rserve.ray")

APP = "rserve"
ENGINE = {"device": "cpu", "max_model_len": 256, "max_num_seqs": 16, "kv_cache_memory": 8 << 20}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_running(replicas: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        app = serve.status().applications.get(APP)
        if app is not None and app.status == "RUNNING":
            dep = app.deployments["rserve"]
            if dep.replica_states.get("RUNNING", 0) == replicas:
                return
        time.sleep(0.5)
    raise AssertionError(f"the deployment did not reach {replicas} running replicas: {serve.status()}")


@pytest.fixture(scope="module")
def base_url():
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, ignore_reinit_error=True)
    port = _free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(rserve_ray.deployment(num_replicas=2, **ENGINE), name=APP, route_prefix="/")
        _wait_running(2)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def _replica_of(base_url: str) -> str:
    r = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": "rserve-tiny", "prompt": "Hello", "max_tokens": 2},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.headers[rserve_ray.REPLICA_HEADER]


def test_openai_client_streamed_and_not(base_url):
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
    with client:
        _client_checks(client)
    r = httpx.post(f"{base_url}/v1/chat/completions", content=b"{bad", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == 400
    # paths reach the router as sent (percent-encoded), as they reach `rserve serve`
    r = httpx.get(f"{base_url}/v1/models/no%20such%3Fmodel", timeout=30)
    assert r.status_code == 404 and r.json()["error"]["code"] == 404, r.text


def _client_checks(client: OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == ["rserve-tiny"]
    messages = [{"role": "user", "content": "Say something."}]
    full = client.chat.completions.create(model="rserve-tiny", messages=messages, max_tokens=12, temperature=0)
    assert full.usage.completion_tokens == 12
    text = full.choices[0].message.content
    assert text
    stream = client.chat.completions.create(
        model="rserve-tiny", messages=messages, max_tokens=12, temperature=0, stream=True
    )
    pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len(pieces) > 2  # delivered piece by piece, not in one body
    assert "".join(pieces) == text  # every replica runs the same seeded model greedily
    # the server's errors, in OpenAI's shape
    with pytest.raises(APIError) as e:
        client.completions.create(model="rserve-tiny", prompt="x", max_tokens=-1)
    assert getattr(e.value, "status_code", None) == 400


def test_requests_spread_over_both_replicas(base_url):
    seen: set[str] = set()
    with ThreadPoolExecutor(8) as pool:
        for _ in range(4):  # routing is randomized: a few rounds make a miss vanishingly rare
            seen |= set(pool.map(lambda _: _replica_of(base_url), range(24)))
            if len(seen) == 2:
                break
    assert len(seen) == 2, seen


def test_killed_replica_is_replaced_and_clients_fail_clean(base_url):
    before = {_replica_of(base_url) for _ in range(12)}
    victim = sorted(before)[0]

    def one(i: int) -> str:
        client = OpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0, timeout=60)
        with client:
            return _stream_outcome(client, i)

    def _stream_outcome(client: OpenAI, i: int) -> str:
        try:
            stream = client.completions.create(
                model="rserve-tiny", prompt=f"Count {i}", max_tokens=120, temperature=0, stream=True
            )
            n = sum(1 for c in stream if c.choices and c.choices[0].text is not None)
            return "ok" if n > 0 else "empty"
        except (APIError, httpx.HTTPError) as e:
            return f"failed: {type(e).__name__}"

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, i) for i in range(16)]
        time.sleep(1.0)
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        outcomes = [f.result(timeout=120) for f in futures]  # none hangs
    assert all(o == "ok" or o.startswith("failed") for o in outcomes), outcomes
    assert outcomes.count("ok") >= 8, outcomes  # the other replica kept serving
    # the controller notices the dead replica, starts another, and both serve again
    after: set[str] = set()
    deadline = time.monotonic() + 120
    while len(after - {victim}) < 2 and time.monotonic() < deadline:
        try:
            after.add(_replica_of(base_url))
        except (AssertionError, httpx.HTTPError):
            time.sleep(0.5)
    assert len(after - {victim}) == 2, (victim, after)
    _wait_running(2)


def test_deployment_arguments_are_checked():
    with pytest.raises(ValueError, match="num_replicas"):
        rserve_ray.deployment(num_replicas=0, device="cpu")
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        rserve_ray.deployment(device="cpu", max_ongoing_requests=0)
    with pytest.raises(TypeError, match="no_such_option"):
        rserve_ray.deployment(device="cpu", no_such_option=1)


def test_module_command_line_help():
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "rserve.ray", "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "--num-replicas" in r.stdout and "--max-replicas" in r.stdout
