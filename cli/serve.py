"""`edgellama serve`: the OpenAI HTTP API (edgellama/server/) on a local port."""
from __future__ import annotations

import functools
import ipaddress
import re
import signal
import socket
import time
from pathlib import Path

import click

from .main import main
from .options import (FilePath, chat_template_options, drafter_from, load, model_options,
                      one_line, speculative_options)


# More slots than this decode no faster on a CPU (each step reads the weights for all),
# and their caches' memory maps would run into the kernel's limit on maps (65530).
MAX_PARALLEL = 256
# Each waiting request holds a connection: more than this many never wait at once.
MAX_QUEUE = 65536
# Replicas one command runs on Ray Serve (--ray-replicas): a fleet, not a cluster's worth.
MAX_REPLICAS = 64


def _listen_socket(host: str, port: int) -> socket.socket:
    """A bound socket, made before the model loads: a taken port fails in a second, not
    after the load. Connections wait in its backlog until the server runs."""
    from edgellama.errors import EdgeError
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as e:
        raise EdgeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise EdgeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _is_local(sock: socket.socket) -> bool:
    return ipaddress.ip_address(sock.getsockname()[0].split("%")[0]).is_loopback


def _host_names(ctx, param, values: tuple[str, ...]) -> list[str]:
    from edgellama.server import host_name
    names = []
    for v in values:
        name = "*" if v.strip() == "*" else host_name(v)
        if name is None:
            raise click.BadParameter(f"{v!r} is not a host name or address", ctx, param)
        names.append(name)
    return names


def _origins(ctx, param, values: tuple[str, ...]) -> list[str]:
    from edgellama.server import normalize_origin
    try:
        return [normalize_origin(v) for v in values]
    except ValueError as e:
        raise click.BadParameter(str(e), ctx, param) from None


def _ray_serve(ctx, param, value):
    """--ray-replicas needs Ray Serve: checked as the option is read, before a model
    downloads."""
    if value is not None:
        try:
            import ray.serve  # noqa: F401
        except ImportError as e:
            from edgellama.errors import EdgeError
            raise EdgeError(f"--ray-replicas needs Ray Serve, which does not import ({e}): "
                            f"pip install \"edgellama[ray]\"") from None
    return value


def _accepted_hosts(host: str, sock: socket.socket, extra: list[str]) -> tuple[list[str], bool]:
    """The Host names the server answers to, and whether any IP address is one: loopback
    names, the address it is bound to (and the --host name it was given); bound to every
    interface (0.0.0.0, ::), any IP address and this machine's name; plus --allowed-host."""
    from edgellama.server import LOOPBACK_HOSTS, host_name
    bound = ipaddress.ip_address(sock.getsockname()[0].split("%")[0])
    names = [*LOOPBACK_HOSTS, str(bound)]
    given = host_name(host)
    if given:
        names.append(given)
    if bound.is_unspecified:
        machine = socket.gethostname().lower()
        names += [machine, f"{machine.partition('.')[0]}.local"] if machine else []
    names += extra
    return list(dict.fromkeys(names)), bound.is_unspecified


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="TCP port; 0 picks a free one (printed at start).")
@click.option("--ray-replicas", type=click.IntRange(1, MAX_REPLICAS), default=None,
              metavar="N", callback=_ray_serve,
              help="Run the server as up to N replicas on Ray Serve (pip install "
                   "\"edgellama[ray]\"), behind Ray's HTTP proxy at --host/--port with the "
                   "same API: each replica loads the model (one mapped copy of the file a "
                   "node) and reserves -t CPUs (default 1); the fleet starts at N and scales "
                   f"between 1 and N on the requests waiting. At most {MAX_REPLICAS}.")
@click.option("--ray-address", metavar="ADDRESS", default=None,
              help="With --ray-replicas: the Ray cluster to join (HOST:6379, where `ray "
                   "start --head` ran). Default: the one `ray start` runs on this machine, "
                   "else a new local one that stops with the command.")
@click.option("--api-key", envvar="EDGELLAMA_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on every path but /health (or set "
                   "EDGELLAMA_API_KEY, which other users cannot read from the process list).")
@click.option("--parallel", type=click.IntRange(min=1, max=MAX_PARALLEL), default=None,
              help="Requests that run at once, each in a slot with its own KV cache, decoded "
                   "together in one pass over the weights. Default: 4, fewer if the "
                   "available memory does not hold that many full-context KV caches; at "
                   f"most {MAX_PARALLEL}.")
@click.option("--queue", "queue_size", type=click.IntRange(0, MAX_QUEUE), default=16,
              show_default=True,
              help="Requests that may wait while all slots are busy; more are answered 503 "
                   f"(at most {MAX_QUEUE}).")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME",
              callback=_host_names,
              help="Also answer requests whose Host header is NAME (repeatable; * = any "
                   "name). By default only localhost, 127.0.0.1, [::1] and the --host "
                   "address are answered (bound to 0.0.0.0 or ::, also any IP address and "
                   "this machine's name): other names are refused (403), against DNS "
                   "rebinding. Give the names clients and proxies use to reach the server.")
@click.option("--cors", "cors", multiple=True, metavar="ORIGIN", callback=_origins,
              help="Let web pages at ORIGIN (e.g. http://localhost:3000; * = any) call the "
                   "API from a browser, with CORS headers (repeatable). Without it every "
                   "request that a page on another origin sends is refused (403).")
@click.option("--slot-save-path", type=FilePath(file_okay=False), default=None, metavar="DIR",
              help="A folder for slots' caches: POST /slots/ID?action=save|restore with "
                   "{\"filename\": NAME} writes or reads slot ID's KV cache as DIR/NAME "
                   "(action=erase clears it), and a conversation evicted from a slot is "
                   "spilled there and restored when it comes back (see --slot-spill-max).")
@click.option("--slot-spill-max", type=click.IntRange(min=0), default=2048, show_default=True,
              metavar="MIB", help="With --slot-save-path: the most the spilled caches of "
              "evicted conversations take in DIR, least recently used removed first; 0: "
              "no spill.")
@click.option("--metrics", is_flag=True,
              help="Serve GET /metrics: the server's counters in Prometheus' text format, "
                   "under llama-server's names (llamacpp:prompt_tokens_total, ...). Off by "
                   "default, as in llama-server.")
@click.option("--reasoning-format", type=click.Choice(["deepseek", "none"]), default="deepseek",
              show_default=True,
              help="deepseek: a chat reply's <think> block (Qwen 3, DeepSeek R1) is sent as "
                   "message.reasoning_content (delta.reasoning_content when streamed), apart "
                   "from its content; none: all of the reply is content.")
@chat_template_options
@speculative_options
def serve(model, ctx, threads, activations, cache_type_k, cache_type_v, host, port, api_key, parallel, queue_size,
          allowed_hosts, cors, slot_save_path, slot_spill_max, metrics, reasoning_format,
          template_kwargs, draft, lookup, draft_min, draft_max,
          ray_replicas, ray_address):
    """Serve the model over OpenAI's HTTP API (chat and completions).

    Requests must send JSON bodies with 'Content-Type: application/json' (or none); form
    and text bodies are refused (415), as are requests naming another Host (403) or coming
    from web pages on other origins (403) unless --allowed-host / --cors allow them."""
    import uvicorn

    from edgellama.kernels import jit
    from edgellama.server import create_app

    from .progress import KernelProgress

    if ray_replicas is None and ray_address is not None:
        raise click.UsageError("--ray-address needs --ray-replicas")
    if ray_replicas is not None and port == 0:
        raise click.UsageError("--ray-replicas needs a --port: Ray's proxy listens on the "
                               "same port on every node, so it cannot pick a free one")
    if ray_replicas is not None and slot_save_path is not None:
        raise click.UsageError("--slot-save-path does not work with --ray-replicas: a "
                               "request may reach any replica, and a slot saved on one is "
                               "not on the others")
    sock = _listen_socket(host, port)
    if ray_replicas is not None:
        hosts, any_ip = _accepted_hosts(host, sock, allowed_hosts)
        if not api_key and not _is_local(sock):
            click.echo(f"warning: listening on {host} without --api-key: anyone who can "
                       f"reach this port can use the model", err=True)
        sock.close()   # checked free; Ray's proxy listens there
        load_options = {"ctx": ctx, "activations": activations,
                        "cache_type_k": cache_type_k, "cache_type_v": cache_type_v,
                        "chat_template_kwargs": template_kwargs}
        app_options = {"api_key": api_key or None, "allowed_hosts": hosts,
                       "any_ip_host": any_ip, "cors": cors, "metrics": metrics,
                       "reasoning_format": reasoning_format}
        drafter = None
        if draft is not None or lookup:   # built on each replica; the file found here
            from .options import resolve_model
            drafter = functools.partial(
                drafter_from, lookup=lookup, draft_min=draft_min, draft_max=draft_max,
                draft=draft and str(Path(resolve_model(draft, None, None)).resolve()))
        return _serve_on_ray(str(Path(model).resolve()), ray_replicas, ray_address, host,
                             port, threads, parallel, queue_size, load_options, app_options,
                             drafter)
    progress = KernelProgress()
    with jit.Compiling(progress) as loading:
        llm = load(model, ctx, threads, activations, cache_type_k, cache_type_v)
        llm.chat.template_kwargs = template_kwargs   # a request's chat_template_kwargs win
        drafter = drafter_from(llm, draft, lookup, draft_min, draft_max)
    warms = [jit.warm_up(m, progress)
             for m in [llm.model] + ([drafter.model] if hasattr(drafter, "model") else [])]
    progress.done(loading.count + sum(w.compiled for w in warms),
                  loading.seconds + sum(w.compile_seconds for w in warms))
    hosts, any_ip = _accepted_hosts(host, sock, allowed_hosts)
    app = create_app(llm, api_key=api_key or None, queue_size=queue_size,
                     allowed_hosts=hosts, any_ip_host=any_ip, cors=cors, parallel=parallel,
                     drafter=drafter, slot_save_path=slot_save_path,
                     slot_spill_max=slot_spill_max << 20, metrics=metrics,
                     reasoning_format=reasoning_format)
    server = app.state.server
    if not api_key and not _is_local(sock):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   f"this port can use the model", err=True)
    sock.listen(128)
    bound = sock.getsockname()
    address = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    engine = server.engine
    click.echo(f"{engine.parallel} slot{'s' if engine.parallel > 1 else ''} of ctx {llm.ctx}: "
               f"KV cache up to {engine.kv_cache_bytes / 2**20:.0f} MiB "
               f"({engine.kv_cache_bytes / engine.parallel / 2**20:.0f} MiB a slot, mapped as "
               f"it fills)", err=True)
    click.echo(f"serving {one_line(server.model_id)} (ctx {llm.ctx}, parallel "
               f"{engine.parallel}, queue {queue_size}) on http://{address}:{bound[1]}/v1",
               err=True)
    if drafter is not None:
        name = f" {one_line(drafter.model.gguf.path.name)}" if hasattr(drafter, "model") else ""
        click.echo(f"speculative decoding: {drafter.name}{name}, {drafter.draft_min}..{drafter.draft_max} "
                   f"tokens a step where it pays (usage reports accepted_prediction_tokens)",
                   err=True)
    if engine.files is not None:
        spill = f"; evicted conversations spilled there, up to {slot_spill_max} MiB" \
            if slot_spill_max else ""
        click.echo(f"slot files: {one_line(str(engine.files.folder))} (POST /slots/ID)"
                   f"{spill}", err=True)
    shown = ", ".join(f"[{h}]" if ":" in h else h for h in hosts)
    click.echo(f"answering Host {shown}{' and any IP address' if any_ip else ''}"
               f"{'; cross-origin pages: ' + ', '.join(cors) if cors else ''}", err=True)

    class Uvicorn(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # Before uvicorn waits for open requests: the waiting and running ones end
            # now with 503 shutting_down (streams with that error and [DONE]).
            server.engine.shutdown()
            await super().shutdown(sockets)

    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3,
                            timeout_keep_alive=30)
    Uvicorn(config).run(sockets=[sock])


def _replica_failure(status: str) -> str | None:
    """The exception a replica's constructor raised, from the traceback in Serve's
    status of its deployment: an EdgeError's message as is, another with its name."""
    raised = re.findall(r"^([\w.]*\w(?:Error|Exception)): (.+)$", status, re.MULTILINE)
    raised = [(name, text) for name, text in raised
              if text != "Traceback (most recent call last):"]   # Ray's wrapper
    if not raised:
        return None
    name, text = raised[-1]
    return text if name.endswith(".EdgeError") else f"{name.rpartition('.')[2]}: {text}"


def _serve_on_ray(model: str, replicas: int, address: str | None, host: str, port: int,
                  threads: int | None, parallel: int | None, queue_size: int,
                  load_options: dict, app_options: dict, drafter) -> None:
    """`replicas` replicas of `model` (edgellama/server/fleet.py) on the Ray cluster at
    `address` (None: Ray's default), its proxy at host:port, until Ctrl-C or SIGTERM;
    then the application is deleted (a cluster this command started stops with it)."""
    import ray
    from ray import serve as ray_serve
    from ray.serve.exceptions import RayServeException

    from edgellama.errors import EdgeError
    from edgellama.server import fleet

    try:
        ray.init(address=address)
    except (ConnectionError, ValueError) as e:
        raise EdgeError(f"cannot join the Ray cluster at {address}: {e}") from None
    # SIGTERM as Ctrl-C (after ray.init, which sets its own): the replicas are Ray's
    # actors, and outlive this process unless it deletes them
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        cpus = ray.cluster_resources().get("CPU", 0)
        if replicas * (threads or 1) > cpus:
            click.echo(f"warning: {replicas} replicas of {threads or 1} CPU"
                       f"{'s' if (threads or 1) > 1 else ''} need {replicas * (threads or 1)}, "
                       f"and the Ray cluster has {cpus:g}: the rest wait for CPUs to join",
                       err=True)
        ray_serve.start(http_options={"host": host, "port": port})
        try:
            handle = ray_serve.run(fleet.application(
                model, load_options, app_options, replicas=replicas, threads=threads,
                parallel=parallel, queue_size=queue_size, drafter=drafter),
                name=fleet.APP, route_prefix="/")
        except RuntimeError as e:   # a replica's constructor failed (Ray retried it)
            app = ray_serve.status().applications.get(fleet.APP)
            why = _replica_failure(app.deployments[fleet.APP].message if app else "") or e
            ray_serve.delete(fleet.APP)
            raise EdgeError(f"the replicas did not start: {why}") from None
        about = handle.describe.remote().result(timeout_s=60)
        shown = f"[{host}]" if ":" in host else host
        click.echo(f"{replicas} replica{'s' if replicas > 1 else ''} on Ray "
                   f"({ray.get_runtime_context().gcs_address}), {about['parallel']} slot"
                   f"{'s' if about['parallel'] > 1 else ''} each of ctx {about['ctx']}: "
                   f"KV cache up to {about['kv_cache_bytes'] / 2**20:.0f} MiB a replica",
                   err=True)
        click.echo(f"serving {one_line(about['model_id'])} (ctx {about['ctx']}, parallel "
                   f"{about['parallel']}, queue {queue_size}, replicas 1..{replicas}) on "
                   f"http://{shown}:{port}/v1", err=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("stopping the replicas", err=True)
        try:
            ray_serve.delete(fleet.APP)
        except RayServeException:   # interrupted before Serve started: nothing to delete
            pass
    finally:
        ray.shutdown()
