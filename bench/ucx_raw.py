"""Raw UCX throughput between two processes on this host, through UcxTransport.

For each path (worker address: shared memory; listener: TCP) and message size,
a sender pushes messages one at a time to a receiver that has a buffer ready, then
waits for a tiny acknowledgement of the last one:

    GB/s = iters * size / (time from the first send to the ack of the last) / 1e9

measured ``--repeats`` times per size; the table gives the median and the range.
This is the ceiling the KV page transfer is held against. The protocol column is
what UCX chose for that size on the sender (parsed from UCX_PROTO_INFO=y output).
Traffic stays on loopback (UCX_NET_DEVICES=lo).

    python bench/ucx_raw.py [--sizes 1,16,256] [--iters N] [--paths shm,tcp]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not __package__:  # run as a script: put the repo root, not bench/ (whose kvcore.py
    sys.path[0] = str(Path(__file__).resolve().parents[1])  # shadows the package), first

import torch  # noqa: E402

from kvcore.transfer.tags import MAX_CHUNKS, make_tag  # noqa: E402
from kvcore.transfer.ucx import LOOPBACK_ENV, PROGRESS_MODE, UcxPath  # noqa: E402

PATHS = {"shm": UcxPath.WORKER_ADDRESS, "tcp": UcxPath.LISTENER}
MIB = 1 << 20
AUTO_BYTES = 1 << 30  # per size when --iters is not given
MSG_TIMEOUT_S = 30.0
WAIT_S = 120.0  # the parent's patience with a child


@dataclasses.dataclass(slots=True)
class Row:
    path: str
    size: int  # bytes
    iters: int
    seconds: list[float]  # one per repeat
    protocol: str = ""

    @property
    def rates(self) -> list[float]:
        """GB/s of each repeat, sorted."""
        return sorted(self.iters * self.size / s / 1e9 for s in self.seconds)


def iters_for(size: int, fixed: int | None) -> int:
    return fixed if fixed else max(5, min(200, AUTO_BYTES // size))


def tag_batches(path: str, size: int, warmup: int, iters: int, repeats: int) -> list[list[int]]:
    """Tags of the warmup batch, then of each timed repeat; every message's tag is unique."""
    counts = [warmup] + [iters] * repeats
    firsts = [sum(counts[:i]) for i in range(len(counts))]
    return [
        [make_tag(f"bench-{path}-{size}", 0, first + i) for i in range(count)]
        for first, count in zip(firsts, counts, strict=True)
    ]


ACK_TAG = make_tag("bench-ack", 0, 0)


# ---------------------------------------------------------------- children


def child_main(role: str, conn, config: dict, ucx_log: str) -> None:
    os.environ.update(LOOPBACK_ENV)
    if role == "sender":  # UCX prints its protocol tables on stdout: keep them for the parent
        os.environ["UCX_PROTO_INFO"] = "y"
        log_fd = os.open(ucx_log, os.O_WRONLY | os.O_TRUNC)
        os.dup2(log_fd, 1)
    asyncio.run(child_session(role, conn, config))


async def child_session(role: str, conn, config: dict) -> None:
    from kvcore.transfer.ucx import EndpointInfo, UcxTransport

    transport = UcxTransport(listen=True)
    await transport.start()
    conn.send(dataclasses.astuple(transport.local_info()))
    peer = EndpointInfo(*await asyncio.to_thread(conn.recv))
    rows = []
    for name in config["paths"]:
        if role == "sender":
            os.write(1, f"@@ path {name}\n".encode())  # marks whose tables follow
            await transport.connect(name, peer, PATHS[name])
        elif not transport.is_connected("ack"):
            await transport.connect("ack", peer)
        for size in config["sizes"]:
            iters = iters_for(size, config["iters"])
            run = send_all if role == "sender" else recv_all
            seconds = await run(transport, name, size, config["warmup"], iters, config["repeats"])
            rows.append(Row(name, size, iters, seconds))
    conn.send(rows)
    await asyncio.to_thread(conn.recv)  # both done: safe to close
    await transport.close()


async def send_all(transport, path: str, size: int, warmup: int, iters: int, repeats: int) -> list[float]:
    """Seconds of each repeat: ``iters`` sends, one at a time, then the receiver's ack."""
    buffer = torch.ones(size, dtype=torch.uint8)  # touched: no page faults while timed
    ack = torch.empty(1, dtype=torch.uint8)
    batches = tag_batches(path, size, warmup, iters, repeats)
    for tag in batches[0]:
        await transport.send(path, buffer, tag, MSG_TIMEOUT_S)
    await transport.recv(ack, ACK_TAG, MSG_TIMEOUT_S)
    seconds = []
    for batch in batches[1:]:
        start = time.perf_counter()
        for tag in batch:
            await transport.send(path, buffer, tag, MSG_TIMEOUT_S)
        await transport.recv(ack, ACK_TAG, MSG_TIMEOUT_S)
        seconds.append(time.perf_counter() - start)
    return seconds


async def recv_all(transport, path: str, size: int, warmup: int, iters: int, repeats: int) -> list[float]:
    """Receive every batch into one buffer; ack the end of each batch."""
    buffer = torch.zeros(size, dtype=torch.uint8)
    ack = torch.ones(1, dtype=torch.uint8)
    for batch in tag_batches(path, size, warmup, iters, repeats):
        for tag in batch:
            await transport.recv(buffer, tag, MSG_TIMEOUT_S)
        await transport.send("ack", ack, ACK_TAG, MSG_TIMEOUT_S)
    return []


# ---------------------------------------------------------------- protocol tables


def parse_protocols(ucx_log: str) -> dict[str, list[tuple[float, float, str]]]:
    """Path -> [(low, high, "protocol, transport")]: the first non-empty tag-send table
    UCX printed after the path's marker (an endpoint still wiring up prints an empty one)."""
    out: dict[str, list[tuple[float, float, str]]] = {}
    owner: dict[str, int] = {}  # path -> the table its rows come from
    path, table, in_tag_send = None, 0, False
    with open(ucx_log, errors="replace") as f:
        for line in f:
            if line.startswith("@@ path "):
                path = line.split()[2]
                continue
            cells = [c.strip() for c in line.split("|")[1:-1]]
            if len(cells) == 2:  # a table's title: "ucp_context_0 <scope> cfg#N", operation
                table += 1
                in_tag_send = cells[1].startswith("tagged message by ucp_tag_send* from host")
            elif len(cells) == 3 and in_tag_send and path and owner.setdefault(path, table) == table:
                low, high = _size_range(cells[0])
                out.setdefault(path, []).append((low, high, f"{cells[1].removeprefix('(?) ')}, {cells[2]}"))
    return out


def _size_range(text: str) -> tuple[float, float]:
    low, _, high = text.partition("..")
    return _size(low), _size(high or low)


def _size(text: str) -> float:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    if text == "inf":
        return float("inf")
    return float(text[:-1]) * units[text[-1]] if text[-1] in units else float(text)


def protocol_for(table: list[tuple[float, float, str]], size: int) -> str:
    return next((name for low, high, name in table if low <= size <= high), "?")


# ---------------------------------------------------------------- parent


def run(config: dict) -> list[Row]:
    ctx = mp.get_context("spawn")
    fd, ucx_log = tempfile.mkstemp(prefix="ucx_proto_", suffix=".log")
    os.close(fd)
    pipes = {role: ctx.Pipe() for role in ("sender", "receiver")}
    children = [
        ctx.Process(target=child_main, args=(role, pipes[role][1], config, ucx_log), daemon=True)
        for role in pipes
    ]
    try:
        for c in children:
            c.start()
        infos = {role: expect(p[0], "endpoint info", children) for role, p in pipes.items()}
        pipes["sender"][0].send(infos["receiver"])
        pipes["receiver"][0].send(infos["sender"])
        rows = expect(pipes["sender"][0], "results", children)
        expect(pipes["receiver"][0], "results", children)
        for p in pipes.values():
            p[0].send("done")
        for c in children:
            c.join(WAIT_S)
        tables = parse_protocols(ucx_log)
    finally:
        for c in children:
            if c.is_alive():
                c.kill()
        os.unlink(ucx_log)
    for row in rows:
        row.protocol = protocol_for(tables.get(row.path, []), row.size)
    return rows


def expect(conn, what: str, children: list) -> object:
    """The next message on ``conn``; fails fast when a child has died."""
    deadline = time.monotonic() + WAIT_S
    while not conn.poll(0.2):
        dead = [c.exitcode for c in children if c.exitcode is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"no {what} from a child (exit codes {dead}, waited up to {WAIT_S} s)")
    return conn.recv()


def print_table(rows: list[Row]) -> None:
    print(f"{'path':<5} {'size':>8} {'iters':>6} {'GB/s':>6} {'(min-max)':>12}  protocol, transport (UCX)")
    for r in rows:
        rates = r.rates
        median = statistics.median(rates)
        spread = f"({rates[0]:.2f}-{rates[-1]:.2f})"
        print(f"{r.path:<5} {r.size // MIB:>4} MiB {r.iters:>6} {median:>6.2f} {spread:>12}  {r.protocol}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", default="1,16,256", help="message sizes in MiB, comma separated (default: 1,16,256)"
    )
    parser.add_argument(
        "--iters", type=int, default=0, help="timed messages per size (default: enough for 1 GiB, 5..200)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed messages per size")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed batches per size; the table shows their median GB/s"
    )
    parser.add_argument(
        "--paths", default="shm,tcp", help="shm (worker address) and/or tcp (listener), comma separated"
    )
    args = parser.parse_args()
    try:
        args.sizes = [int(s) * MIB for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes: expected whole MiB counts like 1,16,256, got {args.sizes!r}")
    args.paths = args.paths.split(",")
    for name in args.paths:
        if name not in PATHS:
            parser.error(f"--paths: unknown path {name!r}; known: {sorted(PATHS)}")
    if args.iters < 0 or args.warmup < 1 or args.repeats < 1 or min(args.sizes) <= 0:
        parser.error("--iters must be >= 0, --warmup and --repeats >= 1, every size > 0")
    if args.warmup + args.repeats * max(iters_for(s, args.iters) for s in args.sizes) > MAX_CHUNKS:
        parser.error(f"--warmup + --repeats * --iters must be <= {MAX_CHUNKS} (tag chunks)")
    return args


def main() -> None:
    args = parse_args()
    config = {
        "sizes": args.sizes,
        "iters": args.iters,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "paths": args.paths,
    }
    os.environ.update(LOOPBACK_ENV)
    import ucxx

    mode = os.environ.get("UCXPY_PROGRESS_MODE", PROGRESS_MODE)
    version = ".".join(map(str, ucxx.get_ucx_version()))
    print(
        f"ucx_raw: {os.cpu_count()} CPUs, loopback only, UCX {version}, ucxx "
        f"{ucxx.__version__.strip()}, progress mode {mode}"
    )
    print_table(run(config))


if __name__ == "__main__":
    main()
