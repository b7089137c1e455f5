"""Disaggregated serving with a real model's page geometry: 32 layers of 8 KV heads of 128,
float32, 16 tokens a page: 4 MiB pages (an 8B Llama's are 2 MiB in bf16), so a prompt's
pages take several capped 64 MiB messages and every page message goes by UCX's
rendezvous protocol, as at real size.

A small random model of that geometry (hidden size 64, so a CPU prefills 1.5K tokens in
seconds; the LM head scaled up so greedy argmaxes stand well apart) serves prompts of 20
to 1,536 tokens without a drafter (384 MiB of pages: six capped messages), and of 20 and
600 tokens with a drafter (one layer, 8 KV heads of 128, a 256-token window) in the
unified layout, whose transfer carries the draft pages too (the separate layout moves the
target's pages only, as without a drafter; tests/e2e/test_disaggregated.py serves it). Each
gives the target-only engine's tokens; pools end empty. (4K-token prompts took 26 s each
to prefill on two CPU cores: too slow for the suite.)

Then a transfer whose receiver never answers (the decode worker's first receive stalled
past the 2 s transfer timeout): the prefill worker's send fails within its deadline, its
gRPC answers within 1 s throughout, the pair leaves ready with the cause in Health, the
failure is logged once, and the request, retried after the pair heals, completes.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from deploy.local import LocalCluster
from models.byte_tokenizer import write_byte_tokenizer
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from services.engine.config import EngineConfig
from services.engine.engine import Engine
from services.engine.models import Eagle3Drafter, EagleConfig, LlamaConfig, LlamaForCausalLM, save_model
from services.engine.sampling.params import SamplingParams
from tests.e2e.conftest import assert_no_request_holds_pages, generate
from tests.services.engine.helpers import randomize

pytestmark = pytest.mark.slow
VOCAB, PAGE, K = 32, 16, 3
LENGTHS = (20, 600, 1536)
MAX_TOKENS = 8
KV_MB = 1100  # 1,536 tokens + headroom: 97 target pages of 4 MiB, plus the draft window's
GEOMETRY = dict(num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096)
PAGE_BYTES = 32 * 2 * 8 * PAGE * 128 * 4  # target: layers x (K, V) x heads x tokens x head_dim x fp32
TRANSFER_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("real-geometry")
    target = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=32,
            tie_word_embeddings=False,
            eos_token_id=VOCAB - 1,
            **GEOMETRY,
        )
    )
    randomize(target, 0)
    drafter = Eagle3Drafter(
        EagleConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=96,
            sliding_window=256,
            aux_layer_ids=(1, 15, 29),
            **GEOMETRY,
        )
    )
    randomize(drafter, 1)
    with torch.no_grad():  # logits far apart: argmaxes no float reordering can flip
        target.lm_head.weight.mul_(8.0)
    save_model(target, folder / "target", dtype=torch.float32)
    save_model(drafter, folder / "drafter", dtype=torch.float32)
    write_byte_tokenizer(folder / "target")
    return folder / "target", folder / "drafter"


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB - 1, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def target_only(real_pair) -> list[list[int]]:
    config = EngineConfig(
        model=str(real_pair[0]), tokens_per_page=PAGE, kv_cache_bytes=KV_MB << 20, max_num_seqs=4
    )
    engine = Engine(config)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [engine.generate([p], greedy)[0].token_ids for p in prompts()]


def _cluster(pair: tuple[Path, Path], drafter: str, extra: list[str] = (), env: dict | None = None):
    target, draft = map(str, pair)
    worker = ["--model", target, "-k", str(K), "--tokens-per-page", str(PAGE), "--kv-cache-mb", str(KV_MB)]
    worker += ["--max-num-seqs", "4", *extra]
    worker += ["--drafter", "none"] if drafter == "none" else ["--drafter", draft, "--layout", drafter]
    router = ["--model", target, "-k", str(K), "--tokens-per-page", str(PAGE)]
    cluster = LocalCluster(worker, router, ["prefill", "decode"], start_timeout_s=120, env=env)
    cluster.start()
    return cluster


@pytest.mark.parametrize("drafter", ["none", "unified"])
def test_pages_of_mibs_serve_the_target_only_tokens(real_pair, target_only, drafter):
    cluster = _cluster(real_pair, drafter)
    served = len(LENGTHS) if drafter == "none" else 2
    try:
        for prompt, ref in list(zip(prompts(), target_only, strict=True))[:served]:
            tokens, complete = generate(cluster.router_address, prompt, MAX_TOKENS, ignore_eos=True)
            assert tokens == ref, (drafter, len(prompt))
            moved = {t.group: t for t in complete.usage.transfers}
            assert moved["target"].num_bytes == -(-len(prompt) // PAGE) * PAGE_BYTES
            assert set(moved) == ({"target", "draft"} if drafter == "unified" else {"target"})
        assert_no_request_holds_pages(cluster)
    finally:
        cluster.stop()


class _Watch:
    """Polls a worker's Stats and the router's Health every 0.1 s from a thread: the
    slowest Stats answer, and every Health message seen."""

    def __init__(self, cluster: LocalCluster, worker: str) -> None:
        self.cluster, self.worker = cluster, worker
        self.slowest, self.messages, self.errors = 0.0, set(), []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> _Watch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()

    def _run(self) -> None:
        address = {p.name: p.grpc for p in self.cluster.processes}
        with grpc.insecure_channel(address[self.worker]) as w, self.cluster.channel() as r:
            stats, health = wpb_grpc.PrefillWorkerStub(w), cpb_grpc.TandemStub(r)
            while not self.done.is_set():
                start = time.monotonic()
                try:
                    stats.Stats(wpb.StatsRequest(), timeout=5)
                except grpc.RpcError as e:
                    self.errors.append(e.code())
                self.slowest = max(self.slowest, time.monotonic() - start)
                self.messages.add(health.Health(cpb.HealthRequest(), timeout=5).message)
                time.sleep(0.1)


def test_a_receiver_that_never_answers_fails_the_send_in_time_and_the_pair_heals(real_pair, target_only):
    faults = {"TANDEM_FAULTS": f"decode.before_receive_once={TRANSFER_TIMEOUT_S * 15}"}
    extra = ["--transfer-timeout-s", str(TRANSFER_TIMEOUT_S)]
    cluster = _cluster(real_pair, "none", extra, env=faults)
    try:
        prompt = prompts()[1]  # 38 pages of 4 MiB: the first send waits for a receive never posted
        with _Watch(cluster, "prefill-0") as watch:
            tokens, _ = generate(cluster.router_address, prompt, MAX_TOKENS, ignore_eos=True)
        assert tokens == target_only[1]  # retried once the pair healed
        assert watch.errors == [] and watch.slowest < 1.0, watch.slowest
        degraded = [m for m in watch.messages if "degraded: prefill-0: transfer failed to decode-1" in m]
        assert degraded and "not taken within 2.0 s" in degraded[0], watch.messages
        prefill_log = cluster.processes[1].log
        failures = [line for line in prefill_log if "WARNING" in line and "transfer of request" in line]
        assert len(failures) == 1 and "prefill-0->decode-1 failed after" in failures[0], failures
        router_log = "".join(cluster.processes[0].log)
        assert "pair prefill-0->decode-1 is degraded" in router_log
        assert "pair prefill-0->decode-1 is ready again" in router_log
        assert_no_request_holds_pages(cluster)
    finally:
        cluster.stop()
