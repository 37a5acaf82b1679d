"""The decode batch's KV rows: contiguous rows, page loads, and no garbage reaching attention."""

import torch

from omni.compute._batch import BatchKV


def kv(length: int, value: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    t = torch.full((1, 2, length, 4), value)
    return [(t, t + 0.5), (t * 2, t * 2 + 0.5)]


def test_rows_of_different_lengths_never_expose_uninitialised_memory():
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, max_batch=3,
                    dtype=torch.float32, capacity=4)
    for buf in batch.k + batch.v:
        buf.fill_(float("nan"))  # what an empty allocation may hold
    batch.extend(batch.open_row(3), kv(3, 1.0))
    batch.extend(batch.open_row(9), kv(9, 2.0))  # grows the buffers past their capacity
    past = batch.past()
    for k, v in past:
        assert k.shape == (2, 2, 9, 4)
        assert not torch.isnan(k).any() and not torch.isnan(v).any()
    mask = batch.mask()
    assert mask[0, 0, 0].tolist() == [True] * 3 + [False] * 6 + [True]


def test_removing_a_row_moves_the_last_one_into_it():
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, max_batch=3,
                    dtype=torch.float32)
    for value, length in ((1.0, 2), (2.0, 3), (3.0, 4)):
        batch.extend(batch.open_row(length), kv(length, value))
    assert batch.remove(0) == 2
    assert batch.lengths == [4, 3]
    assert torch.equal(batch.row_kv(0, 0, 4)[0][0], kv(4, 3.0)[0][0])
    assert batch.remove(1) is None and batch.lengths == [4]


def test_pages_load_into_a_row_in_token_order():
    pages = torch.arange(2 * 2 * 2 * 3 * 2 * 4, dtype=torch.float32).reshape(2, 2, 2, 3, 2, 4)
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, max_batch=1,
                    dtype=torch.float32)
    row = batch.open_row(6)
    batch.write_pages(row, lambda layer: pages[:, layer])
    k = batch.row_kv(row, 0, 6)[1][0]  # layer 1, K: [1, H, 6, D]
    expected = pages[:, 1, 0].permute(2, 0, 1, 3).reshape(2, 6, 4)
    assert torch.equal(k[0], expected)


def test_a_step_over_the_first_rows_after_a_swap_leaves_the_others_alone():
    """Swapping two rows moves their KV and lengths; past / mask / append over the first
    rows touch those rows only (the talker steps the replies that can go on)."""
    batch = BatchKV(num_layers=2, num_kv_heads=2, head_dim=4, max_batch=3,
                    dtype=torch.float32, capacity=4)
    for buf in batch.k + batch.v:
        buf.fill_(float("nan"))
    for value, length in ((1.0, 2), (2.0, 5), (3.0, 3)):
        batch.extend(batch.open_row(length), kv(length, value))
    batch.swap(0, 2)
    assert batch.lengths == [3, 5, 2]
    assert torch.equal(batch.row_kv(0, 0, 3)[0][0], kv(3, 3.0)[0][0])
    assert torch.equal(batch.row_kv(2, 0, 2)[0][0], kv(2, 1.0)[0][0])
    past = batch.past(2)
    assert past[0][0].shape == (2, 2, 5, 4) and not torch.isnan(past[0][0]).any()
    assert batch.mask(2)[0, 0, 0].tolist() == [True] * 3 + [False] * 2 + [True]
    new = [(torch.full((2, 2, 1, 4), 9.0), torch.full((2, 2, 1, 4), 9.5))] * 2
    batch.append(new, 2)
    assert batch.lengths == [4, 6, 2]
    assert batch.row_kv(0, 3, 4)[0][0].eq(9.0).all() and batch.row_kv(1, 5, 6)[0][0].eq(9.0).all()
    assert torch.equal(batch.row_kv(2, 0, 2)[0][0], kv(2, 1.0)[0][0])
