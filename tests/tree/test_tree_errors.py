"""Bad input: the same exception type and message from both trees (issue 31, item 7).

Each case builds the same small tree in both implementations and makes one bad
call; the two outcomes (exception type and message, or the result) must be
equal. Before the fix the native tree raised a bare ``RuntimeError`` (a
namespace with a lone surrogate, sparse tensors) where the Python tree raised
something else or accepted the input silently (odd-length keys, an int for an
IO status).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from optional import skip_unless
from tree_observation import snapshot

from hicache.tree import IOStatus, RadixTree, native, token_key

pytestmark = skip_unless("native")

SURROGATE = "tenant-\ud800"


def _sparse(values: list[int], dtype=torch.int64) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).to_sparse()


def _node(tree):
    return tree.match_prefix([1, 1]).last_node


CASES = {
    # namespaces with no UTF-8 form: refused where a root would be made, no root on lookup
    "insert_surrogate_namespace": lambda t: t.insert([5, 5], torch.tensor([9]), SURROGATE),
    "insert_host_surrogate_namespace": lambda t: t.insert_host([5, 5], torch.tensor([9]), SURROGATE),
    "match_surrogate_namespace": lambda t: t.match_prefix([1, 1], SURROGATE),
    "root_surrogate_namespace": lambda t: t.root(SURROGATE),
    "probe_surrogate_namespace": lambda t: t.probe_key(token_key([1, 1], 2), SURROGATE),
    "probe_path_surrogate_namespace": lambda t: t.probe_path(token_key([1, 1], 2), SURROGATE),
    # sparse tensors: tokens and page ids
    "match_sparse_int64_tokens": lambda t: t.match_prefix(_sparse([1, 1])),
    "match_sparse_int32_tokens": lambda t: t.match_prefix(_sparse([1, 1], torch.int32)),
    "insert_sparse_tokens": lambda t: t.insert(_sparse([5, 5]), torch.tensor([9])),
    "insert_sparse_pages": lambda t: t.insert([5, 5], _sparse([9])),
    "insert_host_sparse_pages": lambda t: t.insert_host([5, 5], _sparse([9])),
    "attach_host_sparse_pages": lambda t: t.attach_host(_node(t), _sparse([9])),
    "device_indices_of_sparse_extra": lambda t: t.device_indices_of(_node(t), _sparse([9])),
    "attach_host_not_a_tensor": lambda t: t.attach_host(_node(t), [9]),
    # IO status out of range / not an IOStatus
    "set_io_status_int": lambda t: t.set_io_status(_node(t), 1),
    "set_io_status_out_of_range": lambda t: t.set_io_status(_node(t), 7),
    "set_io_status_str": lambda t: t.set_io_status(_node(t), "LOADING"),
    "set_io_status_none_ok": lambda t: t.set_io_status(_node(t), IOStatus.NONE),
    # keys that are not whole pages of int32 tokens, or not bytes
    "match_key_odd_length": lambda t: t.match_key(b"\x01\x02\x03"),
    "match_key_half_page": lambda t: t.match_key(b"\x01\x00\x00\x00"),
    "insert_key_odd_length": lambda t: t.insert_key(b"\x01\x02\x03", torch.tensor([9])),
    "probe_key_odd_length": lambda t: t.probe_key(b"\x01\x02\x03\x04\x05"),
    "probe_path_odd_length": lambda t: t.probe_path(b"\x01"),
    "match_key_str": lambda t: t.match_key("abcdefgh"),
    "match_key_ndarray": lambda t: t.match_key(np.array([1, 1], dtype=np.int32)),
    "insert_key_list": lambda t: t.insert_key([1, 1], torch.tensor([9])),
    "match_key_bytearray_ok": lambda t: t.match_key(bytearray(token_key([1, 1], 2))).device_len,
    # tensors without data, other bad token input
    "match_meta_float_tokens": lambda t: t.match_prefix(torch.empty(4, device="meta")),
    "match_float_tokens": lambda t: t.match_prefix(torch.ones(4)),
    "match_2d_tokens": lambda t: t.match_prefix(torch.ones(2, 2, dtype=torch.int64)),
    "match_3d_ndarray_tokens": lambda t: t.match_prefix(np.ones((1, 2, 2), dtype=np.int32)),
    "match_0d_tokens": lambda t: t.match_prefix(torch.tensor(3)),
    "insert_2d_pages": lambda t: t.insert([5, 5], torch.ones(1, 1, dtype=torch.int64)),
    "match_negative_token": lambda t: t.match_prefix([1, -1]),
    # sizes
    "evict_device_negative": lambda t: t.evict_device(-1),
    "evict_host_float": lambda t: t.evict_host(1.5),
    "path_missing_host_negative": lambda t: t.path_missing_host(_node(t), -1),
    "raise_priority_huge": lambda t: t.raise_priority(_node(t), 2**63),
}


def outcome(tree, case: str):
    try:
        result = CASES[case](tree)
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__, str(exc)
    if isinstance(result, torch.Tensor):
        result = result.tolist()
    if isinstance(result, list):
        result = [getattr(x, "id", x) for x in result]
    return "ok", getattr(result, "id", result)


@pytest.mark.parametrize("case", sorted(CASES))
def test_both_trees_raise_alike(case):
    results = []
    for tree in (RadixTree(2), native.NativeRadixTree(2)):
        tree.insert([1, 1, 2, 2], torch.tensor([0, 1]))
        results.append(outcome(tree, case))
        tree.check_integrity()
    assert results[0] == results[1]
    if not case.endswith("_ok") and "probe" not in case and case != "probe_surrogate_namespace":
        assert results[0][0] in ("ValueError", "TypeError"), results[0]


def test_surrogate_namespace_message():
    for tree in (RadixTree(2), native.NativeRadixTree(2)):
        with pytest.raises(ValueError) as err:
            tree.insert([5, 5], torch.tensor([9]), SURROGATE)
        assert str(err.value) == (
            "namespace: expected a str encodable as UTF-8, got 'tenant-\\ud800'"
        )
        assert tree.probe_key(token_key([5, 5], 2), SURROGATE) == 0
        assert tree.num_nodes == 0


# Token ids read in place (int32 arrays and tensors): the native tree checks them
# after walking the tree, skipping the prefix it matched (stored tokens are valid
# ids). A bad id anywhere must still raise as an eager check would: the same error,
# before anything changes (no node, no namespace root, no clock tick).
def _i32(values: list[int]) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def _store_bad_key(t):
    t.insert_key(_i32([1, 1, -4, 4]).tobytes(), torch.tensor([0, 7]))  # bytes: stored unchecked


def _bad_match_from_split_hook(t):
    seen = []

    def hook(prefix, suffix):
        try:
            t.match_prefix(_i32([1, 1, -1, 1]))
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            seen.append((type(exc).__name__, str(exc)))

    t.on_split = hook
    t.match_prefix([1, 1])
    t.on_split = None
    return seen


IN_PLACE_CASES = {
    "match_bad_id_after_cached_prefix": lambda t: t.match_prefix(_i32([1, 1, 2, 2, 7, -7])),
    "match_bad_id_in_partial_page": lambda t: t.match_prefix(
        torch.tensor([1, 1, 2, 2, -1], dtype=torch.int32)
    ),
    "match_bad_id_first": lambda t: t.match_prefix(_i32([-1, 1, 2, 2])),
    "match_bad_id_new_namespace": lambda t: t.match_prefix(_i32([5, -5]), "fresh"),
    "insert_bad_id_after_cached_prefix": lambda t: t.insert(
        _i32([1, 1, 2, 2, 5, -5]), torch.tensor([0, 1, 9])
    ),
    "insert_bad_id_in_partial_page": lambda t: t.insert(
        torch.tensor([1, 1, 5, 5, -2], dtype=torch.int32), torch.tensor([0, 9])
    ),
    "insert_bad_id_and_bad_pages": lambda t: t.insert(_i32([1, 1, -5, 5]), torch.tensor([0])),
    "insert_bad_id_new_namespace": lambda t: t.insert(_i32([1, 1, 5, -5]), torch.tensor([8, 9]), "fresh"),
    "insert_bad_id_bad_namespace": lambda t: t.insert(_i32([1, 1, 5, -5]), torch.tensor([8, 9]), 3),
    "stored_bad_key_then_match": (_store_bad_key, lambda t: t.match_prefix(_i32([1, 1, -4, 4, 9]))),
    "stored_bad_key_then_insert": (
        _store_bad_key, lambda t: t.insert(_i32([1, 1, -4, 4, 9, 9]), torch.tensor([0, 7, 8]))
    ),
    "bad_match_from_split_hook": _bad_match_from_split_hook,
    "match_ok": lambda t: t.match_prefix(_i32([1, 1, 2, 2, 7])).device_len,
}


@pytest.mark.parametrize("case", sorted(IN_PLACE_CASES))
def test_ids_read_in_place_are_checked_before_any_change(case):
    trees = (RadixTree(2), native.NativeRadixTree(2))
    results, after = [], []
    for tree in trees:
        tree.insert([1, 1, 2, 2, 3, 3], torch.tensor([0, 1, 2]))
        tree.insert([1, 1, 2, 2, 4, 4], torch.tensor([0, 1, 3]))  # a split: [1, 1, 2, 2] ends a node
        setup, call = IN_PLACE_CASES[case] if isinstance(IN_PLACE_CASES[case], tuple) else (
            None, IN_PLACE_CASES[case]
        )
        if setup is not None:
            setup(tree)
        before = snapshot(tree)
        nat_bytes = tree.memory_bytes() if isinstance(tree, native.NativeRadixTree) else None
        try:
            results.append(("ok", call(tree)))
        except Exception as exc:  # noqa: BLE001 - the type is what is compared
            results.append((type(exc).__name__, str(exc)))
            assert snapshot(tree) == before  # raised before changing anything
            if nat_bytes is not None:
                assert tree.memory_bytes() == nat_bytes  # no namespace root made either
        tree.check_integrity()
        # The clock and the node ids went on alike: a later insert leaves equal trees.
        tree.insert([1, 1, 6, 6], torch.tensor([0, 4]), "fresh")
        after.append(snapshot(tree))
    assert results[0] == results[1]
    assert after[0] == after[1]
    if case == "bad_match_from_split_hook":
        assert results[0][1] == [
            ("ValueError", "tokens: expected ids in [0, 2147483647], got -1")
        ]
    elif not case.endswith("_ok"):
        assert results[0][0] == "ValueError", results[0]
