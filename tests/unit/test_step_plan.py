"""Which steps the captured decode step serves (worker/step/plan.py): buckets, routing, slots."""

import pytest

from worker.step import plan


def test_buckets_are_vllms_capture_sizes_ending_at_max_num_seqs():
    assert plan.buckets(1) == [1]
    assert plan.buckets(3) == [1, 2, 3]
    assert plan.buckets(8) == [1, 2, 4, 8]
    assert plan.buckets(20) == [1, 2, 4, 8, 16, 20]
    assert plan.buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError):
        plan.buckets(0)


def test_route_serves_decode_only_steps_within_the_buckets():
    sizes = plan.buckets(8)
    assert plan.route(1, 0, sizes) == (1, None)
    assert plan.route(3, 0, sizes) == (4, None)
    assert plan.route(8, 0, sizes) == (8, None)
    assert plan.route(9, 0, sizes) == (None, plan.OVER_BUCKETS)
    assert plan.route(2, 1, sizes) == (None, plan.PREFILL)  # a prompt chunk beside decodes
    assert plan.route(0, 1, sizes) == (None, plan.PREFILL)


def test_slots_and_padded_tables():
    assert plan.slot_of([7, 3], 0, 16) == 112
    assert plan.slot_of([7, 3], 17, 16) == 49
    # each row keeps only the blocks holding its tokens, padded with block 0 to the widest
    assert plan.padded_tables([[5, 6, 9], [2]], [17, 3], 16) == [[5, 6], [2, 0]]


def test_cuda_graph_inputs_pad_with_row_zero_and_pack_in_one_list():
    from worker.step import graphs

    rows = [([3, 4], 17, 11), ([9], 2, 12)]
    padded = graphs.pad_rows(rows, 4)
    assert padded == [*rows, rows[0], rows[0]]  # a padded row rewrites row 0's own slot, nobody else's
    with pytest.raises(ValueError):
        graphs.pad_rows(rows, 1)
    flat = graphs.packed_inputs(rows, 3, 16)
    assert flat == [11, 12, 17, 2, 4 * 16 + 1, 9 * 16 + 2, 18, 3, 3, 4, 0, 9, 0, 0]
    with pytest.raises(ValueError):
        graphs.packed_inputs(rows, 1, 16)
