"""The watchdog turns a worker that stops progressing into a recorded, killed worker."""

from __future__ import annotations

import threading
import time

from workers import events
from workers.watchdog import Watchdog


def test_a_worker_without_a_beat_is_declared_hung_and_killed(tmp_path):
    killed = threading.Event()
    dog = Watchdog(0.4, str(tmp_path), rank=1, kill=killed.set)
    dog.attempt = 2
    dog.beat("reading the batch of step 7", step=6)
    started = time.monotonic()
    dog.start()
    assert killed.wait(5), "the watchdog never fired"
    waited = time.monotonic() - started
    assert 0.4 <= waited < 2.0, waited
    (hung,) = events.events(str(tmp_path), "worker_failed")
    assert hung["hung"] is True and hung["rank"] == 1 and hung["step"] == 7 and hung["attempt"] == 2
    assert hung["classification"] == "infrastructure"
    assert "while reading the batch of step 7" in hung["error"] and "hang_timeout_s" in hung["error"]
    # The stack of the thread that stopped (here: this test, waiting on the event).
    assert "test_a_worker_without_a_beat_is_declared_hung_and_killed" in hung["traceback"]


def test_a_beating_worker_is_left_alone(tmp_path):
    killed = threading.Event()
    dog = Watchdog(0.5, str(tmp_path), rank=0, kill=killed.set).start()
    deadline = time.monotonic() + 1.5
    while time.monotonic() < deadline:
        dog.beat("training")
        time.sleep(0.1)
    dog.stop()
    time.sleep(0.7)
    assert not killed.is_set()
    assert events.events(str(tmp_path)) == []


def test_a_rank_waiting_on_its_peers_outlasts_the_peer_that_stopped(tmp_path):
    """Both stop beating at the same moment: the stuck rank (reading its batch) must be
    the one recorded, not the peer waiting for it in a collective."""
    stuck_killed, waiting_killed = threading.Event(), threading.Event()
    stuck = Watchdog(0.6, str(tmp_path), rank=1, kill=stuck_killed.set)
    waiting = Watchdog(0.6, str(tmp_path), rank=0, kill=waiting_killed.set)
    waiting.beat("training step 14", step=13, on_peers=True)
    stuck.beat("reading the batch of step 14", step=13)
    waiting.start(), stuck.start()
    assert stuck_killed.wait(5)
    assert not waiting_killed.is_set(), "the waiting peer fired as early as the stuck one"
    waiting.stop()
    (hung,) = events.events(str(tmp_path), "worker_failed")
    assert hung["rank"] == 1 and "reading the batch of step 14" in hung["activity"]


def test_a_rank_waiting_on_peers_is_still_declared_hung_after_the_grace(tmp_path):
    killed = threading.Event()
    dog = Watchdog(0.4, str(tmp_path), rank=0, kill=killed.set)
    dog.beat("waiting for every rank's shards of step 10", on_peers=True)
    started = time.monotonic()
    dog.start()
    assert killed.wait(5)
    assert 0.6 <= time.monotonic() - started < 2.5
