"""`edgellama serve`: the OpenAI HTTP API (edgellama/server/) on a local port."""
from __future__ import annotations

import ipaddress
import socket

import click

from .main import main
from .options import (FilePath, chat_template_options, drafter_from, load, model_options,
                      one_line, speculative_options)


# More slots than this decode no faster on a CPU (each step reads the weights for all),
# and their caches' memory maps would run into the kernel's limit on maps (65530).
MAX_PARALLEL = 256
# Each waiting request holds a connection: more than this many never wait at once.
MAX_QUEUE = 65536


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
          template_kwargs, draft, lookup, draft_min, draft_max):
    """Serve the model over OpenAI's HTTP API (chat and completions).

    Requests must send JSON bodies with 'Content-Type: application/json' (or none); form
    and text bodies are refused (415), as are requests naming another Host (403) or coming
    from web pages on other origins (403) unless --allowed-host / --cors allow them."""
    import uvicorn

    from edgellama import jit
    from edgellama.server import create_app

    from .progress import KernelProgress

    sock = _listen_socket(host, port)
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
