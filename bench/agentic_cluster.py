"""The local clusters the agentic replay runs against, one per configuration of its matrix.

The prefill worker's device KV memory is deliberately small: it holds about one long
conversation, so continuation turns find their prefix only where it survived the other
conversations' turns (or, with the host tier, was kept in host memory). The decode worker
gets enough for every request in flight.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass, field

import grpc

from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import rank_info_pb2 as rpb

HOST_TIER_FLAG = "--host-kv-cache-mb"
ORIGINS = {"unified": "transferred", "separate": "cold", "aggregated": "local"}


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """One column of the matrix. ``layout`` is unified, separate or aggregated (one worker
    doing both roles, unified layout); ``host_kv_mb`` 0 = no host tier."""

    layout: str
    host_kv_mb: int = 0

    @property
    def name(self) -> str:
        tier = f"host tier {self.host_kv_mb} MiB" if self.host_kv_mb else "no host tier"
        return f"{self.layout}, {tier}"

    @property
    def origin(self) -> str:
        return ORIGINS[self.layout]


@dataclass(slots=True)
class Geometry:
    """What the workers published (RankInfo via the router's ModelInfo).

    ``rebuild_tokens``: how far before a prefix hit's end the prefill must recompute when the
    draft group's window is not reused, L * (W - 1) for L windowed draft layers of window W
    (0 without a windowed drafter). ``pages``: worker -> group -> device pages."""

    rebuild_tokens: int = 0
    tokens_per_page: int = 16
    pages: dict[str, dict[str, int]] = field(default_factory=dict)


def host_tier_supported() -> bool:
    """Whether ``tandem worker`` accepts the host KV tier's size flag."""
    help_text = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "worker", "--help"], capture_output=True, text=True, check=False
    ).stdout
    return HOST_TIER_FLAG in help_text


def worker_args(config: ClusterConfig, args: argparse.Namespace) -> list[str]:
    layout = "unified" if config.layout == "aggregated" else config.layout
    out = [
        "--model",
        args.model,
        "--drafter",
        args.drafter,
        "-k",
        str(args.k),
        "--layout",
        layout,
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--max-model-len",  # what the workload grows to; the model's own may not fit the KV
        str(args.max_context),
        "--device",
        args.device,
    ]
    if config.host_kv_mb:
        out += [HOST_TIER_FLAG, str(config.host_kv_mb), "--host-kv-write-policy", args.host_write_policy]
    return out


def start_cluster(config: ClusterConfig, args: argparse.Namespace) -> LocalCluster:
    """Prefill with the small KV, decode with room for every request in flight; an
    aggregated worker gets both amounts (it holds both roles' pages)."""
    prefill = ["--kv-cache-mb", str(args.prefill_kv_mb)]
    decode = ["--kv-cache-mb", str(args.decode_kv_mb)]
    both = ["--kv-cache-mb", str(args.prefill_kv_mb + args.decode_kv_mb)]
    roles = [("both", both)] if config.layout == "aggregated" else [("prefill", prefill), ("decode", decode)]
    cluster = LocalCluster(
        worker_args(config, args),
        ["--model", args.model, "-k", str(args.k), "--max-model-len", str(args.max_context)],
        roles,
        start_timeout_s=180,
        env={"OMP_NUM_THREADS": str(args.threads)},
    )
    cluster.start()
    return cluster


def geometry(router_address: str) -> Geometry:
    with grpc.insecure_channel(router_address) as channel:
        info = cpb_grpc.TandemStub(channel).ModelInfo(cpb.ModelInfoRequest(), timeout=10)
    out = Geometry()
    for worker in info.workers:
        out.tokens_per_page = worker.tokens_per_page or out.tokens_per_page
        out.pages[worker.instance_id] = {g.name: g.num_pages for g in worker.groups}
        for g in worker.groups:
            if g.owner == rpb.GROUP_OWNER_DRAFT and g.window:
                out.rebuild_tokens = max(out.rebuild_tokens, len(g.layer_ids) * (g.window - 1))
    return out
