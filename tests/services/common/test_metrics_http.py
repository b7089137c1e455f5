"""A process's /metrics endpoint answers HEAD as GET without the body, over one keep-alive
connection of a real client (http.client)."""

from __future__ import annotations

import http.client

from prometheus_client import CollectorRegistry, Counter

from services.common.metrics_http import serve_registry


def test_head_and_get_on_metrics_over_one_connection():
    registry = CollectorRegistry()
    Counter("tandem_probe", "probe", registry=registry).inc(3)
    port = serve_registry(registry, "127.0.0.1", 0)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    answers = []
    for method in ("HEAD", "GET", "HEAD", "GET"):
        connection.request(method, "/metrics")
        response = connection.getresponse()
        answers.append((method, response.status, response.getheader("Content-Length"), response.read()))
    connection.close()
    get_body = answers[1][3]
    assert b"tandem_probe_total 3.0" in get_body
    assert (
        answers
        == [
            ("HEAD", 200, str(len(get_body)), b""),
            ("GET", 200, str(len(get_body)), get_body),
        ]
        * 2
    )
