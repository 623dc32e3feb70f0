"""`edgellama serve --ray-replicas N`: copies of the server's app (create_app) as replicas
of one Ray Serve deployment, behind Ray's HTTP proxy: the same OpenAI API.

    app = application(model, load_options, app_options, replicas=N, threads=t,
                      parallel=p, queue_size=q, drafter=None)    # after ray.init
    serve.run(app, name=APP, route_prefix="/")

Each replica is a Ray actor (Replica) that loads the model in its constructor and
compiles its kernels before it takes requests. edgellama.load maps the weights from
files (the GGUF, and its repacked tiles in the cache folder: tile_cache.py), so the
replicas on one node share those pages; each has its own KV caches, slots and engine
thread. Every node runs the proxy; it sends a request to a replica with room
(Ray's max_ongoing_requests: the replica's slots and its queue, what one
`edgellama serve` takes) and holds the rest, at most as many as all N replicas take,
answering 503 beyond that. (It holds every request until a replica is picked, so a
burst the replicas could take is refused if this is any smaller.)

Autoscaling on the requests each replica has (Ray's target_ongoing_requests: its
slots): it starts N, drops towards 1 after ten idle minutes (Ray's downscale delay) and
grows back up to N while requests wait. Ray replaces a replica whose actor dies or whose
health check fails; the requests that replica was running end with a 5xx or a cut
connection, which OpenAI's clients retry (tests/server/test_ray_fleet.py). A replica
being stopped takes no new requests and finishes its running ones for Ray's graceful
shutdown time (20 s); its app's lifespan then closes the engine, ending what is left
with 503 shutting_down.

Ray is an optional dependency (pip install "edgellama[ray]"): only this module imports it.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from ray import serve

import edgellama

from ..kernels import jit
from ..errors import EdgeError
from ..llm import LLM
from ..speculative import Drafter
from .app import create_app
from .engine import DEFAULT_PARALLEL

APP = "edgellama"          # the Serve application's name, and its deployment's

log = logging.getLogger("ray.serve")   # Ray's log: the replica's file and the driver


@serve.ingress()   # the app is built per replica, after the model loads
class Replica:
    """One replica: `edgellama.load(model, **load_options)`, then `drafter(llm)` (the
    speculative decoding the command asked for; None: none), then the app, as
    create_app(llm, **app_options) with that drafter."""

    def __init__(self, model: str, load_options: dict[str, Any], app_options: dict[str, Any],
                 drafter: Callable[[LLM], Drafter | None] | None = None):
        t0 = time.perf_counter()
        if not os.path.isfile(model):
            raise EdgeError(f"{model}: no such file on {socket.gethostname()}; every node "
                            f"that runs a replica needs the GGUF at this path")
        llm = edgellama.load(model, **load_options)
        for warning in llm.warnings:
            log.warning("%s", warning)
        spec = drafter(llm) if drafter is not None else None
        # compiled (or read from Numba's cache) now: a replica is ready once it is fast
        for m in [llm.model] + ([spec.model] if hasattr(spec, "model") else []):
            jit.warm_up(m)
        # not self.app: Ray's ASGI wrapper has a property of that name
        self.http = create_app(llm, drafter=spec, **app_options)
        self.engine = self.http.state.server.engine
        log.info("edgellama replica: %s loaded and compiled in %.1f s, %d slots",
                 llm.path.name, time.perf_counter() - t0, self.engine.parallel)

    def __serve_build_asgi_app__(self):
        return self.http

    def describe(self) -> dict[str, Any]:
        """What the command prints once the replicas run: the model and its slots."""
        server, engine = self.http.state.server, self.engine
        return {"model_id": server.model_id, "ctx": server.llm.ctx,
                "parallel": engine.parallel, "kv_cache_bytes": engine.kv_cache_bytes}

    async def check_health(self) -> None:
        # /health reads counters and answers even with the engine thread stuck or gone;
        # a no-op run on that thread between its steps shows it is alive and turning
        # (after Engine.shutdown it raises: the replica is replaced)
        await asyncio.wrap_future(self.engine.run(lambda: None))


def application(model: str, load_options: dict[str, Any], app_options: dict[str, Any], *,
                replicas: int, threads: int | None, parallel: int | None, queue_size: int,
                drafter: Callable[[LLM], Drafter | None] | None = None):
    """The Serve application of `replicas` replicas of `model` (a path every node has).
    A replica reserves `threads` of Ray's CPUs (None: 1, and it runs edgellama's
    automatic thread count). `parallel`, `queue_size`: each replica's slots and queue
    (app_options gets them too); None slots: the engine's default, which a replica may
    lower where its memory holds fewer KV caches."""
    slots = parallel or DEFAULT_PARALLEL
    deployment = serve.deployment(Replica).options(
        name=APP,
        autoscaling_config={"min_replicas": 1, "initial_replicas": replicas,
                            "max_replicas": replicas, "target_ongoing_requests": slots},
        max_ongoing_requests=slots + queue_size,
        max_queued_requests=replicas * (slots + queue_size),
        ray_actor_options={"num_cpus": threads or 1},
        health_check_period_s=5,
        health_check_timeout_s=30)
    return deployment.bind(model, {**load_options, "threads": threads},
                           {**app_options, "parallel": parallel, "queue_size": queue_size},
                           drafter)
