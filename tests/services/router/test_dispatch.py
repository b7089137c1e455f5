"""RequestFlow without worker processes: refusals, no pair, retries around workers nobody can
reach, and the usage it reports."""

from __future__ import annotations

import asyncio

import pytest

from proto.tandem.v1 import client_pb2 as cpb
from services.router.dispatch import MAX_ATTEMPTS
from services.router.errors import ErrorCode, RouterError
from services.router.messages import Usage
from tests.services.router.helpers import router, unreachable_ready_pairs

PROMPT = [5, 6, 7, 8, 9]


def _request(rid: str = "r", prompt=PROMPT, max_tokens: int = 4) -> cpb.GenerateRequest:
    return cpb.GenerateRequest(
        request_id=rid, token_ids=cpb.TokenIds(ids=prompt), sampling=cpb.SamplingParams(max_tokens=max_tokens)
    )


def _failed(rid: str, message: str) -> list[cpb.GenerateResponse]:
    return [
        cpb.GenerateResponse(request_id=rid, error=cpb.Error(message=message)),
        cpb.GenerateResponse(
            request_id=rid, complete=cpb.Complete(finish_reason=cpb.FINISH_REASON_ERROR, usage=cpb.Usage())
        ),
    ]


async def _messages(api, request) -> list[cpb.GenerateResponse]:
    return [m async for m in api.generate(request)]


def _requests(api, status: str) -> float:
    return api.metrics.requests.labels("router", status)._value.get()


def test_without_a_pair_a_request_fails_naming_it_and_is_counted():
    api = router()
    messages = asyncio.run(_messages(api, _request()))
    assert messages == _failed("r", "no ready prefill/decode pair")
    assert _requests(api, "error") == 1 and api.flows == {}
    assert api.metrics.running.labels("router")._value.get() == 0


def test_unreachable_decode_workers_are_tried_until_the_attempts_run_out():
    api = router()

    async def scenario():
        await unreachable_ready_pairs(api, ["p0"], ["d0", "d1", "d2", "d3"])
        messages = await _messages(api, _request())
        await api.close()
        return messages

    messages = asyncio.run(scenario())
    assert MAX_ATTEMPTS == 3
    assert messages == _failed("r", "no ready prefill/decode pair (tried ['d0', 'd1', 'd2'])")
    workers = api.cluster.registry.workers.values()
    assert [(w.id, w.inflight, w.busy_pages) for w in workers] == [(w.id, 0, 0) for w in workers]


def test_a_running_request_id_is_refused_and_freed_when_it_ends():
    api = router()

    async def scenario():
        first = api.generate(_request("dup"))
        head = await anext(first)  # the flow is admitted and suspended at its first message
        with pytest.raises(RouterError) as refused:
            await anext(api.generate(_request("dup")))
        rest = [m async for m in first]
        again = await _messages(api, _request("dup"))
        return [head, *rest], refused.value, again

    messages, refused, again = asyncio.run(scenario())
    assert (refused.code, refused.message) == (ErrorCode.ALREADY_EXISTS, "request_id: 'dup' is running")
    assert messages == again == _failed("dup", "no ready prefill/decode pair")
    assert _requests(api, "error") == 2


def test_a_request_id_is_the_clients_own_another_clients_running_id_is_no_answer():
    """A client's running id refused another client too: an oracle of which ids others run."""
    api = router()

    async def scenario():
        mine = api.generate(_request("shared"), owner="alice")
        await anext(mine)  # admitted, running
        theirs = [m async for m in api.generate(_request("shared"), owner="bob")]
        found = (await api.abort("shared", owner="bob"), await api.abort("shared", owner="alice"))
        return theirs, found, [m async for m in mine]

    theirs, found, _ = asyncio.run(scenario())
    assert theirs == _failed("shared", "no ready prefill/decode pair")  # admitted as any request
    assert found == (False, True)  # bob's ended; only alice may abort hers


def test_an_invalid_request_is_refused_naming_the_field_before_it_runs():
    api = router()
    with pytest.raises(RouterError) as refused:
        asyncio.run(_messages(api, _request(max_tokens=100)))
    assert refused.value.code == ErrorCode.INVALID_ARGUMENT
    assert (
        refused.value.message
        == "sampling.max_tokens: 100 exceeds the 59 tokens left in the 64-token context "
        "after the 5-token prompt"
    )
    assert api.flows == {} and _requests(api, "error") == 0


def test_aborting_an_unknown_request_finds_nothing():
    assert asyncio.run(router().abort("nobody")) is False


def test_usage_is_decodes_with_the_prompts_counts_and_the_first_token_from_prefill():
    prefill = cpb.Usage(
        prompt_tokens=9,
        cached_tokens=4,
        completion_tokens=1,
        cached_tokens_per_group=[cpb.GroupTokens(group="target", num_tokens=4)],
        transfers=[cpb.GroupTransfer(group="target", num_bytes=512, seconds=0.5)],
    )
    decode = cpb.Usage(prompt_tokens=10, completion_tokens=6, acceptance_length=2.0, num_drafts=3)
    assert Usage(prefill, decode).merged() == cpb.Usage(
        prompt_tokens=9,
        cached_tokens=4,
        completion_tokens=7,
        acceptance_length=2.0,
        num_drafts=3,
        cached_tokens_per_group=[cpb.GroupTokens(group="target", num_tokens=4)],
        transfers=[cpb.GroupTransfer(group="target", num_bytes=512, seconds=0.5)],
    )
