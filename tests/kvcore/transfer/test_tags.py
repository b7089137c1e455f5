import pytest

from kvcore.transfer import TransferAgent
from kvcore.transfer.tags import (
    MAX_CHUNKS,
    MAX_GROUPS,
    make_tag,
    message_tag,
    request_tag,
    split_tag,
)
from tests.kvcore.conftest import make_cache


def test_request_tag_is_stable_and_leaves_low_bits_free():
    base = request_tag("req-1")
    assert base == request_tag("req-1")  # no per-process hash salt
    assert base & 0xFFFFFF == 0
    assert base != request_tag("req-2")
    assert 0 <= base < 1 << 64


def test_request_tag_exact_value():
    # Top 40 bits of little-endian BLAKE2b-64(b"req-1"), in bits 63..24: fixed forever,
    # since prefill and decode workers of different versions must agree.
    assert request_tag("req-1") == 0x0B874A57DE000000


def test_message_tag_layout_round_trips():
    base = request_tag("req-1")
    tag = message_tag(base, 3, 513)
    assert tag == base | 3 << 16 | 513
    assert split_tag(tag) == (base, 3, 513)
    assert make_tag("req-1", 3, 513) == tag
    assert split_tag(make_tag("r", MAX_GROUPS - 1, MAX_CHUNKS - 1))[1:] == (255, 65535)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"group_index": MAX_GROUPS, "chunk": 0}, "group_index"),
        ({"group_index": -1, "chunk": 0}, "group_index"),
        ({"group_index": 0, "chunk": MAX_CHUNKS}, "chunk"),
        ({"group_index": 0, "chunk": -1}, "chunk"),
    ],
)
def test_out_of_range_fields_name_themselves(kwargs, field):
    with pytest.raises(ValueError, match=field):
        make_tag("req-1", **kwargs)


def test_bad_base_and_request_id():
    with pytest.raises(ValueError, match="base_tag"):
        message_tag(request_tag("r") | 1, 0, 0)
    with pytest.raises(ValueError, match="request_id"):
        request_tag("")
    with pytest.raises(ValueError, match="tag"):
        split_tag(1 << 64)


def test_each_reservation_gets_a_fresh_base_tag_from_its_agent():
    """A retried request must not reuse its earlier attempt's tag, on one worker or two."""
    manager, pools = make_cache()
    first, second = (TransferAgent(manager, pools, hidden_size=8) for _ in range(2))
    tags = [first.transfer_tag("r"), first.transfer_tag("r"), second.transfer_tag("r")]
    assert len(set(tags)) == 3
    assert all(t & 0xFFFFFF == 0 for t in tags)  # base tags: group and chunk bits free
