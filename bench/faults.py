"""Recovery times of injected faults on a local cluster of the bundled tiny pair.

1. SIGKILL of the decode worker mid-decode: seconds until the client's stream fails UNAVAILABLE.
2. SIGKILL of a decode worker mid-transfer (the prefill worker holds its pages 2 s before
   sending): seconds from the kill until the request, retried on the other decode worker,
   completes, and until the prefill worker holds no request's pages.
3. SIGKILL of a prefill worker: seconds for the next request (retried around it).
4. A reservation whose transfer never comes: seconds until its lease frees it (lease 1 s).
5. The router SIGKILLed and restarted on its port after ``down`` seconds: seconds from its
   restart until it prints its endpoint, until every worker has registered again, and until
   every pair is READY (the workers' next heartbeat finds it; their channel's reconnect
   backoff grows while it is down).
"""

from __future__ import annotations

import argparse
import socket
import threading
import time

import grpc

from bench.soak import held_pages
from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc

MODEL, DRAFTER = "models/tiny-target", "models/tiny-drafter"
PROMPT = "def parse(self, text):\n    "


def cluster(roles, faults: str = "", port: int = 0) -> LocalCluster:
    c = LocalCluster(
        ["--model", MODEL, "--drafter", DRAFTER, "-k", "4"],
        ["--model", MODEL, "-k", "4"],
        roles,
        port=port,
        env={"TANDEM_FAULTS": faults} if faults else None,
    )
    c.start()
    return c


def request(max_tokens: int) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(
        text=PROMPT, sampling=cpb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    )


def wait_until(predicate, timeout_s: float = 30.0) -> float:
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            raise TimeoutError("condition not met")
        time.sleep(0.01)
    return time.monotonic() - start


def decode_killed_mid_decode() -> float:
    c = cluster(["prefill", "decode"], "engine.step=0.05")
    try:
        with grpc.insecure_channel(c.router_address) as channel:
            chunks, killed = 0, 0.0
            try:
                for message in cpb_grpc.TandemStub(channel).Generate(request(400), timeout=60):
                    chunks += message.HasField("chunk")
                    if chunks == 3:
                        c.kill("decode-1")
                        killed = time.monotonic()
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                return time.monotonic() - killed
        raise AssertionError("the stream did not fail")
    finally:
        c.stop()


def decode_killed_mid_transfer() -> tuple[float, float]:
    c = cluster(["prefill", "decode", "decode"], "prefill.before_send=2")
    try:
        done = {}

        def run() -> None:
            with grpc.insecure_channel(c.router_address) as channel:
                list(cpb_grpc.TandemStub(channel).Generate(request(8), timeout=60))
            done["t"] = time.monotonic()

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: any(n.startswith("decode") and v > 0 for n, v in held_pages(c).items()))
        holder = next(n for n, v in held_pages(c).items() if n.startswith("decode") and v > 0)
        c.kill(holder)
        killed = time.monotonic()
        c.processes = [p for p in c.processes if p.name != holder]
        freed = wait_until(lambda: held_pages(c)["prefill-0"] == 0)
        thread.join()
        return freed, done["t"] - killed
    finally:
        c.stop()


def prefill_killed() -> float:
    c = cluster(["prefill", "prefill", "decode"])
    try:
        c.kill("prefill-0")
        start = time.monotonic()
        with grpc.insecure_channel(c.router_address) as channel:
            list(cpb_grpc.TandemStub(channel).Generate(request(8), timeout=60))
        return time.monotonic() - start
    finally:
        c.stop()


def lease_expiry() -> float:
    c = cluster(["prefill", "decode"])
    try:
        with grpc.insecure_channel(c.processes[2].grpc) as channel:
            wpb_grpc.DecodeWorkerStub(channel).Reserve(
                wpb.ReserveRequest(request_id="orphan", prompt_len=64, lease_ms=1000)
            )
        return wait_until(lambda: held_pages(c)["decode-1"] == 0)
    finally:
        c.stop()


def router_restarted(down_s: float) -> tuple[float, float, float]:
    c = cluster(["prefill", "decode"], port=free_port())
    try:
        c.kill("router")
        time.sleep(down_s)
        start = time.monotonic()
        c.restart("router")
        printed = time.monotonic() - start
        with grpc.insecure_channel(c.router_address) as channel:
            stub = cpb_grpc.TandemStub(channel)

            def workers() -> int:
                health = stub.Health(cpb.HealthRequest(), timeout=5)
                return health.num_prefill_workers + health.num_decode_workers

            def pairs() -> int:
                return stub.Health(cpb.HealthRequest(), timeout=5).num_ready_pairs

            joined = printed + wait_until(lambda: workers() == 2, 120)
            serving = joined + wait_until(lambda: pairs() == 1, 120)
            list(stub.Generate(request(8), timeout=60))
        return printed, joined, serving
    finally:
        c.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--router-restart-only", action="store_true", help="case 5 only")
    if parser.parse_args().router_restart_only:
        return router_restarts()
    print("| fault | measured |")
    print("|---|---|")
    print(
        f"| decode SIGKILL mid-decode | client sees UNAVAILABLE after {decode_killed_mid_decode():.3f} s |",
        flush=True,
    )
    freed, completed = decode_killed_mid_transfer()
    print(
        f"| decode SIGKILL mid-transfer | prefill pages free after {freed:.2f} s; request "
        f"completes on the other decode worker {completed:.2f} s after the kill |",
        flush=True,
    )
    print(f"| prefill SIGKILL | next request served in {prefill_killed():.2f} s |", flush=True)
    print(f"| transfer never comes (lease 1 s) | pages free after {lease_expiry():.2f} s |", flush=True)
    router_restarts()


def router_restarts() -> None:
    for down_s in (2.0, 30.0):
        printed, joined, serving = router_restarted(down_s)
        print(
            f"| router SIGKILL, restarted {down_s:.0f} s later | endpoint after {printed:.2f} s, workers "
            f"registered after {joined:.2f} s, serving after {serving:.2f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
