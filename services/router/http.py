"""A small asyncio HTTP/1.1 server: keep-alive, JSON bodies, chunked streaming responses.

Just enough for the router's OpenAI-compatible API and ``/metrics``: requests are read
whole and strictly (http_read.py: ``Content-Length`` or chunked bodies of at most
``MAX_BODY_BYTES``; a malformed one is answered 4xx and the connection closed); a handler
returns a ``Response`` (sent with ``Content-Length``) or a ``StreamingResponse`` (sent
with ``Transfer-Encoding: chunked``, one HTTP chunk per item, e.g. one SSE event).
Connections stay open between requests unless the client asks to close them.

Connections are a shared resource no client may take whole: a client (its address) holds
at most ``max_per_client``, and the server ``max_connections`` (lowered to fit the
process's file limit). A connection waiting for a request (idle keep-alive, or one that
has not sent its request line yet) is evicted, the longest idle first, to make room for a
new one: the client's own at its limit, anyone's at the server's. Only when every held
connection is serving a request is a new one answered 503 and closed.

A request's ``X-Request-Id`` header is echoed on its response, whatever the response.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from http import HTTPStatus

from services.common.ports import claimed
from services.router.http_read import (
    MAX_BODY_BYTES,
    BadRequest,
    HttpError,
    ReadTimeouts,
    Request,
    read_line,
    read_request,
)

__all__ = [
    "MAX_BODY_BYTES",
    "HttpError",
    "HttpLimits",
    "HttpServer",
    "ReadTimeouts",
    "Request",
    "Response",
    "StreamingResponse",
]

IDLE_TIMEOUT_S = 75.0  # a keep-alive connection with no new request is closed after this
DISCONNECT_POLL_S = 0.2  # how often a running request checks that its client is still there
FD_RESERVE = 256  # file descriptors kept for gRPC, worker channels, logs: not for HTTP clients
log = logging.getLogger(__name__)


@dataclass(slots=True)
class Response:
    status: int = 200
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)

    @classmethod
    def json(cls, payload, status: int = 200) -> Response:
        return cls(status, json.dumps(payload).encode())


@dataclass(slots=True)
class StreamingResponse:
    chunks: AsyncGenerator[bytes, None]  # closed (aclose) when the client goes away
    status: int = 200
    content_type: str = "text/event-stream"
    headers: dict[str, str] = field(default_factory=lambda: {"Cache-Control": "no-cache"})


Handler = Callable[[Request], Awaitable[Response | StreamingResponse]]


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """What the clients may hold of the server: ``max_connections`` in all (at most the
    file limit less FD_RESERVE), ``max_per_client`` of one address (0 = no such limit);
    ``timeouts`` bound a request's headers and body."""

    max_connections: int = 1024
    timeouts: ReadTimeouts = ReadTimeouts()
    max_per_client: int = 256


@dataclass(slots=True)
class _Held:
    """One open connection: whose, and since when it waits for a request (None: serving one)."""

    client: str
    idle_since: float | None


class HttpServer:
    """Serves ``routes``: path -> {method -> handler}; a path ending in ``{name}`` serves
    every path that extends the part before it (slashes included: a model id may hold
    one), and the handler reads the rest off ``request.path``. Unknown paths get 404, other
    methods 405, a HttpError its status and body, any other exception 500. A handler
    still running when its client closes the connection is cancelled (uvicorn's rule:
    the client's EOF is its disconnect, so a client must not half-close)."""

    def __init__(self, routes: dict[str, dict[str, Handler]], limits: HttpLimits | None = None) -> None:
        self.routes = routes
        self.limits = limits or HttpLimits()
        self.max_connections = self.limits.max_connections
        self._server: asyncio.Server | None = None
        self._connections: dict[asyncio.StreamWriter, _Held] = {}

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0 = any free port); returns the port. The connection
        cap is lowered to what the process's file limit leaves (refused cleanly, not EMFILE).
        The port is the server's alone (no ``SO_REUSEPORT``): a busy one raises PortInUse."""
        fit = resource.getrlimit(resource.RLIMIT_NOFILE)[0] - FD_RESERVE
        if 0 < fit < self.max_connections:
            log.warning(
                "HTTP connections capped at %d, not %d: the file limit leaves no more",
                fit,
                self.max_connections,
            )
            self.max_connections = fit
        with claimed("HTTP", host, port):
            self._server = await asyncio.start_server(self._serve_connection, host, port, reuse_port=False)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections):
            writer.close()
        if self._server is not None:
            await self._server.wait_closed()

    async def _serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        held = _Held(str(peer[0]) if peer else "", time.monotonic())
        refusal = self._admit(held.client)
        self._connections[writer] = held
        try:
            if refusal:
                await _send(writer, _error_response(503, refusal), keep_alive=False)
                return
            await self._serve_requests(reader, writer, held)
        except (ConnectionError, asyncio.IncompleteReadError, TimeoutError):
            pass
        finally:
            self._connections.pop(writer, None)
            writer.close()

    def _admit(self, client: str) -> str:
        """Make room for a new connection of ``client`` (evicting an idle one where a limit
        is reached); "" when admitted, else why it is refused."""
        per_client = self.limits.max_per_client
        if per_client and sum(h.client == client for h in self._connections.values()) >= per_client:
            if not self._evict(client):
                return f"connections: this client holds its limit of {per_client}, none idle"
        if len(self._connections) >= self.max_connections and not self._evict(None):
            return f"connections: the server holds its limit of {self.max_connections}, none idle"
        return ""

    def _evict(self, client: str | None) -> bool:
        """Close the longest-idle connection (of ``client``, or anyone's); False if none is idle."""
        idle = [(h.idle_since, w) for w, h in self._connections.items() if h.idle_since is not None]
        idle = [(since, w) for since, w in idle if client is None or self._connections[w].client == client]
        if not idle:
            return False
        _, writer = min(idle, key=lambda pair: pair[0])
        self._connections.pop(writer, None)
        writer.close()
        return True

    async def _serve_requests(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, held: _Held
    ) -> None:
        while True:
            held.idle_since = time.monotonic()
            try:
                request = await _read_request(reader, writer, self.limits.timeouts)
            except BadRequest as e:
                await _send(writer, _error_response(e.status, str(e)), keep_alive=False)
                return
            if request is None:
                return
            held.idle_since = None
            keep_alive = _wants_keep_alive(request)
            response = await self._answer(request, reader, writer)
            head_only = request.method == "HEAD"
            if response is None or not await _send(writer, response, keep_alive, head_only) or not keep_alive:
                return

    async def _answer(self, request: Request, reader, writer) -> Response | StreamingResponse | None:
        """``handle(request)``; None once the client closed the connection meanwhile, the
        handler cancelled (its generation with it)."""
        task = asyncio.ensure_future(self.handle(request))
        gone = asyncio.ensure_future(_client_gone(reader, writer))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not task.done():  # the client left (or this connection is being closed)
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)  # let its cleanup run
        if task.cancelled():
            return None
        return task.result()

    async def handle(self, request: Request) -> Response | StreamingResponse:
        """Answer one request (also usable without a socket, e.g. in tests), its
        X-Request-Id echoed."""
        response = await self._route(request)
        rid = request.headers.get("x-request-id")
        if rid is not None and "X-Request-Id" not in response.headers:
            response.headers["X-Request-Id"] = rid.strip()
        return response

    async def _route(self, request: Request) -> Response | StreamingResponse:
        methods = _route_methods(self.routes, request.path)
        if methods is None:
            return _error_response(404, f"path: no route {request.path}")
        handler = methods.get(request.method) or (methods.get("GET") if request.method == "HEAD" else None)
        if handler is None:
            response = _error_response(405, f"method: {request.method} not allowed on {request.path}")
            allowed = set(methods) | ({"HEAD"} if "GET" in methods else set())
            response.headers["Allow"] = ", ".join(sorted(allowed))
            return response
        try:
            return await handler(request)
        except HttpError as e:
            return Response.json(e.body, e.status)
        except Exception as e:  # a bug in a handler must not kill the connection loop
            return _error_response(500, f"{type(e).__name__}: {e}")


def _route_methods(routes: dict[str, dict[str, Handler]], path: str) -> dict[str, Handler] | None:
    """The methods serving ``path``: its own route, else the first ``.../{name}`` one it extends."""
    if path in routes:
        return routes[path]
    for route, methods in routes.items():
        head, brace, _ = route.partition("{")
        if brace and route.endswith("}") and path.startswith(head) and len(path) > len(head):
            return methods
    return None


def _error_response(status: int, message: str) -> Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return Response.json({"error": {"message": message, "type": kind, "param": None, "code": None}}, status)


def _wants_keep_alive(request: Request) -> bool:
    connection = request.headers.get("connection", "").lower()
    if request.headers.get(":version") == "HTTP/1.0":
        return connection == "keep-alive"
    return connection != "close"


async def _read_request(reader, writer, timeouts: ReadTimeouts) -> Request | None:
    """The next request on the connection; None when the client closed it."""
    line = await asyncio.wait_for(read_line(reader, 414, "request line"), IDLE_TIMEOUT_S)
    if not line:
        return None
    return await read_request(reader, writer, line, timeouts)


async def _client_gone(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Returns once the client closed its side (EOF or a reset), polling the stream."""
    while not (reader.at_eof() or reader.exception() is not None or writer.is_closing()):
        await asyncio.sleep(DISCONNECT_POLL_S)


def _head(status: int, headers: dict[str, str]) -> bytes:
    reason = HTTPStatus(status).phrase if status in HTTPStatus._value2member_map_ else ""
    lines = [f"HTTP/1.1 {status} {reason}"] + [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _send(
    writer: asyncio.StreamWriter,
    response: Response | StreamingResponse,
    keep_alive: bool,
    head_only: bool = False,
) -> bool:
    """Write the response (``head_only``: its status and headers, as a HEAD request gets
    them, the framing headers still those of the body); returns False when the client went
    away meanwhile."""
    headers = {
        "Content-Type": response.content_type,
        **response.headers,
        "Connection": "keep-alive" if keep_alive else "close",
    }
    if isinstance(response, Response):
        headers["Content-Length"] = str(len(response.body))
        writer.write(_head(response.status, headers) + (b"" if head_only else response.body))
        await writer.drain()
        return True
    headers["Transfer-Encoding"] = "chunked"
    writer.write(_head(response.status, headers))
    if head_only:
        await response.chunks.aclose()
        await writer.drain()
        return True
    try:
        async for chunk in response.chunks:
            if chunk:
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True
    except ConnectionError:
        return False
    finally:
        await response.chunks.aclose()
