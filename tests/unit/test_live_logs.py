"""failure.mode live keeps torchft's per-step lines out of the worker logs, and nothing else."""

import logging
import os

from workers.live import quiet_torchft


def test_torchfts_per_step_lines_are_dropped_and_its_other_lines_kept(monkeypatch, caplog):
    monkeypatch.setenv("RUST_LOG", "")  # recorded, so the test's own RUST_LOG is undone after it
    monkeypatch.delenv("RUST_LOG")
    logger = logging.getLogger("torchft.manager")
    monkeypatch.setattr(logger, "filters", [])
    quiet_torchft()
    quiet_torchft()  # a second job in the same worker process adds no second filter
    assert len(logger.filters) == 1
    assert os.environ["RUST_LOG"] == "warn"
    with caplog.at_level(logging.INFO, logger="torchft.manager"):
        logger.info("[j-00000/0 - step 7] should_commit=True enough_replicas=True, errored=None")
        logger.info("[j-00000/0 - step 7] reconfiguring for quorum_id=2")
        logger.info("[j-00000/0 - step 8] should_commit=False enough_replicas=True, errored=boom")
    kept = [r.getMessage().split("] ")[1] for r in caplog.records]
    assert kept == ["reconfiguring for quorum_id=2", "should_commit=False enough_replicas=True, errored=boom"]


def test_a_rust_log_the_worker_has_wins(monkeypatch):
    monkeypatch.setenv("RUST_LOG", "info")
    monkeypatch.setattr(logging.getLogger("torchft.manager"), "filters", [])
    quiet_torchft()
    assert os.environ["RUST_LOG"] == "info"
