"""The per-unit state machines of docs/design.md ("Per-unit states") are the stores' transition tables."""

import pytest

from zerotier.state import GRAD_TRANSITIONS, PARAM_TRANSITIONS, GradState, IllegalTransition, ParamState, transition


@pytest.mark.pins("design#per-unit-states")
def test_unit_state_tables_are_the_design_diagrams_and_illegal_moves_raise():
    P, G = ParamState, GradState
    assert PARAM_TRANSITIONS == {P.RELEASED: {P.FETCHING}, P.FETCHING: {P.RESIDENT, P.RELEASED},
                                 P.RESIDENT: {P.RELEASED}}
    assert GRAD_TRANSITIONS == {G.EMPTY: {G.ACCUMULATING}, G.ACCUMULATING: {G.ACCUMULATING, G.READY, G.EMPTY},
                                G.READY: {G.STEPPED, G.EMPTY, G.ACCUMULATING}, G.STEPPED: {G.EMPTY}}
    states = [P.RELEASED]
    with pytest.raises(IllegalTransition, match="unit 0: params cannot go from released to resident"):
        transition(states, 0, P.RESIDENT, PARAM_TRANSITIONS, "params")
    assert states == [P.RELEASED]  # a refused move changes nothing
    transition(states, 0, P.FETCHING, PARAM_TRANSITIONS, "params")
    assert states == [P.FETCHING]


def test_a_slot_field_is_the_slots_state_live():
    """Each store keeps one slot per unit; the per-unit states that transition() and the
    parameter surface take as a list are a SlotField over the slots: one copy, read and
    written through, so a view taken once (param_surface.ParamSurface.adopt) never goes stale."""
    from zerotier.params import ParamSlot
    from zerotier.slots import SlotField

    slots = [ParamSlot(), ParamSlot()]
    states = SlotField(slots, "state")
    assert states == [ParamState.RESIDENT] * 2 and len(states) == 2
    slots[1].state = ParamState.RELEASED
    assert states[1] is ParamState.RELEASED  # read through: not a copy
    transition(states, 1, ParamState.FETCHING, PARAM_TRANSITIONS, "parameters")
    assert slots[1].state is ParamState.FETCHING  # written through
    with pytest.raises(IllegalTransition, match="unit 0"):
        transition(states, 0, ParamState.FETCHING, PARAM_TRANSITIONS, "parameters")
    assert list(states) == [ParamState.RESIDENT, ParamState.FETCHING]


def test_the_stores_block_counts_match_their_staging_bytes():
    """The planner takes host-pool block counts from the stores (issue 23 item 4): a count is
    the number of blocks its store's staging-bytes function sums, so with every unit one byte
    the two agree."""
    from zerotier.grads import GradStore
    from zerotier.params import ParamStore
    from zerotier.state import Location

    for lookahead in (0, 1, 2, 5):
        ones = [1] * 16  # more units than blocks in flight
        assert ParamStore.host_blocks(Location.NVME, lookahead, 16) == \
            ParamStore.host_staging_bytes(lookahead, ones, 1)
        assert ParamStore.writes_in_flight(lookahead) == lookahead + 2
    assert ParamStore.host_blocks(Location.HOST, 2, 16) == 16 and ParamStore.host_blocks(Location.DEVICE, 2, 16) == 0
    for world_size, stage in ((1, 0), (2, 1), (2, 2), (2, 3)):
        # NVMe gradients: staging_bytes with units of 1 byte, 1-byte gradients, shards of 0: one byte per block
        assert GradStore.host_blocks(Location.NVME, 16, world_size, stage) == \
            GradStore.nvme_staging_bytes(1, 0, 1, 1, world_size, stage)
    assert GradStore.host_blocks(Location.HOST, 16, 1, 0) == 16 and GradStore.host_blocks(Location.HOST, 16, 2, 1) == 32
