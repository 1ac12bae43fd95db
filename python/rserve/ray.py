"""Replicas of the in-process engine behind Ray Serve, serving the same OpenAI routes as
``rserve serve`` (``pip install rserve[ray]``)::

    from ray import serve
    import rserve.ray

    app = rserve.ray.deployment("Qwen/Qwen2.5-0.5B-Instruct", num_replicas=2)
    serve.run(app)  # Ray Serve's proxy on http://127.0.0.1:8000/v1

or from a shell: ``python -m rserve.ray MODEL --num-replicas 2 --port 8000``.

Each replica is a Ray actor holding one `rserve.LLM` and the server's router over it
(`Engine.http_app`): requests are parsed, validated, answered and streamed by the same code as the
HTTP server, so errors, tool calls, structured output and server-sent events are identical. Ray
Serve's proxy routes each request to a replica, restarts replicas that die or fail their health
check, and scales their number with `autoscaling_config`. Each replica asks Ray for one GPU
(`num_gpus`) unless it runs on the CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncGenerator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

try:
    import ray
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("rserve.ray needs Ray Serve: pip install 'rserve[ray]'") from e

from rserve.llm import _ENGINE_KWARGS, LLM

if TYPE_CHECKING:
    from ray.serve import Application

    from rserve._core import HttpApp, HttpResponse

__all__ = ["RserveServer", "deployment", "main"]

_POLL_S = 0.05  # how long one wait on the native response holds a worker thread
_END = object()
# hop-by-hop headers, and those the proxy recomputes for the body it sends
_DROP_REQUEST = frozenset({"connection", "keep-alive", "transfer-encoding", "upgrade", "te"})
_DROP_RESPONSE = frozenset({"content-length", "transfer-encoding", "connection"})
#: The response header naming the replica that answered (the name of its Ray actor, in the
#: "serve" namespace).
REPLICA_HEADER = "x-rserve-replica"


def _replica_name() -> str:
    try:
        ctx = serve.get_replica_context()
    except Exception:  # noqa: BLE001 - outside a replica (tests calling the class directly)
        return f"pid-{os.getpid()}"
    rid = getattr(ctx, "replica_id", None)
    full = getattr(rid, "to_full_id_str", None)
    return str(full() if full else getattr(ctx, "replica_tag", None) or os.getpid())


def _next(resp: HttpResponse) -> Any:
    """In a worker thread: one chunk, None on timeout, `_END` at the end."""
    try:
        return resp.next_chunk(_POLL_S)
    except StopIteration:
        return _END


class RserveServer:
    """One replica: an engine loaded in this process and the server's routes over it.

    Ray Serve calls `__call__` with each request (its proxy in front) and `check_health`
    periodically; a replica whose engine stopped is replaced.
    """

    def __init__(
        self,
        model: str | None = None,
        served_model_name: str | None = None,
        api_key: str | None = None,
        tool_call_parser: str | None = None,
        engine_kwargs: Mapping[str, Any] | None = None,
        max_threads: int = 64,
    ) -> None:
        if model is None:
            from rserve._core import default_model

            model, default_name = default_model()
            name = served_model_name or default_name
        else:
            name = served_model_name or model
        self.llm = LLM(model, **dict(engine_kwargs or {}))
        self.app: HttpApp = self.llm._engine.http_app(
            name, api_key=api_key, tool_call_parser=tool_call_parser
        )
        self.replica = _replica_name()
        self._pool = ThreadPoolExecutor(max_workers=max(1, max_threads), thread_name_prefix="rserve-ray")

    async def __call__(self, request: Request) -> Response:
        body = await request.body()
        # the path as the client sent it (still percent-encoded), less Ray's route prefix
        raw = request.scope.get("raw_path")
        path = raw.decode("latin-1") if isinstance(raw, bytes) else request.url.path
        root = request.scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        query = request.scope.get("query_string") or b""
        if query:
            path = f"{path}?{query.decode('latin-1')}"
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _DROP_REQUEST]
        try:
            resp = self.app.start(request.method, path, headers, body)
        except ValueError as e:
            return Response(
                content=json.dumps(
                    {"error": {"message": str(e), "type": "BadRequestError", "param": None, "code": 400}}
                ),
                status_code=400,
                media_type="application/json",
                headers={REPLICA_HEADER: self.replica},
            )
        loop = asyncio.get_running_loop()
        try:
            head = None
            while head is None:
                head = await loop.run_in_executor(self._pool, resp.head, _POLL_S)
        except BaseException:
            resp.close()
            raise
        status, raw = head
        out = {k: v for k, v in raw if k.lower() not in _DROP_RESPONSE}
        out[REPLICA_HEADER] = self.replica
        if out.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(self._chunks(resp), status_code=status, headers=out)
        parts = [c async for c in self._chunks(resp)]
        return Response(content=b"".join(parts), status_code=status, headers=out)

    async def _chunks(self, resp: HttpResponse) -> AsyncGenerator[bytes, None]:
        """The body as it comes; closing early (the client went away) aborts the generation."""
        loop = asyncio.get_running_loop()
        try:
            while True:
                chunk = await loop.run_in_executor(self._pool, _next, resp)
                if chunk is _END:
                    return
                if chunk is not None:
                    yield chunk
        finally:
            resp.close()

    async def check_health(self) -> None:
        """Raises unless `/health` answers 200 within 10 s (Ray Serve then replaces the
        replica); waits in a worker thread, never on the replica's event loop."""
        resp = self.app.start("GET", "/health", [], b"")
        try:
            head = await asyncio.get_running_loop().run_in_executor(self._pool, resp.head, 10.0)
        finally:
            resp.close()
        if head is None or head[0] != 200:
            raise RuntimeError(f"rserve replica unhealthy: /health answered {head and head[0]}")

    def __del__(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.shutdown()


def deployment(
    model: str | None = None,
    *,
    served_model_name: str | None = None,
    num_replicas: int | str | None = 1,
    autoscaling_config: Mapping[str, Any] | None = None,
    num_gpus: float | None = None,
    num_cpus: float | None = None,
    max_ongoing_requests: int = 256,
    api_key: str | None = None,
    tool_call_parser: str | None = None,
    name: str = "rserve",
    **engine_kwargs: Any,
) -> Application:
    """A Ray Serve application of `num_replicas` engines (or as many as `autoscaling_config`
    asks for, e.g. ``{"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 64}``).

    `model` as `LLM` takes it (a directory, GGUF file or hub id; None: the embedded tiny model);
    other keyword arguments go to `LLM` (`max_model_len`, `dtype`, `device`, `isq`, ...).
    `num_gpus` is what each replica asks of Ray: by default 1 (`tensor_parallel_size` with that
    option) unless ``device="cpu"`` or the cluster has no GPU. `max_ongoing_requests` is how many requests Ray hands one replica at once
    (its scheduler batches them); more wait in Ray's queue.
    """
    if max_ongoing_requests < 1:
        raise ValueError("max_ongoing_requests must be at least 1")
    if autoscaling_config is not None:
        num_replicas = None
    elif num_replicas is not None and (not isinstance(num_replicas, int) or num_replicas < 1):
        raise ValueError(f"num_replicas must be a positive integer, got {num_replicas!r}")
    unknown = sorted(set(engine_kwargs) - _LLM_KWARGS)
    if unknown:
        raise TypeError(f"deployment() got unsupported arguments: {', '.join(unknown)}")
    if num_gpus is None:
        on_cpu = str(engine_kwargs.get("device", "auto")) == "cpu"
        # a replica split over N GPUs (tensor_parallel_size) asks Ray for all of them
        num_gpus = 0.0 if on_cpu else _cluster_gpus_default() * int(engine_kwargs.get("tensor_parallel_size", 1))
    actor: dict[str, Any] = {"num_gpus": num_gpus}
    if num_cpus is not None:
        actor["num_cpus"] = num_cpus
    options: dict[str, Any] = {
        "name": name,
        "ray_actor_options": actor,
        "max_ongoing_requests": max_ongoing_requests,
        "health_check_period_s": 10,
        "health_check_timeout_s": 30,
    }
    if autoscaling_config is not None:
        options["autoscaling_config"] = dict(autoscaling_config)
    else:
        options["num_replicas"] = num_replicas
    dep = serve.deployment(RserveServer).options(**options)
    return dep.bind(
        model,
        served_model_name,
        api_key,
        tool_call_parser,
        engine_kwargs,
        min(max_ongoing_requests, 256),
    )


_LLM_KWARGS = _ENGINE_KWARGS | {
    "dtype",
    "device",
    "max_model_len",
    "max_num_seqs",
    "kv_cache_memory",
    "seed",
    "revision",
    "download_dir",
    "hf_token",
}


def _cluster_gpus_default() -> float:
    """1 when the Ray cluster (started here when none is running) has a GPU, else 0."""
    if not ray.is_initialized():
        ray.init(ignore_reinit_error=True, log_to_driver=False)
    return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m rserve.ray",
        description="Serve replicas of rserve behind Ray Serve's HTTP proxy (OpenAI routes).",
    )
    p.add_argument("model", nargs="?", help="a model directory, GGUF file or hub id (default: the embedded model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name")
    p.add_argument("--num-replicas", type=int, default=1)
    p.add_argument("--min-replicas", type=int, help="autoscale between --min-replicas and --max-replicas")
    p.add_argument("--max-replicas", type=int)
    p.add_argument(
        "--target-ongoing-requests", type=float, default=64, help="requests per replica autoscaling aims at"
    )
    p.add_argument("--max-ongoing-requests", type=int, default=256)
    p.add_argument("--num-gpus", type=float, help="GPUs per replica (default: 1 when the cluster has one)")
    p.add_argument("--num-cpus", type=float)
    p.add_argument("--api-key", default=os.environ.get("RSERVE_API_KEY"))
    p.add_argument("--tool-call-parser")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--isq")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs each replica is split over")
    p.add_argument("--address", help="a running Ray cluster (default: RAY_ADDRESS, else a local one)")
    return p


def main(argv: Sequence[str] | None = None) -> None:
    """`python -m rserve.ray`: starts (or joins) Ray, runs the deployment, serves until Ctrl-C."""
    args = _parser().parse_args(argv)
    autoscaling = None
    if args.min_replicas is not None or args.max_replicas is not None:
        lo = args.min_replicas if args.min_replicas is not None else 1
        hi = args.max_replicas if args.max_replicas is not None else max(lo, args.num_replicas)
        if not 0 <= lo <= hi or hi < 1:
            raise SystemExit("--min-replicas must be at most --max-replicas (and --max-replicas at least 1)")
        autoscaling = {
            "min_replicas": lo,
            "max_replicas": hi,
            "target_ongoing_requests": args.target_ongoing_requests,
        }
    engine: dict[str, Any] = {"dtype": args.dtype, "device": args.device, "max_num_seqs": args.max_num_seqs}
    if args.max_model_len is not None:
        engine["max_model_len"] = args.max_model_len
    if args.isq:
        engine["isq"] = args.isq
    if args.tensor_parallel_size != 1:
        engine["tensor_parallel_size"] = args.tensor_parallel_size
    ray.init(address=args.address, ignore_reinit_error=True)
    serve.start(http_options={"host": args.host, "port": args.port})
    app = deployment(
        args.model,
        served_model_name=args.served_model_name,
        num_replicas=args.num_replicas,
        autoscaling_config=autoscaling,
        num_gpus=args.num_gpus,
        num_cpus=args.num_cpus,
        max_ongoing_requests=args.max_ongoing_requests,
        api_key=args.api_key,
        tool_call_parser=args.tool_call_parser,
        **engine,
    )
    serve.run(app, name="rserve", route_prefix="/")
    print(f"rserve: serving on http://{args.host}:{args.port}/v1 through Ray Serve", file=sys.stderr, flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()


if __name__ == "__main__":
    main()
