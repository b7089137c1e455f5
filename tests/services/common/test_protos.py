"""tandem.v1 protos: they generate and round-trip with non-default values."""

import pytest
from google.protobuf.message import Message

from proto.tandem.v1 import (
    client_pb2,
    rank_info_pb2,
    registration_pb2,
    worker_pb2,
)
from tests.services.common.conftest import PROTO_DIR, protoc
from tests.services.common.proto_samples import (
    full_rank_info,
    full_reservation,
    full_stats_response,
    full_usage,
)

PB2_MODULES = (rank_info_pb2, registration_pb2, client_pb2, worker_pb2)


def round_trip(message: Message) -> Message:
    parsed = type(message)()
    parsed.ParseFromString(message.SerializeToString())
    assert parsed == message
    return parsed


def test_protos_generate_cleanly(tmp_path):
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert [p.name for p in protos] == [
        "client.proto",
        "rank_info.proto",
        "registration.proto",
        "worker.proto",
    ]
    result = protoc(protos, tmp_path)
    assert (result.returncode, result.stderr) == (0, "")
    generated = tmp_path / "proto" / "tandem" / "v1"
    for proto in protos:
        for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"):
            assert (generated / f"{proto.stem}{suffix}").is_file()


def test_every_enum_starts_unspecified():
    for module in PB2_MODULES:
        for enum in module.DESCRIPTOR.enum_types_by_name.values():
            assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.full_name


def test_all_in_package_tandem_v1():
    assert {m.DESCRIPTOR.package for m in PB2_MODULES} == {"tandem.v1"}


def test_rank_info_round_trip():
    parsed = round_trip(full_rank_info())
    assert parsed.groups[1].window == 256
    assert list(parsed.groups[0].layer_ids) == [0, 1, 2]
    assert parsed.groups[0].page_bytes == 98304
    assert parsed.transfer_endpoint.address == b"\x00\x01ucx\xff"
    assert parsed.kv_layout == rank_info_pb2.KV_LAYOUT_SEPARATE


def test_registration_round_trip():
    request = round_trip(registration_pb2.RegisterRequest(rank_info=full_rank_info()))
    assert request.rank_info.drafter_kind == "eagle3"
    response = round_trip(
        registration_pb2.RegisterResponse(
            accepted=False,
            peer=full_rank_info(),
            mismatches=[
                registration_pb2.Mismatch(
                    field="groups[draft].window", local_value="256", peer_value="0", reason=""
                )
            ],
        )
    )
    assert (response.mismatches[0].field, response.mismatches[0].peer_value) == ("groups[draft].window", "0")
    round_trip(registration_pb2.DeregisterRequest(instance_id="decode-0"))
    round_trip(registration_pb2.ListPeersRequest(role=rank_info_pb2.ROLE_PREFILL))
    round_trip(registration_pb2.ListPeersResponse(peers=[full_rank_info()]))
    round_trip(registration_pb2.HeartbeatResponse(registered=True, interval_ms=500))


def test_generate_request_prompt_is_a_oneof():
    request = client_pb2.GenerateRequest(request_id="r1", text="def f(")
    request.token_ids.ids.extend([1, 2, 300])
    assert request.WhichOneof("prompt") == "token_ids"
    assert not request.HasField("text")
    parsed = round_trip(request)
    assert list(parsed.token_ids.ids) == [1, 2, 300]


def test_generate_request_round_trip_and_presence():
    sampling = client_pb2.SamplingParams(
        max_tokens=64, temperature=0.5, top_p=0.75, seed=0, stop=["\n\n", "```"], ignore_eos=True
    )
    request = round_trip(
        client_pb2.GenerateRequest(
            request_id="r2",
            text="import os",
            sampling=sampling,
            speculative=client_pb2.SpeculativeOptions(num_spec_tokens=0),
        )
    )
    assert request.sampling.HasField("seed") and request.sampling.seed == 0
    assert request.speculative.HasField("num_spec_tokens")
    assert list(request.sampling.stop) == ["\n\n", "```"]
    assert not client_pb2.SamplingParams().HasField("seed")
    assert not client_pb2.SpeculativeOptions().HasField("num_spec_tokens")


def test_sampling_surface_and_logprobs_round_trip():
    sampling = round_trip(
        client_pb2.SamplingParams(
            top_k=40,
            min_p=0.05,
            repetition_penalty=1.25,
            presence_penalty=-0.5,
            frequency_penalty=1.5,
            min_tokens=3,
            logprobs=0,
        )
    )
    assert (
        sampling.top_k,
        sampling.min_p,
        sampling.repetition_penalty,
        sampling.presence_penalty,
        sampling.frequency_penalty,
        sampling.min_tokens,
    ) == pytest.approx((40, 0.05, 1.25, -0.5, 1.5, 3))
    assert sampling.HasField("logprobs") and sampling.logprobs == 0
    assert not client_pb2.SamplingParams().HasField("logprobs")
    lp = client_pb2.TokenLogprobs(token_id=7, logprob=-0.5, top_token_ids=[7, 9], top_logprobs=[-0.5, -1.25])
    chunk = round_trip(client_pb2.Chunk(token_ids=[7], text="a", logprobs=[lp]))
    assert list(chunk.logprobs) == [lp]
    prefill = round_trip(worker_pb2.PrefillResponse(first_token_id=7, first_token_logprobs=lp))
    assert prefill.HasField("first_token_logprobs") and prefill.first_token_logprobs == lp
    assert not worker_pb2.PrefillResponse().HasField("first_token_logprobs")


@pytest.mark.parametrize("payload", ["chunk", "complete", "error"])
def test_generate_response_payloads(payload):
    values = {
        "chunk": client_pb2.Chunk(token_ids=[7, 8], text="ab"),
        "complete": client_pb2.Complete(finish_reason=client_pb2.FINISH_REASON_LENGTH, usage=full_usage()),
        "error": client_pb2.Error(message="prompt too long", field="prompt"),
    }
    response = round_trip(client_pb2.GenerateResponse(request_id="r", **{payload: values[payload]}))
    assert response.WhichOneof("payload") == payload
    assert getattr(response, payload) == values[payload]


def test_usage_round_trip():
    usage = round_trip(full_usage())
    assert usage.acceptance_length == 2.5
    assert [(t.group, t.num_bytes, t.seconds) for t in usage.transfers] == [
        ("target", 1 << 33, 0.25),
        ("draft", 4096, 0.5),
    ]


def test_worker_messages_round_trip():
    reservation = full_reservation()
    parsed = round_trip(worker_pb2.ReserveResponse(reservation=reservation))
    assert list(parsed.reservation.groups[1].page_ids) == [-1, -1, 5, 9, 2, 3, 4]
    round_trip(worker_pb2.ReserveRequest(request_id="r", prompt_len=100, headroom_tokens=4, lease_ms=2000))
    round_trip(
        worker_pb2.PrefillRequest(
            request_id="r",
            prompt_token_ids=[1, 2, 3],
            sampling=client_pb2.SamplingParams(max_tokens=9),
            reservation=reservation,
        )
    )
    prefill = round_trip(
        worker_pb2.PrefillResponse(
            first_token_id=42, finish_reason=client_pb2.FINISH_REASON_STOP, usage=full_usage()
        )
    )
    assert prefill.usage.transfers[0].num_bytes == 1 << 33
    round_trip(
        worker_pb2.DecodeRequest(request_id="r", prompt_token_ids=[1, 2], first_token_id=42, wait_ms=100)
    )
    round_trip(
        worker_pb2.DecodeResponse(
            complete=client_pb2.Complete(finish_reason=client_pb2.FINISH_REASON_ABORT, usage=full_usage())
        )
    )
    stats = round_trip(full_stats_response())
    assert stats.groups[0].prefix_cache.num_hit_tokens == 128
