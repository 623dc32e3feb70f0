"""ASGI middleware in front of the app: _Guard answers only the allowed Host names and
same-origin or allowed (--cors) Origins, against DNS rebinding and cross-site requests
(403); _RequireKey asks every path but /health for the API key (401). host_name and
normalize_origin also check `serve`'s --allowed-host and --cors values. Nothing here
reads a request's body.
"""
from __future__ import annotations

import ipaddress
import secrets
from collections.abc import Iterable

from starlette.datastructures import Headers
from starlette.responses import Response

from .params import ApiError, _show


LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
# The paths answered without the API key (--api-key): the liveness probe only. As
# llama-server, /metrics, /props, /tokenize, /detokenize and /slots need it (they show
# the model, its template and its load); llama-server also leaves its model list open,
# but /v1/models needs the key, as OpenAI's does. An unknown path is refused (401)
# before it is looked up.
PUBLIC_PATHS = frozenset({"/health"})


def host_name(value: str) -> str | None:
    """The name in a Host header value ("name", "name:port", "[v6]:port"), lowercased,
    without brackets, port or a final dot; None if it is not a valid Host value."""
    v = value.strip().lower()
    if v.startswith("["):
        name, sep, rest = v[1:].partition("]")
        if not sep:
            return None
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None
    else:
        name, colon, port = v.partition(":")
        rest = colon + port
    if rest and not (rest[0] == ":" and rest[1:].isdigit() and len(rest) <= 6):
        return None
    name = name[:-1] if name.endswith(".") else name
    if not name or any(c in name for c in " /\\@?#%\t"):
        return None
    return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def normalize_origin(value: str) -> str:
    """An origin as browsers send it, "scheme://host[:port]" lowercased; "*" and "null"
    as they are. ValueError if `value` is not one (a path, a missing scheme, ...)."""
    v = value.strip().lower().rstrip("/")
    if v in ("*", "null"):
        return v
    scheme, sep, netloc = v.partition("://")
    if not sep or scheme not in ("http", "https") or host_name(netloc) is None:
        raise ValueError(f"{value!r} is not an origin: give scheme://host[:port], e.g. "
                         f"http://localhost:3000 (or * for any)")
    return f"{scheme}://{netloc.removesuffix({'http': ':80', 'https': ':443'}[scheme])}"


class _Guard:
    """ASGI middleware against DNS rebinding and cross-site requests (the class of Ollama's
    CVE-2024-28224), outside everything else:

    - Host: a page on evil.example whose name is re-pointed at 127.0.0.1 reaches this
      server with `Host: evil.example`, so only the names in `hosts` are answered (any IP
      literal too when `any_ip`: an address cannot be rebound). The port is not compared:
      an attacker controls the name, not the port, and ssh tunnels change the port.
    - Origin: browsers send it on cross-origin requests (and on every POST). Same-origin
      requests (Origin names the Host) and the origins in `cors` pass; any other is
      refused with 403, so no page elsewhere can start a generation, form-style or not.
      Allowed cross-origin requests get CORS headers, and preflights (OPTIONS) an answer.
    Clients that are not browsers (the openai package, curl) send no Origin."""

    def __init__(self, app, hosts: Iterable[str], any_ip: bool = False,
                 cors: Iterable[str] = ()):
        self.app, self.any_ip = app, any_ip
        self.hosts = {h.strip().lower().strip("[]").rstrip(".") for h in hosts}
        self.cors = {normalize_origin(o) for o in cors}

    def _host_ok(self, value: str) -> bool:
        if "*" in self.hosts:
            return True
        name = host_name(value)
        return name is not None and (name in self.hosts or (self.any_ip and _is_ip(name)))

    def _allowed_hosts(self) -> str:
        names = sorted(f"[{h}]" if ":" in h else h for h in self.hosts)
        return ", ".join(names) + (" and any IP address" if self.any_ip else "")

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        for host in headers.getlist("host"):
            if not self._host_ok(host):
                await ApiError(403, f"this server does not answer to the Host {_show(host)} "
                                    f"(only to {self._allowed_hosts()}): a web page may be "
                                    f"trying to reach it through DNS rebinding. If you use "
                                    f"that name yourself, start the server with "
                                    f"--allowed-host NAME", "Host", "host_not_allowed"
                               ).response_for(scope["path"])(scope, receive, send)
                return
        origin = headers.get("origin")
        allow = None
        if origin is not None:
            try:
                given = normalize_origin(origin)
            except ValueError:
                given = origin
            host = headers.get("host", "").strip().lower()
            same = bool(host) and given.partition("://")[2] == host
            if "*" in self.cors:
                allow = "*"
            elif given in self.cors:
                allow = origin
            elif not same:
                await ApiError(403, f"cross-origin requests from {_show(origin)} are refused; "
                                    f"to let pages there use this server, start it with "
                                    f"--cors {_show(origin)}", "Origin", "origin_not_allowed"
                               ).response_for(scope["path"])(scope, receive, send)
                return
        if scope["method"] == "OPTIONS" and origin is not None \
                and "access-control-request-method" in headers:
            vary = {"Vary": "Origin"}
            if allow:
                vary.update({
                    "Access-Control-Allow-Origin": allow,
                    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                    "Access-Control-Allow-Headers":
                        headers.get("access-control-request-headers", "")[:2000],
                    "Access-Control-Max-Age": "600"})
            await Response(status_code=204, headers=vary)(scope, receive, send)
            return
        if allow is None:
            await self.app(scope, receive, send)
            return

        async def send_with_cors(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [
                    *message.get("headers", []),
                    (b"access-control-allow-origin", allow.encode("latin-1", "replace")),
                    (b"vary", b"Origin")]}
            await send(message)
        await self.app(scope, receive, send_with_cors)


class _RequireKey:
    """ASGI middleware: every path but PUBLIC_PATHS needs the API key, sent as
    `Authorization: Bearer KEY` or as Anthropic's clients send it, `x-api-key: KEY`."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    def _given(self, headers: dict) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        bearer = scheme.lower() == b"bearer" and secrets.compare_digest(token.strip(), self.key)
        return bearer or secrets.compare_digest(headers.get(b"x-api-key", b"").strip(), self.key)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            if not self._given(dict(scope["headers"])):
                error = ApiError(401, "a valid API key is needed: send the header "
                                      "'Authorization: Bearer KEY' (or 'x-api-key: KEY')",
                                 code="invalid_api_key")
                await error.response_for(scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)
