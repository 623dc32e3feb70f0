"""`edgellama serve`: the OpenAI HTTP API (edgellama/server.py) on a local port."""
from __future__ import annotations

import ipaddress
import socket

import click

from .main import main
from .options import load, model_options, one_line


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


@main.command()
@model_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0: every interface).")
@click.option("--port", type=click.IntRange(0, 65535), default=8080, show_default=True,
              help="TCP port; 0 picks a free one (printed at start).")
@click.option("--api-key", envvar="EDGELLAMA_API_KEY", default=None,
              help="Require 'Authorization: Bearer KEY' on /v1 (or set EDGELLAMA_API_KEY, "
                   "which other users cannot read from the process list).")
@click.option("--queue", "queue_size", type=click.IntRange(min=0), default=16, show_default=True,
              help="Requests that may wait while one runs; more are answered 503.")
def serve(model, ctx, threads, host, port, api_key, queue_size):
    """Serve the model over OpenAI's HTTP API (chat and completions)."""
    import uvicorn

    from edgellama import jit
    from edgellama.server import create_app

    from .progress import KernelProgress

    sock = _listen_socket(host, port)
    progress = KernelProgress()
    with jit.Compiling(progress) as loading:
        llm = load(model, ctx, threads)
    warm = jit.warm_up(llm.model, progress)
    progress.done(loading.count + warm.compiled, loading.seconds + warm.compile_seconds)
    app = create_app(llm, api_key=api_key or None, queue_size=queue_size)
    server = app.state.server
    if not api_key and not _is_local(sock):
        click.echo(f"warning: listening on {host} without --api-key: anyone who can reach "
                   f"this port can use the model", err=True)
    sock.listen(128)
    bound = sock.getsockname()
    address = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
    click.echo(f"serving {one_line(server.model_id)} (ctx {llm.ctx}, queue {queue_size}) on "
               f"http://{address}:{bound[1]}/v1", err=True)
    config = uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=3,
                            timeout_keep_alive=30)
    uvicorn.Server(config).run(sockets=[sock])
