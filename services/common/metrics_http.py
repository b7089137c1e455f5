"""The ``/metrics`` HTTP endpoint of a process: GET and HEAD (as Prometheus, curl and aiperf
send them), on a daemon thread. HEAD gets GET's status and headers, without the body."""

from __future__ import annotations

import threading
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from services.common.ports import claimed


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 (the base class's name)
        pass


def head_as_get(app):
    """A WSGI app that answers HEAD as ``app`` answers GET, with no body."""

    def wrapped(environ, start_response):
        if environ.get("REQUEST_METHOD") != "HEAD":
            return app(environ, start_response)
        answered = []
        body = b"".join(app({**environ, "REQUEST_METHOD": "GET"}, lambda *a: answered.append(a)))
        status, headers = answered[0][:2]
        if not any(k.lower() == "content-length" for k, _ in headers):
            headers = [*headers, ("Content-Length", str(len(body)))]
        start_response(status, headers)
        return [b""]

    return wrapped


def serve_registry(registry: CollectorRegistry, host: str, port: int) -> int:
    """Serve ``registry`` on ``host:port`` (0 = any free port); returns the port. The port
    is the server's alone (socketserver sets no ``SO_REUSEPORT``): a busy one raises PortInUse."""
    with claimed("metrics", host, port):
        server = make_server(
            host, port, head_as_get(make_wsgi_app(registry)), _ThreadingServer, handler_class=_QuietHandler
        )
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server.server_address[1]
