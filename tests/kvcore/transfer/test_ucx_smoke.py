"""Two real processes move buffers over UCX, bit-exactly, both directions, both paths.

Each peer runs one transport that listens too, and connects to the other twice:
"shm" by worker address, "tcp" through the listener. The parent only relays the
endpoint infos and checks what each peer received against what the other sent.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import os
import time

import torch

from kvcore.transfer.tags import make_tag
from kvcore.transfer.ucx import LOOPBACK_ENV, UcxPath

TIMEOUT_S = 10.0  # every transfer, and every wait on a child
SILENT_TIMEOUT_S = 0.5  # the receive from a peer that sends nothing
CHILD_JOIN_S = 15.0


def payloads(role: int) -> dict[str, torch.Tensor]:
    """What peer ``role`` sends, by name ``<what>_<peer id>``: random bits that the parent
    regenerates exactly."""
    gen = torch.Generator().manual_seed(1000 + role)

    def random_bytes(n: int) -> torch.Tensor:
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)

    out = {
        "bf16_shm": random_bytes(4 << 20).view(torch.bfloat16).view(1024, -1),  # 4 MiB
        "fp8_shm": random_bytes(1 << 20).view(torch.float8_e4m3fn),  # 1 MiB
        "small_shm": random_bytes(100),  # eager protocol
        "bf16_tcp": random_bytes(1 << 20).view(torch.bfloat16),
    }  # 1 MiB
    return out


def tag_of(sender: int, index: int) -> int:
    return make_tag(f"smoke-from-{sender}", 0, index)


def peer_id_of(payload_name: str) -> str:
    return payload_name.rsplit("_", 1)[1]


def _peer_main(role: int, conn) -> None:
    os.environ.update(LOOPBACK_ENV)  # before the transport imports ucxx
    asyncio.run(_peer_session(role, conn))


async def _peer_session(role: int, conn) -> None:
    from kvcore.transfer.ucx import EndpointInfo, TransferTimeout, UcxTransport

    transport = UcxTransport(listen=True)
    await transport.start()
    conn.send(dataclasses.astuple(transport.local_info()))
    peer_info = EndpointInfo(*await asyncio.to_thread(conn.recv))
    await transport.connect("shm", peer_info, UcxPath.WORKER_ADDRESS)
    await transport.connect("tcp", peer_info, UcxPath.LISTENER)

    mine, theirs = payloads(role), payloads(1 - role)
    received = {name: torch.empty_like(t) for name, t in theirs.items()}
    sends = [
        transport.send(peer_id_of(name), t, tag_of(role, i), TIMEOUT_S)
        for i, (name, t) in enumerate(mine.items())
    ]
    recvs = [transport.recv(received[name], tag_of(1 - role, i), TIMEOUT_S) for i, name in enumerate(theirs)]
    await asyncio.gather(*sends, *recvs)

    start = time.monotonic()
    try:
        await transport.recv(torch.empty(16, dtype=torch.uint8), tag_of(1 - role, 99), SILENT_TIMEOUT_S)
        silent = ("no error", 0.0)
    except TransferTimeout:
        silent = ("TransferTimeout", time.monotonic() - start)

    conn.send(
        ({name: t.view(torch.uint8).flatten().numpy().tobytes() for name, t in received.items()}, silent)
    )
    await asyncio.to_thread(conn.recv)  # both peers are done: safe to close
    await transport.close()


def _recv_or_fail(conn, what: str, peers: list) -> object:
    """The next message on ``conn``; fails at once if a peer has exited."""
    deadline = time.monotonic() + TIMEOUT_S + CHILD_JOIN_S
    while not conn.poll(0.1):
        exit_codes = [p.exitcode for p in peers]
        assert exit_codes == [None, None], f"a peer exited before its {what}: {exit_codes}"
        assert time.monotonic() < deadline, f"no {what} from a peer in time"
    return conn.recv()


def test_two_processes_move_buffers_bit_exactly_both_ways():
    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(2)]
    peers = [ctx.Process(target=_peer_main, args=(role, pipes[role][1]), daemon=True) for role in range(2)]
    try:
        for p in peers:
            p.start()
        infos = [_recv_or_fail(pipes[r][0], "endpoint info", peers) for r in range(2)]
        for role in range(2):
            pipes[role][0].send(infos[1 - role])
        results = [_recv_or_fail(pipes[r][0], "result", peers) for r in range(2)]
        for role in range(2):
            pipes[role][0].send("done")
        for p in peers:
            p.join(CHILD_JOIN_S)
        assert [p.exitcode for p in peers] == [0, 0]
    finally:
        for p in peers:
            if p.is_alive():
                p.kill()

    for role, (received, silent) in enumerate(results):
        sent = payloads(1 - role)
        assert received.keys() == sent.keys()
        for name, tensor in sent.items():
            expected = tensor.view(torch.uint8).flatten().numpy().tobytes()
            assert received[name] == expected, f"peer {role}: {name} differs"
        outcome, waited_s = silent
        assert outcome == "TransferTimeout"
        assert waited_s >= SILENT_TIMEOUT_S
