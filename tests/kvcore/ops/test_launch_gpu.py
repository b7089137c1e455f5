"""Triton launches through the compiled launcher (kvcore/ops/launch.py): the same kernel,
grid and stream as ``JITFunction.run`` would use."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
launch = pytest.importorskip("kvcore.ops.launch")
knobs = pytest.importorskip("triton.knobs")


@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, factor, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    tl.store(out_ptr + i, tl.load(x_ptr + i, mask=mask) * factor, mask=mask)


@pytest.fixture
def scale():
    assert launch.SUPPORTED, f"triton {triton.__version__}: kvcore.ops.launch does not know its internals"
    return launch.fast_launch(_scale_kernel)


def run(kernel, x: torch.Tensor, factor: float = 3.0) -> torch.Tensor:
    out = torch.zeros_like(x)
    kernel[(triton.cdiv(x.numel(), 64),)](x, out, x.numel(), factor, BLOCK=64)
    return out


def counting(monkeypatch) -> list:
    calls = []
    original = _scale_kernel.run

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_scale_kernel, "run", counted)
    return calls


def test_a_seen_specialization_skips_triton_and_computes_the_same(scale, monkeypatch):
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    calls = counting(monkeypatch)
    first, second = run(scale, x), run(scale, x)
    assert torch.equal(first, x * 3) and torch.equal(second, x * 3)
    assert len(calls) == 1 and len(scale._compiled) == 1
    assert torch.equal(run(scale, x, 0.5), x * 0.5)  # a float argument is not specialized on
    assert len(calls) == 1


def test_each_new_specialization_goes_through_triton_once(scale, monkeypatch):
    x = torch.arange(1000, device="cuda", dtype=torch.float32)
    calls = counting(monkeypatch)
    cases = [x, x[1:], x[:1], x[:32], x.half()]  # aligned; unaligned; n == 1; n % 16 == 0; fp16
    for case in cases * 2:
        assert torch.equal(run(scale, case), case * 3)
    assert len(calls) == len(cases) == len(scale._compiled)


def test_launches_go_to_the_current_stream_and_capture_in_a_graph(scale):
    x = torch.arange(256, device="cuda", dtype=torch.float32)
    out = torch.zeros_like(x)
    launch_it = lambda: scale[(4,)](x, out, x.numel(), 2.0, BLOCK=64)  # noqa: E731
    launch_it()  # seen: the capture below takes the direct path
    torch.cuda.synchronize()
    out.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch_it()
    assert not out.any()  # captured, not run
    x.copy_(torch.arange(256, device="cuda", dtype=torch.float32) + 1)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, (torch.arange(256, device="cuda", dtype=torch.float32) + 1) * 2)


def test_a_registered_launch_hook_sees_every_launch(scale):
    x = torch.arange(100, device="cuda", dtype=torch.float32)
    run(scale, x)
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(run(scale, x), x * 3)
        assert torch.equal(run(scale, x), x * 3)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_scale_kernel", "_scale_kernel"]
