"""check_peer: every refused field is named with both values; compatible peers pass."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proto.tandem.v1 import rank_info_pb2 as pb
from services.common.peer_check import Mismatch, check_peer, format_mismatches, mismatches_to_proto
from tests.services.common.peer_samples import make_info, prefill_and_decode


def set_field(path: str, value):
    """A mutation of the peer: ``path`` is "field" or "groups[i].field"."""

    def mutate(info: pb.RankInfo) -> None:
        target, _, name = path.rpartition(".")
        message = info.groups[int(target[7:-1])] if target else info
        if isinstance(value, list):
            message.ClearField(name)
            getattr(message, name).extend(value)
        else:
            setattr(message, name, value)

    return mutate


# (mutation of the peer, refused field, local value, peer value)
FIELD_CASES = [
    (set_field("schema_version", 2), "schema_version", "1", "2"),
    (set_field("model_id", "qwen"), "model_id", "'llama'", "'qwen'"),
    (set_field("drafter_id", "other-eagle"), "drafter_id", "'llama-eagle'", "'other-eagle'"),
    (set_field("drafter_kind", "medusa"), "drafter_kind", "'eagle3'", "'medusa'"),
    (set_field("tokens_per_page", 32), "tokens_per_page", "16", "32"),
    (set_field("kv_layout", pb.KV_LAYOUT_SEPARATE), "kv_layout", "KV_LAYOUT_UNIFIED", "KV_LAYOUT_SEPARATE"),
    (set_field("num_draft_layers", 2), "num_draft_layers", "1", "2"),
    (set_field("num_spec_tokens", 5), "num_spec_tokens", "3", "5"),
    (set_field("draft_block_width", 4), "draft_block_width", "1", "4"),
    (
        set_field("groups[1].owner", pb.GROUP_OWNER_TARGET),
        "groups[draft].owner",
        "GROUP_OWNER_DRAFT",
        "GROUP_OWNER_TARGET",
    ),
    (
        set_field("groups[1].lifecycle", pb.LIFECYCLE_REQUIRED),
        "groups[draft].lifecycle",
        "LIFECYCLE_OPTIONAL",
        "LIFECYCLE_REQUIRED",
    ),
    (set_field("groups[1].layer_ids", [5]), "groups[draft].layer_ids", "[4]", "[5]"),
    (set_field("groups[0].layer_ids", [0, 1, 2]), "groups[target].layer_ids", "[0, 1, 2, 3]", "[0, 1, 2]"),
    (
        set_field("groups[1].dtype", pb.KV_DTYPE_BF16),
        "groups[draft].dtype",
        "KV_DTYPE_FP8_E4M3",
        "KV_DTYPE_BF16",
    ),
    (
        set_field("groups[1].dtype_name", "float8_e4m3fnuz"),
        "groups[draft].dtype_name",
        "'float8_e4m3fn'",
        "'float8_e4m3fnuz'",
    ),
    (set_field("groups[1].element_bytes", 2), "groups[draft].element_bytes", "1", "2"),
    (set_field("groups[0].head_dim", 64), "groups[target].head_dim", "128", "64"),
    (set_field("groups[1].head_dim", 256), "groups[draft].head_dim", "128", "256"),
    (set_field("groups[1].window", 0), "groups[draft].window", "64", "0"),
    (set_field("groups[0].window", 4096), "groups[target].window", "0", "4096"),
    (set_field("groups[0].total_num_kv_heads", 16), "groups[target].total_num_kv_heads", "8", "16"),
    (set_field("role", pb.ROLE_PREFILL), "role", "ROLE_PREFILL", "ROLE_PREFILL"),
    # forced acceptance (benchmarks only): unset (lossless) is not 0 (every draft rejected)
    (set_field("unsafe_forced_acceptance", 0), "unsafe_forced_acceptance", "unset", "0"),
]


@pytest.mark.parametrize(
    "mutate, field, local_value, peer_value", FIELD_CASES, ids=[case[1] for case in FIELD_CASES]
)
def test_each_field_mismatch_is_named(mutate, field, local_value, peer_value):
    local, peer = prefill_and_decode()
    mutate(peer)
    assert [(m.field, m.local, m.peer) for m in check_peer(local, peer)] == [(field, local_value, peer_value)]


def test_identical_geometry_is_accepted():
    assert check_peer(*prefill_and_decode()) == []


def test_fields_outside_the_check_are_ignored():
    local, peer = prefill_and_decode()
    peer.instance_id, peer.tp_rank, peer.pp_rank = "elsewhere", 0, 3
    peer.transfer_endpoint.address, peer.transfer_endpoint.port = b"addr", 4242
    peer.groups[0].num_pages, peer.groups[1].page_bytes = 7, 12345
    assert check_peer(local, peer) == []


def test_a_peer_of_another_transfer_backend_is_refused_naming_both():
    local, peer = prefill_and_decode()
    local.transfer_endpoint.backend, peer.transfer_endpoint.backend = "ucx", "nixl"
    why = "pages move only between transports of one backend"
    assert check_peer(local, peer) == [Mismatch("transfer_endpoint.backend", "'ucx'", "'nixl'", why)]
    named = format_mismatches(check_peer(local, peer))
    assert named == f"transfer_endpoint.backend: local 'ucx', peer 'nixl' ({why})"


def test_group_on_one_side_only():
    local, peer = prefill_and_decode()
    del peer.groups[1]
    assert check_peer(local, peer) == [Mismatch("groups[draft]", "present", "absent")]
    assert check_peer(peer, local) == [Mismatch("groups[draft]", "absent", "present")]


def test_renamed_group_is_two_absences():
    local, peer = prefill_and_decode()
    peer.groups[1].name = "eagle"
    assert check_peer(local, peer) == [
        Mismatch("groups[draft]", "present", "absent"),
        Mismatch("groups[eagle]", "absent", "present"),
    ]


def test_duplicate_group_names_are_refused():
    local, peer = prefill_and_decode()
    peer.groups[1].name = "target"
    assert check_peer(local, peer) == [
        Mismatch("groups", "['target', 'draft']", "['target', 'target']", "group names must be unique")
    ]


@pytest.mark.parametrize(
    "local_role, peer_role",
    [
        (pb.ROLE_PREFILL, pb.ROLE_DECODE),
        (pb.ROLE_DECODE, pb.ROLE_PREFILL),
        (pb.ROLE_BOTH, pb.ROLE_DECODE),
        (pb.ROLE_PREFILL, pb.ROLE_BOTH),
        (pb.ROLE_BOTH, pb.ROLE_BOTH),
    ],
)
def test_complementary_roles_are_accepted(local_role, peer_role):
    assert check_peer(make_info(local_role), make_info(peer_role)) == []


@pytest.mark.parametrize(
    "local_role, peer_role, local_name, peer_name",
    [
        (pb.ROLE_DECODE, pb.ROLE_DECODE, "ROLE_DECODE", "ROLE_DECODE"),
        (pb.ROLE_PREFILL, pb.ROLE_PREFILL, "ROLE_PREFILL", "ROLE_PREFILL"),
        (pb.ROLE_UNSPECIFIED, pb.ROLE_BOTH, "ROLE_UNSPECIFIED", "ROLE_BOTH"),
    ],
)
def test_role_mismatch_is_refused(local_role, peer_role, local_name, peer_name):
    assert check_peer(make_info(local_role), make_info(peer_role)) == [
        Mismatch("role", local_name, peer_name, "roles must be complementary: prefill with decode, or both")
    ]


def test_unknown_enum_value_is_shown_as_its_number():
    local, peer = prefill_and_decode()
    peer.kv_layout = 7
    assert check_peer(local, peer) == [Mismatch("kv_layout", "KV_LAYOUT_UNIFIED", "7")]


def test_format_mismatches_names_field_and_both_values():
    mismatches = [
        Mismatch("tokens_per_page", "16", "32"),
        Mismatch(
            "groups[target].num_kv_heads",
            "3 of 8 heads per rank at tp 3",
            "4 of 8 heads per rank at tp 2",
            "local: 8 KV heads do not split over tp 3",
        ),
    ]
    assert format_mismatches(mismatches) == (
        "tokens_per_page: local 16, peer 32; groups[target].num_kv_heads: local 3 of 8 heads "
        "per rank at tp 3, peer 4 of 8 heads per rank at tp 2 (local: 8 KV heads do not split "
        "over tp 3)"
    )
    assert format_mismatches([]) == ""


def test_mismatches_to_proto():
    [message] = mismatches_to_proto([Mismatch("groups[draft].window", "64", "0")])
    assert (message.field, message.local_value, message.peer_value, message.reason) == (
        "groups[draft].window",
        "64",
        "0",
        "",
    )


_MUTATIONS = st.lists(st.sampled_from(range(len(FIELD_CASES))), unique=True, max_size=6)


@given(_MUTATIONS)
def test_check_is_symmetric_and_names_each_mutated_field(case_indices):
    local, peer = prefill_and_decode()
    for i in case_indices:
        FIELD_CASES[i][0](peer)
    forward = {(m.field, m.local, m.peer) for m in check_peer(local, peer)}
    backward = {(m.field, m.peer, m.local) for m in check_peer(peer, local)}
    assert forward == backward
    assert {m[0] for m in forward} == {FIELD_CASES[i][1] for i in case_indices}


def test_forced_acceptance_must_be_the_same_on_both_sides():
    local, peer = prefill_and_decode()
    local.unsafe_forced_acceptance = peer.unsafe_forced_acceptance = 2
    assert check_peer(local, peer) == []
    peer.unsafe_forced_acceptance = 3
    assert check_peer(local, peer) == [Mismatch("unsafe_forced_acceptance", "2", "3")]
    peer.ClearField("unsafe_forced_acceptance")
    assert check_peer(local, peer) == [Mismatch("unsafe_forced_acceptance", "2", "unset")]
