"""workers.run's handling of what stops a job before any worker starts (no Ray needed)."""

import json
import os

import yaml

from workers import events
from workers.run import EXIT_BAD_SPEC, main, prepare_run_dir
from workers.spec import JobSpec, absolute_paths, load_spec


def spec_file(tmp_path, **fields):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"job_id": "j1", "storage": str(tmp_path / "runs"), **fields}))
    return path


def test_missing_data_is_a_verdict_in_the_run_dir(tmp_path, capsys):
    path = spec_file(tmp_path, dataset={"name": "idx", "images": "nope.gz", "labels": "nope2.gz"})
    assert main([str(path)]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nope.gz" in err and len(err.strip().splitlines()) == 1
    (failed,) = events.events(str(tmp_path / "runs" / "j1"), "failed")
    assert "nope.gz" in failed["error"] and failed["classification"] == "deterministic"


def test_a_different_spec_under_a_taken_job_id_leaves_that_run_alone(tmp_path, capsys):
    run_dir = tmp_path / "runs" / "j1"
    os.makedirs(run_dir)
    first = absolute_paths(load_spec(spec_file(tmp_path, workers=1)))
    (run_dir / "spec.json").write_text(first.model_dump_json())
    assert main([str(spec_file(tmp_path, workers=1, precision="bf16"))]) == EXIT_BAD_SPEC
    assert "already holds a different spec" in capsys.readouterr().err
    assert events.events(str(run_dir)) == []
    assert json.loads((run_dir / "spec.json").read_text())["precision"] == "fp32"


def test_a_job_may_run_again_on_another_worker_count(tmp_path):
    """Stopped on 4 workers, resumed on 2: the one change a rerun may make."""
    spec = absolute_paths(load_spec(spec_file(tmp_path, workers=4)))
    prepare_run_dir(spec)
    again = spec.model_copy(update={"workers": 2})
    prepare_run_dir(again)
    assert json.loads((tmp_path / "runs" / "j1" / "spec.json").read_text())["workers"] == 4  # as submitted
    (changed,) = events.events(spec.run_dir, "workers_changed")
    assert (changed["old"], changed["new"]) == (4, 2)


def test_invalid_spec_file_is_one_line(tmp_path, capsys):
    assert main([str(spec_file(tmp_path, model="gpt-17"))]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "model.name" in err and "simple_cnn" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_absolute_paths_keep_symlinks_as_written(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    spec = load_spec(spec_file(tmp_path, dataset={"name": "image_folder", "root": "link/x"}))
    assert absolute_paths(spec, base=tmp_path).dataset.root == str(tmp_path / "link" / "x")


def test_live_mode_for_a_strategy_it_cannot_serve_is_refused_before_any_worker_starts(tmp_path, capsys):
    path = spec_file(tmp_path, strategy="fsdp", workers=3, failure={"mode": "live"})
    assert main([str(path)]) == EXIT_BAD_SPEC
    err = capsys.readouterr().err
    assert "failure.mode 'live' needs strategy 'ddp'" in err
    assert not (tmp_path / "runs").exists()  # refused while parsing: nothing was started or written


def test_the_controller_polls_fast_on_a_cluster_given_by_address_too(monkeypatch, tmp_path):
    """Ray Train passes RAY_TRAIN_HEALTH_CHECK_INTERVAL_S from the driver to its
    controller; left at 2 s, a dead worker on a RayJob's cluster waits a second longer."""
    import ray

    from workers import run as run_mod

    seen = {}
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv(run_mod.POLL_ENV, "unset below; restored after the test")
    monkeypatch.delenv(run_mod.POLL_ENV)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, poll=os.environ.get(run_mod.POLL_ENV)))
    run_mod._ray_init(JobSpec(job_id="poll", workers=2, storage=str(tmp_path)), verbose=False)
    assert seen["address"] == "127.0.0.1:1" and seen["poll"] == run_mod.POLL_S


def test_only_a_live_replacement_that_met_dead_peers_falls_back_within_max_failures():
    from ray.exceptions import ActorDiedError
    from ray.train.v2.api.exceptions import ControllerError

    from workers.run import _may_retry, _replacement_lost_its_peers

    live = JobSpec.model_validate({"job_id": "j", "workers": 3, "failure": {"mode": "live", "max_failures": 2}})
    exact = live.model_copy(update={"failure": live.failure.model_copy(update={"mode": "exact"})})
    dead_peer = ControllerError(ActorDiedError())
    assert _replacement_lost_its_peers(live, dead_peer)
    assert not _replacement_lost_its_peers(exact, dead_peer)
    # A user's deterministic error ends the run through the controller too: never retried.
    assert not _replacement_lost_its_peers(live, ControllerError(RuntimeError("bad code")))
    assert [_may_retry(live, n) for n in range(3)] == [True, True, False]
    unlimited = live.model_copy(update={"failure": live.failure.model_copy(update={"max_failures": -1})})
    assert _may_retry(unlimited, 1000)
