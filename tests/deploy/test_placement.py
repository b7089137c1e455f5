"""Where `tandem up --device cuda` puts each worker: its own GPU, or TP group of GPUs, and
which share of a GPU's memory each worker that shares one takes by default."""

from __future__ import annotations

import pytest
import torch

from deploy import cli
from deploy.cli import build_parser
from deploy.local import LocalCluster
from deploy.placement import gpu_bases, memory_shares, visible_gpus


@pytest.mark.parametrize(
    "sizes, gpus, bases",
    [
        ([1, 1], 2, [0, 1]),  # prefill GPU 0, decode GPU 1
        ([2, 1], 3, [0, 2]),  # prefill TP 2 on GPUs 0-1 -> decode on GPU 2
        ([1, 2], 4, [0, 1]),  # decode TP 2 on GPUs 1-2
        ([1, 1, 1], 2, [0, 1, 0]),  # more workers than GPUs: wrap and share
        ([2, 2], 2, [0, 0]),  # a TP group never straddles the wrap
        ([1, 1], 0, [0, 0]),  # no GPU count known: all on GPU 0
    ],
)
def test_each_worker_takes_its_tp_size_of_gpus_in_start_order(sizes, gpus, bases):
    assert gpu_bases(sizes, gpus) == bases


def _worker_devices(argv: list[str]) -> list[tuple[str, str]]:
    cluster = LocalCluster.from_args(build_parser().parse_args(["up", *argv]))
    devices = []
    for role, extra in zip(cluster.roles, cluster.extra, strict=True):
        flags = [*cluster.worker_args, *extra]
        last = max(i for i, f in enumerate(flags) if f == "--device") if "--device" in flags else None
        devices.append((role, flags[last + 1] if last is not None else "cpu"))
    return devices


def test_up_places_workers_on_their_own_gpus_with_device_cuda():
    assert _worker_devices(["--device", "cuda", "--gpus", "3", "--prefill-tp", "2"]) == [
        ("prefill", "cuda:0"),
        ("decode", "cuda:2"),
    ]
    assert _worker_devices(["--device", "cuda", "--gpus", "2", "--prefill", "2"]) == [
        ("prefill", "cuda:0"),
        ("prefill", "cuda:1"),
        ("decode", "cuda:0"),
    ]


def test_an_explicit_gpu_or_the_cpu_is_left_as_given():
    assert _worker_devices(["--device", "cuda:1"]) == [("prefill", "cuda:1"), ("decode", "cuda:1")]
    assert _worker_devices([]) == [("prefill", "cpu"), ("decode", "cpu")]


def test_the_visible_gpus_are_cuda_visible_devices_when_set(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    assert visible_gpus() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert visible_gpus() == 0


def test_gpus_without_device_cuda_is_refused_naming_it():
    with pytest.raises(SystemExit, match="gpus: places workers with --device cuda, not 'cuda:1'"):
        _worker_devices(["--device", "cuda:1", "--gpus", "2"])


@pytest.mark.parametrize(
    "bases, sizes, shares",
    [
        ([0, 1], [1, 1], [0.9, 0.9]),  # a GPU each: the whole default
        ([0, 0], [1, 1], [0.45, 0.45]),  # two on GPU 0
        ([0, 1, 0], [1, 1, 1], [0.45, 0.9, 0.45]),  # wrapped: GPU 0 holds two, GPU 1 one
        ([0, 0], [2, 1], [0.45, 0.45]),  # TP 2 on GPUs 0-1 and one more on GPU 0
        ([0, 0, 0], [1, 1, 1], [0.3, 0.3, 0.3]),
        ([3] * 7, [1] * 7, [0.1285] * 7),  # 0.9 / 7 = 0.128571..., rounded down
    ],
)
def test_the_default_fraction_is_split_among_the_ranks_on_a_gpu(bases, sizes, shares):
    assert memory_shares(bases, sizes, 0.9) == shares


def _worker_fractions(argv: list[str]) -> list[str | None]:
    """Each worker's --gpu-memory-utilization (the last one given), None without one."""
    cluster = LocalCluster.from_args(build_parser().parse_args(["up", *argv]))
    out = []
    for extra in cluster.extra:
        flags = [*cluster.worker_args, *extra]
        given = [flags[i + 1] for i, f in enumerate(flags) if f == "--gpu-memory-utilization"]
        out.append(given[-1] if given else None)
    return out


def test_up_gives_workers_that_share_a_gpu_their_share_of_the_default_and_says_so(capsys):
    assert _worker_fractions(["--device", "cuda", "--gpus", "1"]) == ["0.45", "0.45"]
    assert "a prefill worker shares GPU 0: --gpu-memory-utilization 0.45" in capsys.readouterr().err
    assert _worker_fractions(["--device", "cuda", "--gpus", "2"]) == [None, None]  # the worker's 0.9
    assert _worker_fractions(["--device", "cuda:1", "--prefill", "2"]) == ["0.3", "0.3", "0.3"]
    # prefill TP 2 on GPUs 0-1, decode on GPU 2, the second decode wraps to GPU 0
    wrapped = ["--device", "cuda", "--gpus", "3", "--prefill-tp", "2", "--decode", "2"]
    assert _worker_fractions(wrapped) == ["0.45", None, "0.45"]


def test_a_given_fraction_or_kv_size_is_each_workers_own():
    assert _worker_fractions(["--device", "cuda", "--gpus", "1", "--gpu-memory-utilization", "0.4"]) == [
        "0.4",
        "0.4",
    ]
    assert _worker_fractions(["--device", "cuda", "--gpus", "1", "--kv-cache-mb", "4096"]) == [None, None]
    assert _worker_fractions([]) == [None, None]  # CPU: 256 MiB each, no fraction


def test_device_cuda_on_a_torch_without_cuda_is_refused_naming_it_before_placing(monkeypatch, capsys):
    """Not "2 worker ranks share 1 GPU(s)" and then torch's assertion in every worker."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    refusal = "tandem: device: --device cuda, but torch sees no CUDA device; use --device cpu"
    with pytest.raises(SystemExit, match=refusal):
        cli.main(["up", "--device", "cuda"])
    assert "share" not in capsys.readouterr().err
    with pytest.raises(SystemExit, match=refusal):
        cli.checked_engine_config(
            build_parser().parse_args(["worker", "--role", "decode", "--device", "cuda"])
        )


def test_a_gpu_past_the_last_one_torch_sees_is_refused(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    worker = ["worker", "--role", "decode", "--device"]
    assert cli.checked_engine_config(build_parser().parse_args([*worker, "cuda:1"])).device == "cuda:1"
    with pytest.raises(SystemExit, match=r"device: --device cuda:2, but torch sees 2 CUDA device\(s\)"):
        cli.checked_engine_config(build_parser().parse_args([*worker, "cuda:2"]))
