"""Whole-cluster fixtures: real router and worker processes on 127.0.0.1."""

from __future__ import annotations

import itertools

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.local import LocalCluster
from proto.tandem.v1 import client_pb2 as cpb
from proto.tandem.v1 import client_pb2_grpc as cpb_grpc
from proto.tandem.v1 import worker_pb2 as wpb
from proto.tandem.v1 import worker_pb2_grpc as wpb_grpc
from tests.services.engine.helpers import write_pair

K = 3
PAGE = 4
_pair_ids = itertools.count()
ENGINE = dict(tokens_per_page=PAGE, kv_cache_bytes=8 << 20, max_num_seqs=16)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    return write_pair(tmp_path_factory.mktemp("pair"))


def cluster_args(pair, layout: str = "unified", k: int = K) -> tuple[list[str], list[str]]:
    target, drafter = map(str, pair)
    worker = [
        "--model",
        target,
        "--drafter",
        drafter,
        "-k",
        str(k),
        "--layout",
        layout,
        "--tokens-per-page",
        str(PAGE),
        "--kv-cache-mb",
        "8",
        "--max-num-seqs",
        "16",
    ]
    router = ["--model", target, "-k", str(k), "--tokens-per-page", str(PAGE)]
    return worker, router


def start_cluster(
    pair,
    roles,
    layout: str = "unified",
    router_extra: tuple[str, ...] = (),
    worker_extra: tuple[str, ...] = (),
    **kwargs,
) -> LocalCluster:
    """A started cluster (its logs printed if it fails to start); ``router_extra`` and
    ``worker_extra``: more router and worker arguments."""
    worker, router = cluster_args(pair, layout)
    worker += list(worker_extra)
    cluster = LocalCluster(worker, router + list(router_extra), roles, start_timeout_s=90, **kwargs)
    cluster.start()
    return cluster


def generate(address: str, prompt: list[int], max_tokens: int = 24, **sampling):
    """Run one request; returns (token ids, the complete message)."""
    request = cpb.GenerateRequest(
        token_ids=cpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(max_tokens=max_tokens, **sampling)
    )
    tokens, _, complete = stream(address, request)
    return tokens, complete


def stream(address: str, request: cpb.GenerateRequest) -> tuple[list[int], str, cpb.Complete]:
    """Stream one request: (its token ids, its chunks' text joined, the complete message);
    an error message fails."""
    tokens, text, complete = [], [], None
    with grpc.insecure_channel(address) as channel:
        for message in cpb_grpc.TandemStub(channel).Generate(request, timeout=60):
            kind = message.WhichOneof("payload")
            if kind == "chunk":
                tokens += list(message.chunk.token_ids)
                text.append(message.chunk.text)
            elif kind == "complete":
                complete = message.complete
            else:
                raise AssertionError(f"error message: {message.error}")
    return tokens, "".join(text), complete


def run_on_pair(
    cluster: LocalCluster,
    pair: tuple[str, str],
    prompt: list[int],
    max_tokens: int,
    reserve_prompt: bool = False,
):
    """Reserve on ``decode`` (sending the prompt's tokens, so its prefix cache counts, when
    ``reserve_prompt``), prefill on ``prefill``, decode: what the router does, on a chosen
    pair (prefill, decode). Returns (tokens, prefill usage, decode usage)."""
    prefill, decode = pair
    rid = f"pair-{next(_pair_ids)}"
    sampling = cpb.SamplingParams(max_tokens=max_tokens)
    address = {p.name: p.grpc for p in cluster.processes}
    with grpc.insecure_channel(address[decode]) as d, grpc.insecure_channel(address[prefill]) as p:
        decoder = wpb_grpc.DecodeWorkerStub(d)
        reservation = decoder.Reserve(
            wpb.ReserveRequest(
                request_id=rid, prompt_len=len(prompt), prompt_token_ids=prompt if reserve_prompt else []
            ),
            timeout=30,
        ).reservation
        first, landed = wpb_grpc.PrefillWorkerStub(p).Prefill(  # the first token, then the usage
            wpb.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, reservation=reservation
            ),
            timeout=60,
        )
        tokens, usage = [first.first_token_id], None
        for message in decoder.Decode(
            wpb.DecodeRequest(
                request_id=rid,
                prompt_token_ids=prompt,
                first_token_id=first.first_token_id,
                sampling=sampling,
            ),
            timeout=60,
        ):
            if message.HasField("chunk"):
                tokens += list(message.chunk.token_ids)
            elif message.HasField("complete"):
                usage = message.complete.usage
    return tokens, landed.usage, usage


def metric_sample(text: str, name: str, **labels: str) -> float:
    """The value of the one sample of ``name`` whose labels include ``labels`` (others, such
    as model_name, may be there too) in a /metrics page."""
    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]
    assert len(values) == 1, (name, labels, values)
    return values[0]


def worker_pages(cluster: LocalCluster) -> dict[str, dict[str, tuple[int, int]]]:
    """Per worker and group: (pages used, of which only the prefix cache holds)."""
    out = {}
    for p in (p for p in cluster.living() if not p.name.startswith("router")):
        with grpc.insecure_channel(p.grpc) as channel:
            stub = (wpb_grpc.DecodeWorkerStub if p.name.startswith("decode") else wpb_grpc.PrefillWorkerStub)(
                channel
            )
            stats = stub.Stats(wpb.StatsRequest(), timeout=5)
        out[p.name] = {g.group: (g.num_pages_used, g.num_pages_cached) for g in stats.groups}
    return out


def assert_no_request_holds_pages(cluster: LocalCluster) -> None:
    for name, groups in worker_pages(cluster).items():
        for group, (used, cached) in groups.items():
            assert used == cached, (name, group, used, cached)


@pytest.fixture(scope="session")
def byte_pair(tmp_path_factory):
    """A tiny random pair over the byte tokenizer's whole vocabulary, so text prompts
    (OpenAI completions and chat) encode to valid ids."""
    import torch

    from models.byte_tokenizer import VOCAB_SIZE, write_byte_tokenizer
    from services.engine.models import Eagle3Drafter, LlamaForCausalLM, save_model
    from tests.services.engine.helpers import drafter_config, randomize, target_config

    folder = tmp_path_factory.mktemp("byte-pair")
    target = LlamaForCausalLM(target_config(VOCAB_SIZE))
    randomize(target, 0)
    drafter = Eagle3Drafter(drafter_config(vocab=VOCAB_SIZE))
    randomize(drafter, 1)
    save_model(target, folder / "target", dtype=torch.float32)
    save_model(drafter, folder / "drafter", dtype=torch.float32)
    write_byte_tokenizer(folder / "target")
    return folder / "target", folder / "drafter"
