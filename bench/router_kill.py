"""The router SIGKILLed under load: many streams (a share cancelled at random) against a
router, one prefill and two decode workers with short leases; the router killed mid-run.

Reports how many streams were running when it died, then the pages requests hold on each
worker, read from the workers themselves, until none holds any (or the wait ends).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from bench.soak import held_pages
from bench.stall import DRAFTER, MODEL, streams
from deploy.local import LocalCluster


async def kill_under_load(cluster: LocalCluster, args) -> None:
    t0 = time.monotonic()
    # streams start until the kill, and those running then fail with it
    load = asyncio.ensure_future(
        streams(cluster.router_address, args.streams, args.kill_after_s, args.cancel_rate, t0)
    )
    await asyncio.sleep(args.kill_after_s)
    cluster.kill("router")
    out = await load  # every stream fails once the router is gone
    print(
        f"router killed at {time.monotonic() - t0:.1f} s; before it: {len(out.latencies)} completed, ", end=""
    )
    print(f"{out.cancelled} cancelled; at the kill: {sum(out.failed.values())} failed {dict(out.failed)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--kill-after-s", type=float, default=20)
    parser.add_argument("--cancel-rate", type=float, default=0.3)
    parser.add_argument("--lease-s", type=float, default=5)
    args = parser.parse_args()
    worker = ["--model", MODEL, "--drafter", DRAFTER, "-k", "4", "--lease-s", str(args.lease_s)]
    cluster = LocalCluster(worker, ["--model", MODEL, "-k", "4"], ["prefill", "decode", "decode"])
    cluster.start()
    try:
        asyncio.run(kill_under_load(cluster, args))
        killed = time.monotonic()
        for _ in range(int(args.lease_s) + 10):
            pages = held_pages(cluster)
            print(f"{time.monotonic() - killed:5.1f} s after the kill: {pages}", flush=True)
            if not any(pages.values()):
                break
            time.sleep(1)
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
