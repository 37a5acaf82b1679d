"""A tier's free slots: lowest first, as a heap of every slot would hand them out, without
a per-slot cost for slots never used."""

import heapq

from hypothesis import given
from hypothesis import strategies as st

from omni.kv.manager import _FreeSlots


@given(st.integers(1, 40), st.lists(st.tuples(st.booleans(), st.integers(0, 1000)), max_size=80))
def test_free_slots_hand_out_what_a_heap_of_every_slot_would(num_slots, ops):
    free, model = _FreeSlots(num_slots), list(range(num_slots))
    used: list[int] = []
    for take, pick in ops:
        if take and model:
            assert free.lowest() == model[0]
            slot = free.pop()
            assert slot == heapq.heappop(model)
            used.append(slot)
        elif used:
            slot = used.pop(pick % len(used))
            free.append(slot)
            heapq.heappush(model, slot)
        assert len(free) == len(model)
        assert sorted(free) == sorted(model)


def test_a_huge_tier_keeps_no_list_of_its_slots():
    free = _FreeSlots(1 << 40)
    assert len(free) == 1 << 40 and free.pop() == 0 and free.lowest() == 1
    assert free._heap == []
