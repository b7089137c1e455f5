"""Workers registering with the router, and the pair tests that follow (no worker processes:
the pair's workers are addresses nobody listens on)."""

from __future__ import annotations

import asyncio

import pytest

from proto.tandem.v1 import rank_info_pb2 as rpb
from proto.tandem.v1 import registration_pb2 as reg
from services.router.api import RouterSettings
from services.router.errors import ErrorCode, RouterError
from services.router.health import health_response
from services.router.registration import describe_mismatches
from services.router.registry import PairState
from tests.services.router.helpers import PAGE, rank_info, router, until


def _registrations(api, result: str) -> float:
    return api.metrics.registrations.labels(result)._value.get()


def test_a_registration_is_refused_naming_the_first_bad_field():
    api = router()
    good = rank_info("d0", rpb.ROLE_DECODE)
    cases = [
        (rpb.RankInfo(role=rpb.ROLE_DECODE), "rank_info.instance_id: empty"),
        (rpb.RankInfo(instance_id="d0"), "rank_info.role: unspecified"),
        (rpb.RankInfo(instance_id="d0", role=rpb.ROLE_DECODE), "rank_info.grpc_address: empty"),
    ]

    async def scenario():
        refusals = []
        for info, _ in cases:
            with pytest.raises(RouterError) as e:
                await api.registration.register(reg.RegisterRequest(rank_info=info))
            refusals.append((e.value.code, e.value.message))
        accepted = await api.registration.register(reg.RegisterRequest(rank_info=good))
        await api.close()
        return refusals, accepted

    refusals, accepted = asyncio.run(scenario())
    assert refusals == [(ErrorCode.INVALID_ARGUMENT, message) for _, message in cases]
    assert accepted.accepted and list(api.cluster.registry.workers) == ["d0"]
    assert _registrations(api, "accepted") == 1


def test_a_worker_off_the_routers_model_contract_is_refused_naming_each_field():
    api = router(RouterSettings(tokens_per_page=PAGE, model_id="tiny-target"))
    rogue = rank_info("both-0", rpb.ROLE_BOTH)  # aggregated workers are checked alike
    rogue.model_id, rogue.tokens_per_page = "other-model", 16
    good = rank_info("d0", rpb.ROLE_DECODE)
    good.model_id = "tiny-target"

    async def scenario():
        refused = await api.registration.register(reg.RegisterRequest(rank_info=rogue))
        accepted = await api.registration.register(reg.RegisterRequest(rank_info=good))
        await api.close()
        return refused, accepted

    refused, accepted = asyncio.run(scenario())
    assert not refused.accepted
    assert [(m.field, m.local_value, m.peer_value) for m in refused.mismatches] == [
        ("model_id", "'tiny-target'", "'other-model'"),
        ("tokens_per_page", str(PAGE), "16"),
    ]
    assert accepted.accepted
    assert list(api.cluster.registry.workers) == ["d0"]
    assert _registrations(api, "refused") == 1


def test_a_live_instance_id_is_not_taken_over_by_another_identity_or_process():
    api = router()
    first = rank_info("d0", rpb.ROLE_DECODE)
    moved = rank_info("d0", rpb.ROLE_DECODE)  # same id, another address

    async def refusal(info, identity):
        with pytest.raises(RouterError) as e:
            await api.registration.register(reg.RegisterRequest(rank_info=info), identity)
        return e.value.code

    async def scenario():
        await api.registration.register(reg.RegisterRequest(rank_info=first), "worker:d0")
        codes = [
            await refusal(rank_info("d0", rpb.ROLE_DECODE), "worker:d1"),  # d1's token names d1
            await refusal(moved, "cert:proxy"),
            await refusal(moved, "worker:d0"),  # a second process under a live id
        ]
        restart = await api.registration.register(reg.RegisterRequest(rank_info=first), "worker:d0")
        api.cluster.registry.workers["d0"].healthy = False  # the health check lost it
        replaced = await api.registration.register(reg.RegisterRequest(rank_info=moved), "worker:d0")
        await api.close()
        return codes, restart, replaced

    codes, restart, replaced = asyncio.run(scenario())
    assert codes == [ErrorCode.PERMISSION_DENIED, ErrorCode.PERMISSION_DENIED, ErrorCode.ALREADY_EXISTS]
    assert restart.accepted and replaced.accepted
    assert api.cluster.registry.workers["d0"].info.grpc_address == moved.grpc_address


def test_heartbeat_and_deregister_need_the_identity_a_worker_registered_with():
    api = router()

    async def scenario():
        await api.registration.register(
            reg.RegisterRequest(rank_info=rank_info("d0", rpb.ROLE_DECODE)), "cert:d0"
        )
        with pytest.raises(RouterError) as beat_refused:
            api.registration.heartbeat("d0", "cert:rogue")
        with pytest.raises(RouterError) as deregister_refused:
            await api.registration.deregister("d0", "cert:rogue")
        refused = [beat_refused.value.code, deregister_refused.value.code]
        beat = api.registration.heartbeat("d0", "cert:d0")
        removed = await api.registration.deregister("d0", "cert:d0")
        await api.close()
        return refused, beat, removed

    refused, beat, removed = asyncio.run(scenario())
    assert refused == [ErrorCode.PERMISSION_DENIED, ErrorCode.PERMISSION_DENIED]
    assert beat.registered and removed


def test_a_worker_registers_heartbeats_lists_and_deregisters():
    api = router()
    decode, prefill = rank_info("d0", rpb.ROLE_DECODE), rank_info("p0", rpb.ROLE_PREFILL)
    registration = api.registration

    async def scenario():
        await registration.register(reg.RegisterRequest(rank_info=decode))
        await registration.register(reg.RegisterRequest(rank_info=prefill))
        listed = [
            registration.list_peers(role)
            for role in (rpb.ROLE_DECODE, rpb.ROLE_PREFILL, rpb.ROLE_UNSPECIFIED)
        ]
        beats = [registration.heartbeat(i) for i in ("d0", "nobody")]
        removed = [await registration.deregister("d0"), await registration.deregister("d0")]
        after = registration.heartbeat("d0")
        channels = list(api.cluster.channels)
        await api.close()
        return listed, beats, removed, after, channels

    listed, beats, removed, after, channels = asyncio.run(scenario())
    assert listed == [[decode], [prefill], [decode, prefill]]
    assert [(b.registered, b.interval_ms) for b in beats] == [(True, 1000), (False, 1000)]
    assert removed == [True, False] and not after.registered
    assert channels == ["p0"] and api.cluster.registry.pairs == {}


def test_a_pair_that_cannot_be_reached_fails_naming_the_decode_side_first():
    api = router()
    registry = api.cluster.registry

    async def scenario():
        await api.registration.register(reg.RegisterRequest(rank_info=rank_info("d0", rpb.ROLE_DECODE)))
        await api.registration.register(reg.RegisterRequest(rank_info=rank_info("p0", rpb.ROLE_PREFILL)))
        await until(lambda: registry.pairs[("p0", "d0")].state != PairState.PENDING)
        health = await api.health()
        await api.close()
        return health

    health = asyncio.run(scenario())
    pair = registry.pairs[("p0", "d0")]
    assert pair.state == PairState.FAILED and pair.reason.startswith("d0: UNAVAILABLE: ")
    assert (_registrations(api, "accepted"), _registrations(api, "refused")) == (2, 1)
    assert health.message == f"no ready prefill/decode pair. p0->d0: {pair.describe()}"
    assert pair.describe() == f"{pair.reason} (failures in a row: 1; re-pairing every 0.5 s)"
    assert (health.num_prefill_workers, health.num_decode_workers, health.num_ready_pairs) == (1, 1, 0)


def test_registering_again_replaces_the_workers_channel_and_retests_its_pairs():
    api = router()
    registry = api.cluster.registry

    decode = rank_info("d0", rpb.ROLE_DECODE)

    async def scenario():
        for info in (decode, rank_info("p0", rpb.ROLE_PREFILL)):
            await api.registration.register(reg.RegisterRequest(rank_info=info))
        await until(lambda: registry.pairs[("p0", "d0")].state == PairState.FAILED)
        first = api.cluster.channels["d0"]
        await api.registration.register(reg.RegisterRequest(rank_info=decode))  # restarted, same address
        states = [registry.pairs[("p0", "d0")].state]
        await until(lambda: registry.pairs[("p0", "d0")].state != PairState.PENDING)
        states.append(registry.pairs[("p0", "d0")].state)
        replaced = api.cluster.channels["d0"] is not first
        await api.close()
        return states, replaced

    states, replaced = asyncio.run(scenario())
    assert states == [PairState.PENDING, PairState.FAILED] and replaced
    assert (_registrations(api, "accepted"), _registrations(api, "refused")) == (3, 2)


def test_mismatches_are_described_field_by_field():
    response = reg.RegisterResponse(
        accepted=False,
        mismatches=[
            reg.Mismatch(field="kv_layout", local_value="SEPARATE", peer_value="UNIFIED"),
            reg.Mismatch(field="tp_size", local_value="2", peer_value="3", reason="3 KV heads do not split"),
        ],
    )
    assert describe_mismatches(response) == (
        "kv_layout: local SEPARATE vs peer UNIFIED; tp_size: local 2 vs peer 3 (3 KV heads do not split)"
    )


def test_health_names_every_refused_or_failed_pair_and_counts_aggregated_workers_twice():
    api = router()
    registry = api.cluster.registry
    for info in (
        rank_info("d0", rpb.ROLE_DECODE),
        rank_info("p0", rpb.ROLE_PREFILL),
        rank_info("p1", rpb.ROLE_PREFILL),
        rank_info("a0", rpb.ROLE_BOTH),
    ):
        registry.add(info)
    registry.set_pair("p0", "d0", PairState.REFUSED, "d0 refused p0: kv_layout: local A vs peer B")
    registry.set_pair("p1", "d0", PairState.READY)
    health = health_response(registry)
    assert (health.num_prefill_workers, health.num_decode_workers, health.num_ready_pairs) == (3, 2, 1)
    assert health.num_aggregated_workers == 1
    registry.workers["a0"].healthy = False  # lost: no longer counted
    health = health_response(registry)
    assert (health.num_prefill_workers, health.num_decode_workers, health.num_ready_pairs) == (2, 1, 1)
    assert health.num_aggregated_workers == 0
    assert health.message == "p0->d0: d0 refused p0: kv_layout: local A vs peer B"
