import numpy as np
import pytest
import torch

from kvcore.transfer.buffers import as_ucx_array


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.int64]
)
def test_tensor_of_any_dtype_is_a_byte_view(dtype):
    tensor = torch.zeros(3, 5, dtype=dtype)
    array = as_ucx_array(tensor, writable=True)
    assert array.nbytes == tensor.numel() * tensor.element_size()
    assert array.ptr == tensor.data_ptr()  # shares memory, no copy


def test_offset_view_keeps_its_own_start():
    pool = torch.zeros(4, 8, dtype=torch.bfloat16)
    page = pool[2]
    array = as_ucx_array(page, writable=False)
    assert array.ptr == page.data_ptr() and array.nbytes == 16


def test_numpy_and_bytes():
    arr = np.arange(10, dtype=np.int32)
    assert as_ucx_array(arr, writable=True).ptr == arr.ctypes.data
    assert as_ucx_array(b"abcd", writable=False).nbytes == 4


def test_non_contiguous_is_refused():
    with pytest.raises(ValueError, match="buffer"):
        as_ucx_array(torch.zeros(4, 4).t(), writable=False)
    with pytest.raises(ValueError, match="buffer"):
        as_ucx_array(np.zeros((4, 4))[:, :2], writable=False)


def test_read_only_is_refused_for_receive():
    with pytest.raises(ValueError, match="writable"):
        as_ucx_array(b"abcd", writable=True)


def test_non_buffer_is_refused():
    with pytest.raises(ValueError, match="buffer"):
        as_ucx_array(object(), writable=False)
