"""Under a message cap that splits every group, pages still arrive bit for bit between
two real processes over loopback UCX (tests/kvcore/transfer/capped_session.py): whole
pages pool to pool, whole pages packed, and a head slice packed and unpacked; exactly the
reserved pages (and heads) are written, no page message exceeds the cap, and both sides'
pools are empty once the request is freed."""

from __future__ import annotations

import pytest

from tests.kvcore.transfer import capped_session
from tests.kvcore.transfer.capped_session import CASES, check_capped, check_landed


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return capped_session.run_pair("cpu")


@pytest.mark.parametrize("case", CASES)
def test_split_pages_arrive_bit_exact_in_the_reserved_pages(reports, case):
    check_landed(reports, case)


@pytest.mark.parametrize("case", CASES)
def test_no_page_message_exceeds_the_cap(reports, case):
    check_capped(reports, case)


def test_pools_are_empty_after_the_requests_are_freed(reports):
    for role, report in reports.items():
        for case in CASES:
            assert set(report[case]["used"].values()) == {0}, (role, case)
