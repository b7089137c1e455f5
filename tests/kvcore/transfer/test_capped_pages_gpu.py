"""The capped, split page transfer of test_capped_pages.py with CUDA pools: both processes
on cuda:0 (UCX moves the messages between them by cuda_ipc, or whatever it picks on one
GPU), whole pages pool to pool, packed, and head-sliced on the GPU's side stream."""

from __future__ import annotations

import pytest
import torch

from tests.kvcore.transfer import capped_session
from tests.kvcore.transfer.capped_session import CASES, check_capped, check_landed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def reports() -> dict[str, dict]:
    return capped_session.run_pair("cuda:0")


@pytest.mark.parametrize("case", CASES)
def test_split_pages_arrive_bit_exact_between_two_processes_on_one_gpu(reports, case):
    check_landed(reports, case)
    check_capped(reports, case)


def test_pools_are_empty_after_the_requests_are_freed_on_cuda(reports):
    for role, report in reports.items():
        for case in CASES:
            assert set(report[case]["used"].values()) == {0}, (role, case)
