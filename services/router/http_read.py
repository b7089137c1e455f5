"""Reading one HTTP/1.1 request off a connection, strictly: what is not a request this
server accepts is a ``BadRequest`` (status, message naming the part at fault), answered
and the connection closed, never an exception that drops it.

Limits: the headers within ``ReadTimeouts.headers_s`` of the request line, the body
within ``body_s`` after them (408); a request line or header line of at most 64 KiB (the
stream's limit; 414 / 431), at most ``MAX_HEADERS`` headers (431), a body of at most
``MAX_BODY_BYTES`` (413), sent with a ``Content-Length`` of decimal digits or
``Transfer-Encoding: chunked`` with hex chunk sizes, each chunk ending in CRLF (400
otherwise); other transfer codings are 501.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from services.router import json_body

MAX_BODY_BYTES = 4 << 20  # a 128K-token prompt is under 1 MiB of JSON; every held body counts
MAX_HEADERS = 100
_DIGITS = re.compile(rb"[0-9]+")
_HEX = re.compile(rb"[0-9a-fA-F]+")


class HttpError(Exception):
    """Ends a request with ``status``; ``body`` is sent as JSON."""

    def __init__(self, status: int, body: dict) -> None:
        super().__init__(body)
        self.status = status
        self.body = body


class BadRequest(Exception):
    """The bytes on the wire are not an HTTP/1.1 request we accept: answer and close."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Request:
    method: str
    path: str  # without the query string
    query: str
    headers: dict[str, str]  # names lower-cased
    body: bytes = b""

    def json(self):
        """The body parsed as JSON (json_body.parse); raises HttpError(400) naming ``body``
        or the bad string's path when it is not acceptable."""
        try:
            return json_body.parse(self.body)
        except json_body.JsonError as e:
            error = {"message": str(e), "type": "invalid_request_error", "param": e.param, "code": None}
            raise HttpError(400, {"error": error}) from None


async def read_line(reader: asyncio.StreamReader, status: int, what: str) -> bytes:
    """One line; over the stream's limit it is a ``BadRequest(status)`` naming ``what``."""
    try:
        return await reader.readline()
    except ValueError:  # asyncio's LimitOverrunError, re-raised by readline
        raise BadRequest(status, f"{what}: too long") from None


@dataclass(frozen=True, slots=True)
class ReadTimeouts:
    """Seconds a client has, after its request line, to send all its headers, then its
    whole body; past either the request is answered 408 and the connection closed."""

    headers_s: float = 30.0
    body_s: float = 60.0  # 4 MiB in 60 s: a client slower than 70 KB/s cannot send the cap


async def read_request(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, line: bytes, timeouts: ReadTimeouts
) -> Request:
    """The request whose request line is ``line``, headers and body read in time."""
    parts = line.decode("latin-1").strip().split()
    if len(parts) != 3 or parts[2] not in ("HTTP/1.0", "HTTP/1.1"):
        raise BadRequest(400, "request line: expected 'METHOD /path HTTP/1.1'")
    method, target, version = parts
    headers = await _within(read_headers(reader), timeouts.headers_s, "headers")
    headers[":version"] = version
    url = urlsplit(target)
    request = Request(method.upper(), url.path, url.query, headers)
    if headers.get("expect", "").lower() == "100-continue":
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    request.body = await _within(_read_body(reader, headers), timeouts.body_s, "body")
    return request


async def _within(read, seconds: float, what: str):
    try:
        return await asyncio.wait_for(read, seconds)
    except TimeoutError:
        raise BadRequest(408, f"{what}: not received within {seconds:g} s") from None


async def read_headers(reader: asyncio.StreamReader) -> dict[str, str]:
    headers: dict[str, str] = {}
    for _ in range(MAX_HEADERS + 1):
        line = await read_line(reader, 431, "headers: a header line")
        if line in (b"\r\n", b"\n", b""):
            return headers
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep:
            raise BadRequest(400, f"headers: malformed line {line[:40]!r}")
        headers[name.strip().lower()] = value.strip()
    raise BadRequest(431, f"headers: more than {MAX_HEADERS}")


async def _read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    coding = headers.get("transfer-encoding", "").strip().lower()
    if coding == "chunked":
        return await _read_chunked(reader)
    if coding:
        raise BadRequest(501, f"transfer-encoding: {coding!r} not supported (only chunked)")
    raw = headers.get("content-length", "0").encode("latin-1")
    if not _DIGITS.fullmatch(raw):
        raise BadRequest(400, "content-length: not a non-negative integer")
    if len(raw.lstrip(b"0")) > 12 or int(raw) > MAX_BODY_BYTES:  # under int's digit limit
        raise BadRequest(413, f"content-length: the body is over the {MAX_BODY_BYTES}-byte limit")
    return await reader.readexactly(int(raw))


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    body = bytearray()
    while True:
        line = await read_line(reader, 400, "body: a chunk size line")
        size_field = line.split(b";")[0].strip()
        if not _HEX.fullmatch(size_field):
            raise BadRequest(400, "body: malformed chunk size")
        size = int(size_field, 16)  # hex has no digit limit; the line is at most 64 KiB
        if len(body) + size > MAX_BODY_BYTES:
            raise BadRequest(413, f"body: over the {MAX_BODY_BYTES}-byte limit")
        if size == 0:
            await read_headers(reader)  # trailers
            return bytes(body)
        body += await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise BadRequest(400, "body: a chunk does not end with CRLF")
