"""The router's small HTTP/1.1 server, over a real loopback socket."""

from __future__ import annotations

import asyncio
import http.client
import json
import resource
import time

from services.router.http import HttpError, HttpLimits, HttpServer, ReadTimeouts, Response, StreamingResponse


async def _echo(request):
    return Response.json(
        {"method": request.method, "path": request.path, "query": request.query, "body": request.json()}
    )


async def _refuse(request):
    raise HttpError(400, {"error": {"param": "x"}})


async def _crash(request):
    raise RuntimeError("boom")


async def _stream(request):
    async def chunks():
        for word in (b"one", b"two", b"three"):
            yield word

    return StreamingResponse(chunks())


ROUTES = {
    "/echo": {"POST": _echo},
    "/refuse": {"GET": _refuse},
    "/crash": {"GET": _crash},
    "/stream": {"GET": _stream},
}


async def _exchange(raw: bytes, reads: int = 1) -> bytes:
    """Send ``raw`` to a fresh server; read until the server closes or ``reads`` replies."""
    server = HttpServer(ROUTES)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    await writer.drain()
    data = b""
    try:
        while data.count(b"HTTP/1.1 ") < reads or not _complete(data):
            chunk = await asyncio.wait_for(reader.read(65536), 10)
            if not chunk:
                break
            data += chunk
    finally:
        writer.close()
        await server.close()
    return data


def _complete(data: bytes) -> bool:
    head, sep, body = data.rpartition(b"HTTP/1.1 ")[2].partition(b"\r\n\r\n")
    if not sep:
        return False
    if b"Transfer-Encoding: chunked" in head:
        return body.endswith(b"0\r\n\r\n")
    length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
    return len(body) >= length


def _run(raw: bytes, reads: int = 1) -> bytes:
    return asyncio.run(_exchange(raw, reads))


def _post(path: str, body: bytes, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def test_a_json_request_is_echoed_with_content_length():
    reply = _run(_post("/echo?a=1", b'{"k": [1, 2]}'))
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert b"Content-Type: application/json" in head and b"Connection: keep-alive" in head
    assert json.loads(body) == {"method": "POST", "path": "/echo", "query": "a=1", "body": {"k": [1, 2]}}


def test_two_requests_share_one_keep_alive_connection():
    reply = _run(_post("/echo", b"1") + _post("/echo", b"2", "Connection: close\r\n"), reads=2)
    first, second = reply.split(b"HTTP/1.1 ")[1:]
    assert first.endswith(b'"body": 1}') and b"Connection: keep-alive" in first
    assert second.endswith(b'"body": 2}') and b"Connection: close" in second


def test_a_streaming_response_is_sent_chunked():
    reply = _run(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head and b"Content-Type: text/event-stream" in head
    assert body == b"3\r\none\r\n3\r\ntwo\r\n5\r\nthree\r\n0\r\n\r\n"


def test_a_chunked_request_body_is_reassembled():
    raw = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\n[1,\r\n2\r\n2]\r\n0\r\n\r\n"
    )
    assert json.loads(_run(raw).partition(b"\r\n\r\n")[2])["body"] == [1, 2]


def test_expect_100_continue_is_answered_before_the_body():
    reply = _run(_post("/echo", b"7", "Expect: 100-continue\r\n"), reads=2)
    assert reply.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")


def _status_and_error(reply: bytes) -> tuple[int, dict]:
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def test_unknown_path_is_404_and_wrong_method_405_naming_the_allowed_ones():
    status, body = _status_and_error(_run(b"GET /nope HTTP/1.1\r\n\r\n"))
    assert status == 404 and body["error"]["message"] == "path: no route /nope"
    reply = _run(b"GET /echo HTTP/1.1\r\n\r\n")
    assert _status_and_error(reply)[0] == 405 and b"Allow: POST" in reply


def test_invalid_json_is_a_400_naming_the_body():
    status, body = _status_and_error(_run(_post("/echo", b"{nope")))
    assert status == 400 and body["error"]["param"] == "body"
    assert body["error"]["type"] == "invalid_request_error"


def test_handler_errors_become_their_status_or_500():
    assert _status_and_error(_run(b"GET /refuse HTTP/1.1\r\n\r\n")) == (400, {"error": {"param": "x"}})
    status, body = _status_and_error(_run(b"GET /crash HTTP/1.1\r\n\r\n"))
    assert status == 500 and body["error"]["message"] == "RuntimeError: boom"


def test_a_malformed_request_line_is_answered_400_and_closed():
    reply = _run(b"HELLO\r\n\r\n")
    status, body = _status_and_error(reply)
    assert status == 400 and body["error"]["message"].startswith("request line:")
    assert b"Connection: close" in reply


def test_an_oversized_body_is_refused_413():
    raw = b"POST /echo HTTP/1.1\r\nContent-Length: 999999999\r\n\r\n"
    assert _status_and_error(_run(raw))[0] == 413


# ---------------------------------------------------------------------- limits


async def _slow_client(limits: HttpLimits, raw: bytes) -> tuple[bytes, float]:
    """Send ``raw`` and no more; the server's answer and how long it took."""
    server = HttpServer(ROUTES, limits)
    port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    start = time.monotonic()
    try:
        return await asyncio.wait_for(reader.read(65536), 10), time.monotonic() - start
    finally:
        writer.close()
        await server.close()


SHORT = HttpLimits(timeouts=ReadTimeouts(headers_s=0.3, body_s=0.3))


def test_headers_not_sent_in_time_are_a_408_and_the_connection_closes():
    reply, took = asyncio.run(_slow_client(SHORT, b"POST /echo HTTP/1.1\r\nHost: x\r\n"))
    status, body = _status_and_error(reply)
    assert (status, body["error"]["message"]) == (408, "headers: not received within 0.3 s")
    assert b"Connection: close" in reply and 0.3 <= took < 2


def test_a_body_not_sent_in_time_is_a_408():
    reply, _ = asyncio.run(_slow_client(SHORT, _post("/echo", b"[1, 2]")[:-3]))
    status, body = _status_and_error(reply)
    assert (status, body["error"]["message"]) == (408, "body: not received within 0.3 s")


def _blocked_routes(release: asyncio.Event) -> dict:
    async def slow(request):
        await release.wait()
        return Response.json({"done": True})

    return {**ROUTES, "/slow": {"GET": slow}}


async def _connect(port: int, client: str = "127.0.0.1"):
    """A connection from ``client`` (any 127.x address: loopback on Linux)."""
    return await asyncio.open_connection("127.0.0.1", port, local_addr=(client, 0))


async def _get(reader, writer, path: str = "/refuse") -> bytes:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
    await writer.drain()
    data = b""
    while not _complete(data):
        chunk = await asyncio.wait_for(reader.read(65536), 10)
        if not chunk:
            break
        data += chunk
    return data


def test_connections_over_the_cap_are_answered_503_when_none_is_idle():
    async def scenario():
        release = asyncio.Event()
        server = HttpServer(_blocked_routes(release), HttpLimits(max_connections=1))
        port = await server.start("127.0.0.1", 0)
        busy = await _connect(port)
        busy[1].write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        reader, writer = await _connect(port, "127.0.0.2")
        reply = await asyncio.wait_for(reader.read(65536), 10)
        release.set()
        for w in (busy[1], writer):
            w.close()
        await server.close()
        return reply

    status, body = _status_and_error(asyncio.run(scenario()))
    assert (status, body["error"]["message"]) == (
        503,
        "connections: the server holds its limit of 1, none idle",
    )


def test_idle_connections_make_room_for_a_new_client_longest_idle_first():
    """A client holding every connection idle (keep-alive, or never sending a request)
    locked everyone else out for 70 s; now the longest-idle one is closed for a newcomer."""

    async def scenario():
        server = HttpServer(ROUTES, HttpLimits(max_connections=3, max_per_client=0))
        port = await server.start("127.0.0.1", 0)
        hog = [await _connect(port) for _ in range(3)]
        for r, w in hog[1:]:  # two served once, then idle; the first never sent anything
            await _get(r, w)
        newcomer = await _get(*await _connect(port, "127.0.0.2"))
        evicted = await asyncio.wait_for(hog[0][0].read(), 5)  # EOF: closed for the newcomer
        kept = await _get(*hog[2])
        await server.close()
        return newcomer, evicted, kept

    newcomer, evicted, kept = asyncio.run(scenario())
    assert newcomer.startswith(b"HTTP/1.1 400") and evicted == b"" and kept.startswith(b"HTTP/1.1 400")


def test_one_client_holds_at_most_its_share_and_others_are_served():
    async def scenario():
        release = asyncio.Event()
        server = HttpServer(_blocked_routes(release), HttpLimits(max_connections=8, max_per_client=2))
        port = await server.start("127.0.0.1", 0)
        busy = [await _connect(port) for _ in range(2)]
        for _, w in busy:
            w.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.1)
        third = await _connect(port)
        refused = await asyncio.wait_for(third[0].read(65536), 10)
        other = await _get(*await _connect(port, "127.0.0.2"))
        release.set()
        await server.close()
        return refused, other

    refused, other = asyncio.run(scenario())
    status, body = _status_and_error(refused)
    assert (status, body["error"]["message"]) == (
        503,
        "connections: this client holds its limit of 2, none idle",
    )
    assert other.startswith(b"HTTP/1.1 400")  # served (the route answers 400 by design)


def test_the_cap_fits_the_file_limit():
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    async def scenario():
        server = HttpServer(ROUTES, HttpLimits(max_connections=10**9))
        await server.start("127.0.0.1", 0)
        await server.close()
        return server.max_connections

    fit = soft - 256
    assert asyncio.run(scenario()) == (fit if 0 < fit < 10**9 else 10**9)


def test_a_client_that_leaves_cancels_its_running_handler():
    cancelled = asyncio.Event()

    async def forever(request):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def scenario():
        server = HttpServer({"/wait": {"GET": forever}})
        port = await server.start("127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.wait_for(cancelled.wait(), 2)
        await server.close()

    asyncio.run(scenario())


def _keep_alive_exchanges(requests: list[tuple[str, str]]) -> list[tuple[int, dict, bytes]]:
    """Run ``requests`` (method, path) in order over one keep-alive connection of
    http.client, a real client that frames each answer by the request's method."""
    server = HttpServer(ROUTES | {"/metrics": {"GET": _metrics}})
    answers = []

    async def scenario():
        port = await server.start("127.0.0.1", 0)

        def client():
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            for method, path in requests:
                connection.request(method, path)
                response = connection.getresponse()
                answers.append((response.status, dict(response.getheaders()), response.read()))
            connection.close()

        try:
            await asyncio.to_thread(client)
        finally:
            await server.close()

    asyncio.run(scenario())
    return answers


async def _metrics(request):
    return Response(200, b"tandem_up 1\n", "text/plain; version=0.0.4")


def test_head_answers_a_gets_headers_without_its_body_and_the_connection_stays_usable():
    answers = _keep_alive_exchanges(
        [
            ("HEAD", "/metrics"),
            ("GET", "/metrics"),
            ("HEAD", "/nowhere"),
            ("HEAD", "/echo"),
            ("GET", "/metrics"),
        ]
    )
    (head, head_headers, head_body), (get, get_headers, get_body) = answers[:2]
    assert (head, head_body, head_headers["Content-Length"]) == (200, b"", "12")
    assert (get, get_body, get_headers["Content-Length"]) == (200, b"tandem_up 1\n", "12")
    assert [(status, body) for status, _, body in answers[2:]] == [
        (404, b""),
        (405, b""),
        (200, b"tandem_up 1\n"),
    ]
    assert answers[3][1]["Allow"] == "POST"
