"""What the survivors of a live recovery report (workers.live.Tracker), step by step."""

from workers import events
from workers.live import Tracker


def _tracker(tmp_path) -> Tracker:
    return Tracker(str(tmp_path), groups=3, share=32, attempt=1)


def test_an_outage_is_reported_by_the_leader_when_every_group_is_back(tmp_path):
    t = _tracker(tmp_path)
    for step in range(1, 11):
        t.committed(step, 3, leader=True, joined=False)
    for step in range(11, 16):  # rank 1 died: two groups go on
        t.committed(step, 2, leader=True, joined=False)
    events.emit(str(tmp_path), events.LiveJoined(attempt=1, rank=1, group=1, pid=7, step=15, fetch_s=0.1))
    t.committed(16, 3, leader=True, joined=True)
    (r,) = events.events(str(tmp_path), events.Kind.LIVE_RECOVERED)
    assert (r["failed_ranks"], r["failed_after_step"], r["rejoined_at_step"]) == ([1], 10, 16)
    assert (r["survivor_steps"], r["samples_skipped"], r["survivors_restarted"]) == (5, 5 * 32, False)
    assert 0 <= r["stall_s"] <= r["rejoin_s"]


def test_only_the_leader_reports_and_a_replacement_carries_the_survivors_view(tmp_path):
    survivor, other = _tracker(tmp_path), _tracker(tmp_path)
    for t in (survivor, other):
        t.committed(1, 3, leader=False, joined=False)
        t.committed(2, 2, leader=False, joined=False)
    replacement = _tracker(tmp_path)
    replacement.restore(survivor.snapshot())  # what torchft hands over with the state
    for t, leads in ((survivor, False), (other, False), (replacement, True)):
        t.committed(3, 3, leader=leads, joined=True)
    (r,) = events.events(str(tmp_path), events.Kind.LIVE_RECOVERED)
    assert (r["failed_after_step"], r["survivor_steps"]) == (1, 1)


def test_survivors_held_up_until_the_replacement_joined_still_report_it(tmp_path):
    t = _tracker(tmp_path)
    t.committed(1, 3, leader=True, joined=False)
    t.committed(2, 3, leader=True, joined=True)  # no step without the failed group: it joined at once
    (r,) = events.events(str(tmp_path), events.Kind.LIVE_RECOVERED)
    assert (r["failed_after_step"], r["rejoined_at_step"], r["survivor_steps"]) == (1, 2, 0)


def test_a_job_that_ends_before_the_replacement_joins_says_so(tmp_path):
    t = _tracker(tmp_path)
    t.committed(1, 3, leader=True, joined=False)
    t.committed(2, 2, leader=True, joined=False)
    events.emit(str(tmp_path), events.WorkerFailed(rank=2, classification="infrastructure",
                                                   error="worker process died", process_died=True))
    t.finish()
    (r,) = events.events(str(tmp_path), events.Kind.LIVE_RECOVERED)
    assert r["rejoined_at_step"] is None and r["rejoin_s"] is None and r["survivor_steps"] == 1
    assert r["failed_ranks"] == [2]  # from Ray Train's word, since no replacement joined
