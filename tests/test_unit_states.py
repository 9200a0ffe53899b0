"""The per-unit state machines of docs/design.md ("Per-unit states") are the stores' transition tables."""

import pytest

from zerotier.state import GRAD_TRANSITIONS, PARAM_TRANSITIONS, GradState, IllegalTransition, ParamState, transition


def test_unit_state_tables_are_the_design_diagrams_and_illegal_moves_raise():
    P, G = ParamState, GradState
    assert PARAM_TRANSITIONS == {P.RELEASED: {P.FETCHING}, P.FETCHING: {P.RESIDENT, P.RELEASED},
                                 P.RESIDENT: {P.RELEASED}}
    assert GRAD_TRANSITIONS == {G.EMPTY: {G.ACCUMULATING}, G.ACCUMULATING: {G.ACCUMULATING, G.READY, G.EMPTY},
                                G.READY: {G.STEPPED, G.EMPTY}, G.STEPPED: {G.EMPTY}}
    states = [P.RELEASED]
    with pytest.raises(IllegalTransition, match="unit 0: params cannot go from released to resident"):
        transition(states, 0, P.RESIDENT, PARAM_TRANSITIONS, "params")
    assert states == [P.RELEASED]  # a refused move changes nothing
    transition(states, 0, P.FETCHING, PARAM_TRANSITIONS, "params")
    assert states == [P.FETCHING]
