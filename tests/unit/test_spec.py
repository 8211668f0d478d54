"""workers/spec.py: the one definition of a training job."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from workers.spec import (
    DATASETS,
    MODELS,
    OPTIMIZERS,
    JobSpec,
    absolute_paths,
    default_storage,
    load_spec,
)


def test_one_line_spec_is_valid_with_defaults():
    spec = JobSpec.model_validate({"model": "simple_cnn"})
    assert spec.model.name == "simple_cnn"
    assert spec.model.factory is None
    assert spec.dataset.name == "synthetic"
    assert spec.strategy == "ddp"
    assert spec.workers == 2
    assert spec.training.epochs == 1 and spec.training.max_steps is None
    assert spec.training.global_batch_size == 64
    assert spec.training.optimizer == "adam"
    assert spec.checkpoint.every_steps == 50 and spec.checkpoint.keep == 3
    assert spec.faults == []
    assert re.fullmatch(r"job-[0-9a-f]{12}", spec.job_id)
    assert spec.run_dir == os.path.join(spec.storage, spec.job_id)


def test_each_spec_gets_its_own_job_id():
    assert JobSpec.model_validate({}).job_id != JobSpec.model_validate({}).job_id


def test_max_steps_does_not_get_default_epochs():
    spec = JobSpec.model_validate({"training": {"max_steps": 7}})
    assert spec.training.max_steps == 7 and spec.training.epochs is None


@pytest.mark.parametrize(("uri", "stored"), [("s3://bucket/runs", "s3://bucket/runs"),
                                             ("S3://bucket/runs/", "s3://bucket/runs")])
def test_object_storage_is_a_uri_kept_as_one(uri, stored, monkeypatch):
    # Before, `s3://bucket/runs` became a local directory `s3:/bucket/runs` on each host.
    spec = JobSpec.model_validate({"storage": uri, "job_id": "j"})
    assert spec.storage == stored and spec.run_dir == f"{stored}/j"
    assert absolute_paths(spec).storage == stored  # never taken for a relative path
    monkeypatch.setenv("ETRAIN_STORAGE", uri)
    assert JobSpec.model_validate({}).storage == stored


@pytest.mark.parametrize(("uri", "says"), [
    ("nosuch://bucket/runs", "no filesystem for nosuch://"),
    ("gs://bucket/runs", "install gcsfs"),  # fsspec knows gs://, its package is not installed here
    ("s3://", "name a bucket"),
    ("s3://AKIA:secret@bucket/runs", "credentials do not belong in the spec"),
])
def test_object_storage_that_cannot_work_is_refused_naming_why(uri, says):
    with pytest.raises(ValidationError, match=re.escape(says)):
        JobSpec.model_validate({"storage": uri})


def test_a_file_uri_is_its_path():
    assert JobSpec.model_validate({"storage": "file:///mnt/shared/runs"}).storage == "/mnt/shared/runs"


def test_default_storage_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ETRAIN_STORAGE", str(tmp_path / "custom"))
    assert default_storage() == str(tmp_path / "custom")
    assert JobSpec.model_validate({}).storage == str(tmp_path / "custom")
    monkeypatch.delenv("ETRAIN_STORAGE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert default_storage() == os.path.join(str(tmp_path / "cache"), "elastic-train", "runs")


def test_string_shorthand_for_model_and_dataset():
    short = JobSpec.model_validate({"model": "resnet18", "dataset": "mnist", "job_id": "j"})
    long = JobSpec.model_validate({"model": {"name": "resnet18"}, "dataset": {"name": "mnist"}, "job_id": "j"})
    assert short.model.name == "resnet18"
    assert short.dataset.name == "mnist"
    assert short.model_dump(exclude={"storage"}) == long.model_dump(exclude={"storage"})


@pytest.mark.parametrize(
    "data, loc, allowed",
    [
        ({"model": "transformer"}, ("model", "name"), MODELS),
        ({"model": {"name": "transformer"}}, ("model", "name"), MODELS),
        ({"dataset": "imagenet"}, ("dataset", "name"), DATASETS),
        ({"training": {"optimizer": "rmsprop"}}, ("training", "optimizer"), OPTIMIZERS),
    ],
    ids=["model-shorthand", "model", "dataset", "optimizer"],
)
def test_unknown_names_list_the_allowed_values(data, loc, allowed):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(data)
    errors = info.value.errors()
    assert [e["loc"] for e in errors] == [loc]
    message = str(info.value)
    assert ".".join(loc) in message
    for value in allowed:
        assert repr(value) in message, f"{value!r} missing from: {message}"


@pytest.mark.parametrize(
    "data, loc",
    [
        ({"modle": "simple_cnn"}, ("modle",)),
        ({"training": {"max_step": 100}}, ("training", "max_step")),
        ({"checkpoint": {"every": 10}}, ("checkpoint", "every")),
        ({"dataset": {"name": "synthetic", "sise": 100}}, ("dataset", "sise")),
        ({"faults": [{"at_step": 3, "kind": "crash", "rnak": 0}]}, ("faults", 0, "rnak")),
    ],
)
def test_extra_or_misspelled_keys_are_rejected(data, loc):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate(data)
    errors = info.value.errors()
    assert [(e["loc"], e["type"]) for e in errors] == [(loc, "extra_forbidden")]


def test_global_batch_smaller_than_workers_is_rejected():
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"workers": {"min": 2, "max": 8}, "training": {"global_batch_size": 4}})
    message = str(info.value)
    assert "global_batch_size (4) is smaller than the 8 workers" in message


def test_global_batch_divisible_by_workers_is_accepted():
    spec = JobSpec.model_validate({"workers": 4, "training": {"global_batch_size": 64}})
    assert spec.workers == 4


def test_fault_rank_must_exist():
    with pytest.raises(ValidationError, match=r"rank 2 does not exist with 2 workers"):
        JobSpec.model_validate({"workers": 2, "faults": [{"at_step": 5, "rank": 2, "kind": "crash"}]})
    ok = JobSpec.model_validate({"workers": 2, "faults": [{"at_step": 5, "rank": 1, "kind": "crash"}]})
    assert ok.faults[0].rank == 1 and ok.faults[0].phase == "step"


def test_checkpoint_phase_fault_must_be_on_a_checkpoint_step():
    base = {"checkpoint": {"every_steps": 10}}
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**base, "faults": [{"at_step": 25, "kind": "crash", "phase": "checkpoint"}]})
    assert "at_step 25 is not a checkpoint step" in str(info.value)
    assert "every_steps is 10" in str(info.value)
    on_step = JobSpec.model_validate({**base, "faults": [{"at_step": 20, "kind": "crash", "phase": "checkpoint"}]})
    assert on_step.faults[0].at_step == 20
    # The same step in the ordinary phase is fine.
    JobSpec.model_validate({**base, "faults": [{"at_step": 25, "kind": "crash"}]})


def test_unknown_fault_kind_is_rejected():
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"faults": [{"at_step": 3, "kind": "explode"}]})
    assert info.value.errors()[0]["loc"] == ("faults", 0, "kind")
    assert "'crash', 'exception' or 'hang'" in str(info.value)


def test_custom_model_needs_a_factory():
    with pytest.raises(ValidationError, match=r"model.factory .* is required"):
        JobSpec.model_validate({"model": "custom"})
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"model": {"name": "custom", "factory": "no colon here"}})
    assert info.value.errors()[0]["loc"] == ("model", "factory")
    spec = JobSpec.model_validate({"model": {"name": "custom", "factory": "pkg.mod:build"}})
    assert spec.model.factory == "pkg.mod:build"


def test_idx_dataset_needs_both_files():
    with pytest.raises(ValidationError, match="dataset.images and dataset.labels are required"):
        JobSpec.model_validate({"dataset": {"name": "idx", "images": "a.gz"}})


def test_bad_job_id_is_rejected():
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({"job_id": "../escape"})
    assert info.value.errors()[0]["loc"] == ("job_id",)


def test_load_spec_reads_yaml(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text("model: mlp\nworkers: 4\ntraining: {max_steps: 12, global_batch_size: 32}\n")
    spec = load_spec(path)
    assert spec.model.name == "mlp"
    assert spec.workers == 4
    assert spec.training.max_steps == 12 and spec.training.global_batch_size == 32


def test_load_spec_reads_the_one_line_example():
    example = Path(__file__).resolve().parents[2] / "examples" / "minimal.yaml"
    spec = load_spec(example)
    assert spec.model.name == "simple_cnn"
    assert spec.workers == 2


def test_load_spec_reads_json(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({"model": "resnet18", "dataset": "cifar10", "job_id": "from-json"}))
    spec = load_spec(str(path))
    assert (spec.model.name, spec.dataset.name, spec.job_id) == ("resnet18", "cifar10", "from-json")


@pytest.mark.parametrize(
    "name, text, kind",
    [("list.yaml", "- model\n- simple_cnn\n", "list"), ("scalar.yaml", "simple_cnn\n", "str"),
     ("empty.yaml", "", "NoneType"), ("list.json", "[1, 2]", "list")],
)
def test_load_spec_rejects_a_non_mapping(tmp_path, name, text, kind):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError, match=rf"a spec is a mapping of fields, got {kind}") as info:
        load_spec(path)
    assert not isinstance(info.value, ValidationError)
    assert str(path) in str(info.value)


def test_load_spec_validates_contents(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model: simple_cnn\ntraining: {optimiser: sgd}\n")
    with pytest.raises(ValidationError) as info:
        load_spec(path)
    assert info.value.errors()[0]["loc"] == ("training", "optimiser")


def test_absolute_paths_resolves_relative_paths_against_base(tmp_path):
    spec = JobSpec.model_validate({
        "storage": "runs",
        "dataset": {"name": "idx", "images": "data/images.gz", "labels": "../labels.gz"},
    })
    base = tmp_path / "project"
    fixed = absolute_paths(spec, base)
    assert fixed.storage == str(base / "runs")
    assert fixed.dataset.images == str(base / "data" / "images.gz")
    assert fixed.dataset.labels == str(tmp_path / "labels.gz")
    assert fixed.dataset.root is None  # absent paths stay absent
    assert fixed.run_dir == os.path.join(str(base / "runs"), spec.job_id)
    # The original is left as it was.
    assert spec.storage == "runs" and spec.dataset.images == "data/images.gz"


def test_absolute_paths_keeps_absolute_paths_and_expands_home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    spec = JobSpec.model_validate({"storage": str(tmp_path / "abs"), "dataset": {"name": "mnist", "root": "~/data"}})
    fixed = absolute_paths(spec, tmp_path / "elsewhere")
    assert fixed.storage == str(tmp_path / "abs")
    assert fixed.dataset.root == str(tmp_path / "home" / "data")


def test_absolute_paths_defaults_to_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    fixed = absolute_paths(JobSpec.model_validate({"storage": "here"}))
    assert fixed.storage == str(tmp_path.resolve() / "here")


GPT = {"model": {"name": "gpt", "heads": 4}, "dataset": "synthetic_tokens"}


@pytest.mark.parametrize("fields,words", [
    ({"strategy": "hybrid", "workers": 4, "parallel": {"tensor": 3}},
     "the degrees must multiply to the worker count: parallel.tensor (3) does not divide workers (4)"),
    ({"strategy": "hybrid", "workers": 6, "parallel": {"pipeline": 4}},
     "parallel.pipeline (4) does not divide workers (6)"),
    ({"strategy": "hybrid", "workers": 4, "parallel": {"shard": 3}}, "parallel.shard (3) does not divide workers (4)"),
    ({"strategy": "hybrid", "workers": 4, "parallel": {"tensor": 2, "pipeline": 2}}, "exactly one of"),
    ({"strategy": "hybrid", "workers": 4}, "exactly one of"),
    ({"strategy": "tensor", "workers": 4, "parallel": {"tensor": 2}}, "parallel.tensor (2) must equal workers (4)"),
    ({"strategy": "tensor", "workers": 8}, "tensor parallel degree 8 must divide model.heads (4)"),
    ({"strategy": "pipeline", "workers": 8}, "8 pipeline stages need at least as many model.layers, got 4"),
    ({"strategy": "pipeline", "workers": 2, "parallel": {"microbatches": 3}}, "parallel.microbatches (3)"),
    ({"strategy": "ddp", "workers": 4, "parallel": {"tensor": 2}}, "uses every worker for data parallelism"),
    ({"strategy": "tensor", "workers": 2, "precision": "fp16"}, "use precision 'bf16'"),
    ({"strategy": "ddp", "workers": 2, "parallel": {"async_checkpoint": True}}, "with ddp rank 0 writes the one copy"),
    ({"strategy": "hybrid", "workers": {"min": 2, "max": 4}, "parallel": {"tensor": 2}},
     "with 3 workers: the degrees must multiply"),
])
def test_meshes_that_cannot_work_are_refused_saying_why(fields, words):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**GPT, **fields})
    assert words in str(info.value)


@pytest.mark.parametrize("fields", [
    {"strategy": "tensor", "workers": 4},
    {"strategy": "pipeline", "workers": 2, "parallel": {"schedule": "gpipe", "microbatches": 8}},
    {"strategy": "hybrid", "workers": 8, "parallel": {"tensor": 2}},
    {"strategy": "hybrid", "workers": 4, "parallel": {"pipeline": 2}},
    {"strategy": "hybrid", "workers": 4, "parallel": {"shard": 2}, "precision": "fp16"},
    {"strategy": "fsdp", "workers": {"min": 1, "max": 3}, "parallel": {"async_checkpoint": True}},
])
def test_meshes_that_fit_are_accepted(fields):
    JobSpec.model_validate({**GPT, **fields})


def test_model_and_dataset_must_fit_each_other():
    with pytest.raises(ValidationError, match="model 'gpt' does not fit dataset 'mnist'"):
        JobSpec.model_validate({"model": "gpt", "dataset": "mnist"})
    with pytest.raises(ValidationError, match="strategy 'tensor' splits a transformer's layers"):
        JobSpec.model_validate({"model": "simple_cnn", "strategy": "tensor"})


def test_elastic_workers_are_a_range():
    spec = JobSpec.model_validate({"workers": {"min": 1, "max": 4}})
    assert (spec.elastic, spec.min_workers, spec.max_workers) == (True, 1, 4)
    with pytest.raises(ValidationError, match=r"workers.min \(3\) is larger than workers.max \(2\)"):
        JobSpec.model_validate({"workers": {"min": 3, "max": 2}})


LIVE = {"failure": {"mode": "live"}, "workers": 3}


@pytest.mark.parametrize(("fields", "words"), [
    ({"strategy": "fsdp"}, "failure.mode 'live' needs strategy 'ddp'"),
    ({**GPT, "strategy": "hybrid", "parallel": {"shard": 3}}, "each worker is its own replica group"),
    ({"workers": {"min": 2, "max": 3}}, "needs a fixed worker count"),
    ({"workers": 1}, "at least 2 workers"),
    ({"precision": "fp16"}, "use 'bf16'"),
    ({"evaluation": {"every_steps": 10}}, "scores the validation split once, at the end"),
    ({"faults": [{"at_step": 3, "kind": "hang"}]}, "'crash' or 'exception' in phase 'step' only"),
])
def test_live_mode_refuses_what_it_cannot_serve_saying_why(fields, words):
    with pytest.raises(ValidationError) as info:
        JobSpec.model_validate({**LIVE, **fields})
    assert words in str(info.value)


def test_exact_is_the_default_failure_mode_and_live_takes_ddp():
    assert JobSpec().failure.mode == "exact"
    assert JobSpec.model_validate({**LIVE, "precision": "bf16"}).failure.mode == "live"
    with pytest.raises(ValidationError, match="failure.mode"):
        JobSpec.model_validate({"failure": {"mode": "fast"}})
