"""The TransferAgent the servers run moves pages bit for bit, between real processes over
UCX and between coroutines of one process over the fake transport (tests.kvcore.transfer.runs).

TP groups: four processes (prefill ranks P0, P1; decode ranks D0, D1) pair and then run
TP 1 -> 1, 1 -> 2, 2 -> 1 and 2 -> 2 at once through the agent and its rank fan-out. The
target group has 4 KV heads (2 + 2 under TP 2), the windowed draft group 1 (replicated
under TP 2). Each decode rank's reserved pages must hold exactly its heads of the
sender's pages.

TP 1 pair: every layout (unified, separate, windowed target, pages held by the decode
side's prefix cache), the pairing side channel, and a receive that times out.
"""

from __future__ import annotations

import pytest
import torch

from kvcore import KVPools
from kvcore.transfer import heads_of_rank
from kvcore.transfer.head_routes import head_routes
from tests.kvcore.transfer import pair_session, runs, sessions
from tests.kvcore.transfer.sessions import HEADS, NUM_TOKENS, SCENARIOS, rid


@pytest.fixture(scope="module", params=runs.BACKENDS)
def tp_reports(request) -> dict[str, dict]:
    return runs.tp_reports(request.param)


def _sent():
    """The TP 1 sender's whole pools and the pages it sends (page ids are every rank's)."""
    whole = sessions.seeded(KVPools.allocate(sessions.tp_config(1)), 7).tensors()
    sender, _ = sessions.rank_state("P", 0, (1, 1))
    return whole, sender.transfer_pages(rid(1, 1), NUM_TOKENS)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s[0]}to{s[1]}")
def test_each_decode_rank_holds_exactly_its_heads_of_the_prefill_pages(tp_reports, scenario):
    src_tp, dst_tp = scenario
    whole, sent = _sent()
    for dst in range(dst_tp):
        got = tp_reports[f"D{dst}"]["landed"][rid(*scenario)]
        assert set(got) == set(HEADS)
        for g, (first, ids, bits) in got.items():
            held = heads_of_rank(HEADS[g], dst_tp, dst)
            expected = whole[g][sent[g].page_ids][:, :, :, held.start : held.stop]
            assert first == sent[g].first_page
            assert len(ids) == len(sent[g].page_ids)
            assert bits == expected.contiguous().view(torch.uint8).numpy().tobytes(), (dst, g)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: f"{s[0]}to{s[1]}")
def test_usage_adds_every_route_once_and_counts_pages_once(tp_reports, scenario):
    """Bytes sum over every rank pair's route; a replicated head goes once per receiver."""
    config = sessions.tp_config(1)
    _, sent = _sent()
    expected = {}
    for g, h in HEADS.items():
        spec = next(s for s in config.groups if s.name == g)
        head_page = spec.page_bytes(config.tokens_per_page) // h
        routed = sum(r.num_heads for r in head_routes(h, *scenario))
        expected[g] = routed * head_page * len(sent[g].page_ids)
    pages = {g: len(p.page_ids) for g, p in sent.items()}
    assert tp_reports["P0"]["usage"][rid(*scenario)] == (expected, pages)
    assert tp_reports["D0"]["usage"][rid(*scenario)] == (expected, pages)


def test_a_cancelled_receive_cancels_the_other_ranks_job(tp_reports):
    assert tp_reports["D0"]["cancel"] == "CancelledError"
    assert tp_reports["D1"]["outcomes"]["cancelled"] == 1
    assert tp_reports["D1"]["outcomes"]["failed"] == tp_reports["P1"]["outcomes"]["failed"] == 0


# ---------------------------------------------------------------- TP 1 pair


@pytest.fixture(scope="module", params=runs.BACKENDS)
def pair_reports(request) -> tuple[dict, dict]:
    return runs.pair_reports(request.param)


@pytest.mark.parametrize("case", list(pair_session.CASES))
def test_pages_of_every_travelling_group_land_bit_exactly(pair_reports, case):
    sent_report, got_report = pair_reports
    sender, pools = pair_session.sender_state(case)
    sent_bytes, sent_pages, sent_held = sent_report[case]
    got_bytes, got_pages, got_held, landed, aux = got_report[case]
    expected = sender.transfer_pages("r", NUM_TOKENS, got_held)
    groups = {"target"} if case == "separate" else {"target", "draft"}
    assert set(landed) == set(expected) == groups
    for g in groups:
        first, ids, bits = landed[g]
        assert first == expected[g].first_page
        assert len(ids) == len(expected[g].page_ids)
        assert bits == pools.tensor(g)[expected[g].page_ids].view(torch.uint8).numpy().tobytes()
    page_bytes = {g: sender.groups[g].page_bytes(4) for g in groups}
    assert got_bytes == sent_bytes == {g: page_bytes[g] * len(expected[g].page_ids) for g in groups}
    assert got_pages == sent_pages == {g: len(expected[g].page_ids) for g in groups}
    assert sent_held == got_held
    assert aux == (NUM_TOKENS, 42, [float(i) for i in range(sessions.HIDDEN)], "prefill")


def test_windows_and_held_pages_start_the_transfer_late(pair_reports):
    """At 22 tokens a window of 8 spans pages 3..5; 12 cached tokens hold pages 0..2."""
    _, got = pair_reports
    starts = {case: {g: landed[0] for g, landed in got[case][3].items()} for case in pair_session.CASES}
    assert starts["unified"] == {"target": 0, "draft": 3}
    assert starts["separate"] == {"target": 0}
    assert starts["windowed"] == {"target": 3, "draft": 3}
    assert starts["held"]["target"] == 3
    assert got["held"][2]["target"] == 3


def test_the_side_channel_carries_typed_messages(pair_reports):
    sent, got = pair_reports
    assert (got["ranks"], sent["verdict"], got["final"]) == (b"ranks", b"accepted", b"")


def test_a_receive_nobody_sends_times_out_and_leaks_nothing(pair_reports):
    _, got = pair_reports
    assert got["silent"] == "TransferTimeout"
    assert got["used"] == {"target": 0, "draft": 0}


def test_a_receiver_that_cannot_take_the_aux_state_refuses_it_and_the_sender_hears_why(pair_reports):
    """Without the refusal the sender would wait out its deadline for an acknowledgement
    (and, with pages of MiBs, inside a send that no receive ever matches)."""
    sent, got = pair_reports
    wide, takes = pair_session.WIDE, sessions.HIDDEN
    why = f"request 'r': aux state carries {wide} hidden values, this worker takes {takes}"
    assert got["refusing"] == why
    assert sent["refused"] == f"the receiver refused the transfer: {why}"
