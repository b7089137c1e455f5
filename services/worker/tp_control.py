"""The control channel between a TP worker's rank 0 and its other ranks.

JSON lines over TCP on the worker's own host (ranks of one group share a host; the
channel binds loopback). Rank r connects to rank 0 and says hello
(``{"rank": r, "rank_info": <base64 RankInfo>}``); rank 0 then sends commands
``{"id": n, "op": name, ...}`` and the rank answers ``{"id": n, "ok": true, ...}`` or
``{"id": n, "ok": false, "error": text}``. Commands run concurrently; a cancelled call
sends ``{"op": "cancel", "target": n}``. A rank whose connection to rank 0 closes exits,
and rank 0 exits when a rank's does: a group lives and dies as one.

The commands are kvcore's transfer jobs (``send``, ``recv``, ``test``, ``disconnect``),
and this module alone gives them a JSON form: page lists ``{group: [first_page, [page
ids]]}``, routes ``{group: [src_lo, src_hi, dst_lo, dst_hi, whole, src_rank, dst_rank]}``,
endpoints ``[backend, base64 address, host, port]``. Rank 0 in-process and TP 1 workers never
take this path.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import os
import socket
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from kvcore import TransferPages
from kvcore.transfer import (
    EndpointInfo,
    HeadRoute,
    LinkTest,
    PeerRank,
    RankTransfer,
    RecvJob,
    SendJob,
    TransferUsage,
)

HOST = "127.0.0.1"
LINE_LIMIT = 64 << 20  # bytes of one JSON line (a long prompt's page lists fit)


class RankError(RuntimeError):
    """A rank failed a command, or is gone."""


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode()


def decode_bytes(text: str) -> bytes:
    return base64.b64decode(text)


def listen_socket() -> socket.socket:
    """A bound, listening loopback socket on a free port (rank 0 opens it before it
    starts the other ranks, which are told its port)."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen(64)
    sock.setblocking(False)
    return sock


def _write(writer: asyncio.StreamWriter, message: dict[str, Any]) -> None:
    writer.write(json.dumps(message).encode() + b"\n")


class RankLink:
    """Rank 0's handle on one other rank."""

    def __init__(
        self,
        rank: int,
        hello: dict[str, Any],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_lost: Callable[[int], None],
    ) -> None:
        self.rank, self.hello = rank, hello
        self._reader, self._writer = reader, writer
        self._ids = itertools.count()
        self._waiting: dict[int, asyncio.Future] = {}
        self._task = asyncio.ensure_future(self._read_replies(on_lost))

    async def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Run ``op`` on the rank; its answer, or RankError."""
        n = next(self._ids)
        future = asyncio.get_running_loop().create_future()
        self._waiting[n] = future
        _write(self._writer, {"id": n, "op": op, **args})
        try:
            reply = await future
        except asyncio.CancelledError:
            if not self._writer.is_closing():
                _write(self._writer, {"id": -1, "op": "cancel", "target": n})
            raise
        finally:
            self._waiting.pop(n, None)
        if not reply.get("ok"):
            raise RankError(f"rank {self.rank}: {op}: {reply.get('error', 'failed')}")
        return reply

    async def _read_replies(self, on_lost: Callable[[int], None]) -> None:
        while line := await self._reader.readline():
            reply = json.loads(line)
            future = self._waiting.get(reply.get("id"))
            if future is not None and not future.done():
                future.set_result(reply)
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(RankError(f"rank {self.rank}: connection lost"))
        on_lost(self.rank)

    def close(self) -> None:
        self._task.cancel()
        self._writer.close()


async def accept_ranks(
    sock: socket.socket, ranks: range, timeout_s: float, on_lost: Callable[[int], None]
) -> dict[int, RankLink]:
    """Wait until every rank in ``ranks`` has connected and said hello."""
    links: dict[int, RankLink] = {}
    done = asyncio.get_running_loop().create_future()

    async def greet(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.loads(await reader.readline())
        rank = int(hello["rank"])
        links[rank] = RankLink(rank, hello, reader, writer, on_lost)
        if set(links) >= set(ranks) and not done.done():
            done.set_result(None)

    server = await asyncio.start_server(greet, sock=sock, limit=LINE_LIMIT)
    try:
        await asyncio.wait_for(done, timeout_s)
    except TimeoutError:
        raise RankError(
            f"ranks {sorted(set(ranks) - set(links))} did not join within {timeout_s} s"
        ) from None
    finally:
        server.close()
    return links


Handler = Callable[..., Awaitable[dict[str, Any]]]


async def serve_rank(port: int, hello: dict[str, Any], handlers: dict[str, Handler]) -> None:
    """Ranks 1..: connect to rank 0, say hello, run its commands until it goes away."""
    reader, writer = await asyncio.open_connection(HOST, port, limit=LINE_LIMIT)
    _write(writer, hello)
    running: dict[int, asyncio.Task] = {}

    async def run(n: int, op: str, args: dict[str, Any]) -> None:
        try:
            reply = {"ok": True, **await handlers[op](**args)}
        except asyncio.CancelledError:
            reply = {"ok": False, "error": "cancelled"}
        except Exception as e:  # the answer names what went wrong; the rank keeps serving
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        running.pop(n, None)
        if not writer.is_closing():
            _write(writer, {"id": n, **reply})

    while line := await reader.readline():
        message = json.loads(line)
        n, op = message.pop("id"), message.pop("op")
        if op == "cancel":
            task = running.get(message["target"])
            if task is not None:
                task.cancel()
            continue
        running[n] = asyncio.ensure_future(run(n, op, message))
    print("rank 0 is gone; this rank exits", file=sys.stderr, flush=True)
    os._exit(0)


# ---------------------------------------------------------------- transfer jobs as JSON


def pages_to_json(pages: dict[str, TransferPages]) -> dict[str, list]:
    return {g: [p.first_page, list(p.page_ids)] for g, p in pages.items()}


def pages_from_json(pages: dict[str, list]) -> dict[str, TransferPages]:
    return {g: TransferPages(first, ids) for g, (first, ids) in pages.items()}


def routes_to_json(routes: dict[str, HeadRoute]) -> dict[str, list]:
    return {
        g: [
            r.src_heads.start,
            r.src_heads.stop,
            r.dst_heads.start,
            r.dst_heads.stop,
            r.whole,
            r.src_rank,
            r.dst_rank,
        ]
        for g, r in routes.items()
    }


def routes_from_json(routes: dict[str, list]) -> dict[str, HeadRoute]:
    return {
        g: HeadRoute(src, dst, slice(s0, s1), slice(d0, d1), whole)
        for g, (s0, s1, d0, d1, whole, src, dst) in routes.items()
    }


def usage_to_json(usage: TransferUsage) -> dict[str, Any]:
    return {"bytes": usage.bytes, "seconds": usage.seconds}


def usage_from_json(reply: dict[str, Any]) -> TransferUsage:
    return TransferUsage(dict(reply["bytes"]), dict(reply["seconds"]))


def send_to_json(job: SendJob) -> dict[str, Any]:
    return {
        "request_id": job.request_id,
        "peer": job.peer_id,
        "src_rank": job.src_rank,
        "pages": pages_to_json(job.pages),
        "routes": routes_to_json(job.routes),
        "timeout_s": job.timeout_s,
        "dest": job.dest,
        "tag": job.tag,
    }


def send_from_json(args: dict[str, Any]) -> SendJob:
    pages, routes = pages_from_json(args["pages"]), routes_from_json(args["routes"])
    return SendJob(
        args["request_id"],
        args["peer"],
        args["src_rank"],
        pages,
        routes,
        args["timeout_s"],
        args["dest"],
        args.get("tag", 0),
    )


def recv_to_json(job: RecvJob) -> dict[str, Any]:
    sources = [[src, routes_to_json(routes)] for src, routes in job.sources.items()]
    return {
        "request_id": job.request_id,
        "pages": pages_to_json(job.pages),
        "sources": sources,
        "timeout_s": job.timeout_s,
        "tag": job.tag,
    }


def recv_from_json(args: dict[str, Any]) -> RecvJob:
    sources = {src: routes_from_json(routes) for src, routes in args["sources"]}
    pages = pages_from_json(args["pages"])
    return RecvJob(args["request_id"], pages, sources, args["timeout_s"], args.get("tag", 0))


def test_to_json(job: LinkTest) -> dict[str, Any]:
    peer = job.peer
    return {
        "peer": peer.instance_id,
        "endpoint": endpoint_to_json(peer.endpoint),
        "nonce": job.nonce,
        "lead": job.lead,
    }


def test_from_json(args: dict[str, Any]) -> LinkTest:
    peer = PeerRank(args["peer"], endpoint_from_json(args["endpoint"]))
    return LinkTest(peer, args["nonce"], args["lead"])


def endpoint_to_json(info: EndpointInfo) -> list[Any]:
    return [info.backend, encode_bytes(info.address), info.host, info.port]


def endpoint_from_json(fields: list[Any]) -> EndpointInfo:
    backend, address, host, port = fields
    return EndpointInfo(backend, decode_bytes(address), host, port)


def rank_handlers(rank: RankTransfer) -> dict[str, Handler]:
    """What ranks 1.. serve (:func:`serve_rank`): rank 0's jobs, run on ``rank``."""

    async def send(**args: Any) -> dict[str, Any]:
        return usage_to_json(await rank.send(send_from_json(args)))

    async def recv(**args: Any) -> dict[str, Any]:
        return usage_to_json(await rank.recv(recv_from_json(args)))

    async def test(**args: Any) -> dict[str, Any]:
        await rank.test(test_from_json(args))
        return {}

    async def disconnect(peer: str) -> dict[str, Any]:
        await rank.disconnect(peer)
        return {}

    return {"send": send, "recv": recv, "test": test, "disconnect": disconnect}
