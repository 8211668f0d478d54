"""service/lifecycle.py: the transition table is the only truth, and `check` follows it exactly."""

from __future__ import annotations

import itertools

import pytest

from service import lifecycle
from service.lifecycle import TERMINAL, TRANSITIONS, IllegalTransition, JobState

ALLOWED = [(a, b) for a, targets in TRANSITIONS.items() for b in sorted(targets)]
FORBIDDEN = [(a, b) for a, b in itertools.product(JobState, JobState) if a != b and b not in TRANSITIONS[a]]


def test_every_state_has_an_entry():
    assert set(TRANSITIONS) == set(JobState)


@pytest.mark.parametrize(("current", "target"), ALLOWED, ids=[f"{a.value}->{b.value}" for a, b in ALLOWED])
def test_listed_transitions_are_allowed(current, target):
    lifecycle.check(current, target)  # raises if not


@pytest.mark.parametrize(("current", "target"), FORBIDDEN, ids=[f"{a.value}->{b.value}" for a, b in FORBIDDEN])
def test_unlisted_transitions_raise(current, target):
    with pytest.raises(IllegalTransition) as info:
        lifecycle.check(current, target)
    assert info.value.current == current and info.value.target == target
    assert current.value in str(info.value) and target.value in str(info.value)


@pytest.mark.parametrize("state", list(JobState))
def test_same_state_is_not_a_transition(state):
    lifecycle.check(state, state)


@pytest.mark.parametrize("state", sorted(TERMINAL))
def test_terminal_states_have_no_way_out(state):
    assert TRANSITIONS[state] == frozenset()
    assert not lifecycle.is_active(state)
    for other in JobState:
        if other != state:
            with pytest.raises(IllegalTransition):
                lifecycle.check(state, other)


def test_active_states_are_exactly_the_non_terminal_ones():
    assert {s for s in JobState if lifecycle.is_active(s)} == set(JobState) - TERMINAL
    assert TERMINAL == {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED}


@pytest.mark.parametrize("state", [s for s in JobState if s not in TERMINAL])
def test_every_active_state_can_end(state):
    # Cancel and fail are always possible from an active state: no job can get stuck.
    assert {JobState.CANCELLED, JobState.FAILED} <= TRANSITIONS[state]


def test_illegal_transition_is_a_value_error():
    # The API maps it to 409 by its own handler; being a ValueError keeps callers simple.
    assert issubclass(IllegalTransition, ValueError)


def test_the_ledger_only_moves_jobs_along_legal_transitions(tmp_path):
    from service import ledger

    sessions = ledger.open_ledger(f"sqlite:///{tmp_path / 'ledger.db'}")
    ledger.create_job(sessions, job_id="j", spec={}, request_hash="h", idempotency_key=None)
    with pytest.raises(IllegalTransition):
        ledger.update_job(sessions, job_id="j", state=JobState.RUNNING)  # QUEUED cannot skip SUBMITTED
    assert ledger.get_job(sessions, job_id="j").state == "QUEUED"
    for state in (JobState.SUBMITTED, JobState.RUNNING, JobState.RECOVERING, JobState.RUNNING, JobState.SUCCEEDED):
        assert ledger.update_job(sessions, job_id="j", state=state).state == state.value
    for state in JobState:
        if state != JobState.SUCCEEDED:
            with pytest.raises(IllegalTransition):
                ledger.update_job(sessions, job_id="j", state=state, error="ignored")
    job = ledger.get_job(sessions, job_id="j")
    assert job.state == "SUCCEEDED" and job.error is None  # a refused change changes nothing
    ledger.engine_of(sessions).dispose()
