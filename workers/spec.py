"""The one definition of a training job.

The API, the CLI and `ray job submit` all end in a `JobSpec`. This module imports
neither torch nor ray so the control plane can validate specs without them.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from workers import storage

MODELS = ("simple_cnn", "resnet18", "mlp", "gpt", "custom")
IMAGE_DATASETS = ("mnist", "fashion_mnist", "cifar10", "idx", "image_folder", "synthetic")
TEXT_DATASETS = ("python_source", "synthetic_tokens")
DATASETS = IMAGE_DATASETS + TEXT_DATASETS
STRATEGIES = ("ddp", "fsdp", "tensor", "pipeline", "hybrid")
PIPELINE_SCHEDULES = ("gpipe", "1f1b")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step")
PRECISIONS = ("fp32", "bf16", "fp16")
FAULT_KINDS = ("crash", "exception", "hang")
FAULT_PHASES = ("step", "data", "checkpoint", "commit")


def cache_dir() -> str:
    """elastic-train's directory in the user's cache (XDG_CACHE_HOME, else ~/.cache)."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(cache, "elastic-train")


def default_storage() -> str:
    """Run directories live under the user's cache unless the spec says otherwise."""
    env = os.environ.get("ETRAIN_STORAGE")
    if env:
        return env
    return os.path.join(cache_dir(), "runs")


def check_storage(value: str) -> str:
    """Storage is a path every process reaches (local, or a shared filesystem mounted at
    the same path on every node) or an object store's URI (s3://bucket/prefix, gs://...)
    that fsspec has a filesystem for; its credentials and endpoint come from the standard
    environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...), never from the spec."""
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", value)
    if scheme is None:
        return value
    protocol = scheme.group(1).lower()
    if protocol == "file":
        return scheme.group(2)
    import fsspec

    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError) as e:
        raise ValueError(f"storage {value!r}: no filesystem for {protocol}:// ({e}); use s3://bucket/prefix, "
                         "another URI fsspec knows, or a path every node reaches") from None
    if not scheme.group(2).strip("/"):
        raise ValueError(f"storage {value!r}: name a bucket (and optionally a prefix), as in {protocol}://bucket/runs")
    if "@" in scheme.group(2).split("/", 1)[0]:
        raise ValueError(f"storage {value!r}: credentials do not belong in the spec; set them in the environment "
                         "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL)")
    return f"{protocol}://{scheme.group(2).rstrip('/')}"


class _Part(BaseModel):
    # Unknown keys are almost always typos ("max_step"); say so instead of ignoring them.
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Part):
    name: Literal[MODELS] = Field("simple_cnn", description="Model architecture.")
    hidden: int = Field(128, ge=1, le=65536, description="Hidden width (mlp).")
    layers: int = Field(4, ge=1, le=1024, description="gpt: transformer blocks.")
    width: int = Field(128, ge=8, le=65536, description="gpt: model width (embedding size).")
    heads: int = Field(4, ge=1, le=1024, description="gpt: attention heads; must divide width.")
    context: int = Field(64, ge=2, le=65536, description="gpt: tokens per sample (context length).")
    factory: str | None = Field(
        None,
        description="For name=custom: 'module:function' returning an nn.Module; "
        "called with in_channels, num_classes, image_size.",
        pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
    )

    @model_validator(mode="after")
    def _custom_needs_factory(self) -> ModelSpec:
        if self.name == "custom" and not self.factory:
            raise ValueError("model.factory ('module:function') is required when model.name is 'custom'")
        if self.name == "gpt" and self.width % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.width ({self.width})")
        return self


class DatasetSpec(_Part):
    name: Literal[DATASETS] = Field("synthetic", description="Dataset source.")
    root: str | None = Field(
        None, description="Directory of the dataset files (torchvision sets, image_folder)."
    )
    images: str | None = Field(None, description="idx: the IDX images file (.gz allowed).")
    labels: str | None = Field(None, description="idx: the IDX labels file (.gz allowed).")
    download: bool = Field(True, description="torchvision sets: download when missing.")
    val_fraction: float = Field(
        0.1, ge=0.0, lt=1.0, description="Held-out share when there is no separate split."
    )
    size: int = Field(8192, ge=16, le=10_000_000, description="synthetic: number of samples.")
    num_classes: int = Field(10, ge=2, le=100_000, description="synthetic: classes.")
    channels: int = Field(1, ge=1, le=16, description="synthetic: image channels.")
    image_size: int = Field(28, ge=8, le=1024, description="synthetic/image_folder: side in pixels.")
    noise: float = Field(1.0, ge=0.0, le=100.0, description="synthetic: noise around class prototypes.")
    vocab_size: int = Field(
        64, ge=2, le=1_000_000, description="synthetic_tokens: number of distinct tokens."
    )
    max_chars: int = Field(
        2_000_000, ge=1000, le=1_000_000_000, description="python_source: characters of corpus to read."
    )
    loader_workers: int = Field(
        0, ge=0, le=64,
        description="DataLoader worker processes per training worker for a task's datasets (0: read in the "
        "training process, where the RNG is restored exactly on resume).",
    )
    fallback_to_synthetic: bool = Field(
        False, description="If the files are missing, train on the synthetic set instead (with a notice)."
    )

    @model_validator(mode="after")
    def _paths_present(self) -> DatasetSpec:
        if self.name == "idx" and not (self.images and self.labels):
            raise ValueError("dataset.images and dataset.labels are required when dataset.name is 'idx'")
        if self.name == "image_folder" and not self.root:
            raise ValueError("dataset.root is required when dataset.name is 'image_folder'")
        return self


class ResourcesSpec(_Part):
    cpu: float = Field(1.0, gt=0, le=1024, description="CPUs per worker (also its thread count).")
    gpu: float = Field(0.0, ge=0, le=64, description="GPUs per worker; >0 selects NCCL.")
    custom: dict[Annotated[str, Field(pattern=r"^[A-Za-z_][\w.-]{0,63}$")], Annotated[float, Field(gt=0, le=1e6)]] = Field(
        default_factory=dict, max_length=16,
        description="Ray custom resources per worker, e.g. {'trainer_node': 1} to run only on nodes that offer it.",
    )
    scheduling_timeout_s: float | None = Field(
        None, gt=0, le=7 * 86400,
        description="The service fails the job when no worker has completed a step this long after Ray accepted it "
        "(the cluster fits the job but has not given it its resources); unset: wait for ever.",
    )


class TrainingSpec(_Part):
    epochs: int | None = Field(None, ge=1, le=100_000, description="Passes over the training set.")
    max_steps: int | None = Field(None, ge=1, le=100_000_000, description="Optimizer steps; wins over epochs.")
    global_batch_size: int = Field(64, ge=1, le=1_000_000, description="Samples per step, all workers together.")
    optimizer: Literal[OPTIMIZERS] = "adam"
    lr: float = Field(1e-3, gt=0, le=100)
    momentum: float = Field(0.9, ge=0, lt=1, description="sgd only.")
    weight_decay: float = Field(0.0, ge=0, le=1)
    schedule: Literal[SCHEDULES] = "constant"
    warmup_steps: int = Field(0, ge=0, le=100_000_000)
    step_size: int = Field(100, ge=1, description="schedule=step: steps between decays.")
    gamma: float = Field(0.1, gt=0, le=1, description="schedule=step: decay factor.")
    seed: int = Field(0, ge=0, le=2**31 - 1)
    micro_batch_size: int | None = Field(
        None, ge=1, le=1_000_000,
        description="Largest batch one worker runs forward at once; bigger shares accumulate gradients.",
    )
    eval_batch_size: int = Field(512, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _default_length(self) -> TrainingSpec:
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1
        return self


class CheckpointSpec(_Part):
    every_steps: int = Field(50, ge=1, le=100_000_000, description="Commit a checkpoint every N steps.")
    keep: int = Field(3, ge=1, le=1000, description="Committed checkpoints to retain.")


class EvaluationSpec(_Part):
    every_steps: int = Field(
        ..., le=100_000_000,
        description="Score the validation split every N steps; the step's metrics line gets val_loss, "
        "val_accuracy and val_metrics. It runs on every worker and leaves training exactly as it would be without.",
    )

    @field_validator("every_steps")
    @classmethod
    def _positive(cls, value: int) -> int:
        # pydantic's own "greater than or equal to 1" does not say what the number means.
        if value < 1:
            raise ValueError(f"evaluation.every_steps must be at least 1 (a step count), got {value}")
        return value


FAILURE_MODES = ("exact", "live")


class FailureSpec(_Part):
    mode: Literal[FAILURE_MODES] = Field(
        "exact",
        description="exact: a failed worker restarts the whole group from the newest committed checkpoint, "
        "bit-identical to an undisturbed run; live: every worker is its own replica group (torchft), a failed "
        "one is replaced and takes the current state from a live peer while the others keep training.",
    )
    max_failures: int = Field(3, ge=-1, le=1000, description="Infrastructure failures to retry; -1: no limit.")
    collective_timeout_s: int = Field(
        30, ge=5, le=3600, description="A collective that waits this long fails (detects hangs)."
    )
    hang_timeout_s: int = Field(
        300, ge=2, le=86400,
        description="A worker that makes no progress this long (a step, a batch read, a checkpoint phase, an "
                    "evaluation batch) is declared hung and restarted like a crashed one.",
    )
    spares: bool = Field(
        True,
        description="exact mode: from 5 s after the workers start to train, each node keeps one idle Ray worker "
                    "process per worker it runs, torch imported (at idle CPU priority); a restart starts in them "
                    "instead of booting new processes. Costs each spare's memory and its boot, once per start.",
    )


class FsdpSpec(_Part):
    cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")


class ParallelSpec(_Part):
    """Model-parallel degrees. Data parallel takes whatever of the workers is left."""

    tensor: int = Field(1, ge=1, le=4096, description="Ranks each layer's weights are split across (tensor, hybrid).")
    pipeline: int = Field(1, ge=1, le=4096, description="Pipeline stages the layers are split into (pipeline, hybrid).")
    shard: int | None = Field(
        None, ge=1, le=4096,
        description="hybrid without tensor/pipeline: HSDP, shard within groups of this many ranks, replicate across groups.",
    )
    microbatches: int = Field(4, ge=1, le=4096, description="pipeline: microbatches per step.")
    schedule: Literal[PIPELINE_SCHEDULES] = Field("1f1b", description="pipeline: gpipe or 1f1b.")
    async_checkpoint: bool = Field(
        False, description="Sharded strategies: write checkpoints in the background; training goes on meanwhile."
    )


class ElasticWorkers(_Part):
    min: int = Field(..., ge=1, le=4096, description="Start as soon as this many workers fit; never fewer.")
    max: int = Field(..., ge=1, le=4096, description="Grow to this many workers when resources allow.")
    resize_check_s: float = Field(
        10.0, ge=1, le=3600, description="How often a running job checks whether more workers would now fit."
    )

    @model_validator(mode="after")
    def _ordered(self) -> ElasticWorkers:
        if self.min > self.max:
            raise ValueError(f"workers.min ({self.min}) is larger than workers.max ({self.max})")
        return self


class FaultSpec(_Part):
    at_step: int = Field(..., ge=1, description="Fire while running this step (1-based).")
    rank: int = Field(0, ge=0, description="World rank that fails.")
    kind: Literal[FAULT_KINDS] = Field(..., description="crash: SIGKILL; exception: raise; hang: stop progressing.")
    phase: Literal[FAULT_PHASES] = Field(
        "step", description="step: before the step; data: while reading its batch; checkpoint: while the "
                            "checkpoint of at_step is written; commit: while rank 0 seals it.",
    )


def live_error(spec: JobSpec) -> str | None:
    """Why the spec cannot run in failure.mode live, or None. Ray 2.60's torchft
    integration makes each worker its own replica group (a group of one), so what
    crosses groups is data parallelism and nothing else."""
    if spec.failure.mode != "live":
        return None
    if spec.strategy != "ddp":
        return (f"failure.mode 'live' needs strategy 'ddp': each worker is its own replica group (Ray Train's "
                f"torchft groups hold one worker), so a strategy that splits the model across workers "
                f"({spec.strategy!r}) would lose part of it with every failed worker; use failure.mode 'exact'")
    if spec.elastic:
        return ("failure.mode 'live' needs a fixed worker count: Ray Train replaces a failed replica group only "
                "at the same size, so an elastic range would restart every worker anyway")
    if spec.workers < 2:
        return "failure.mode 'live' needs at least 2 workers: with one there is no live peer to keep training"
    if spec.precision == "fp16":
        return ("failure.mode 'live' does not take precision 'fp16': a step's loss-scale skip would have to agree "
                "across a changing set of replica groups; use 'bf16'")
    if spec.parallel.async_checkpoint:
        return "failure.mode 'live' writes checkpoints from one replica group; parallel.async_checkpoint does not apply"
    if spec.evaluation is not None:
        return ("failure.mode 'live' scores the validation split once, at the end: evaluation.every_steps would "
                "be a collective across a changing set of replica groups")
    if any(f.kind == "hang" or f.phase != "step" for f in spec.faults):
        return "failure.mode 'live' injects faults of kind 'crash' or 'exception' in phase 'step' only"
    return None


def parallel_error(spec: JobSpec, world: int) -> str | None:
    """Why `world` workers cannot run the spec's strategy and degrees, or None.
    Checked when the spec is parsed, so a bad mesh never reaches a worker."""
    p, strategy = spec.parallel, spec.strategy
    if strategy == "ddp" and p.async_checkpoint:
        return ("parallel.async_checkpoint needs a strategy whose ranks each write a part (fsdp, tensor, pipeline, "
                "hybrid); with ddp rank 0 writes the one copy")
    if strategy in ("ddp", "fsdp") and (p.tensor > 1 or p.pipeline > 1 or p.shard):
        return (f"parallel.tensor, parallel.pipeline and parallel.shard apply to the tensor, pipeline and hybrid "
                f"strategies; strategy {strategy!r} uses every worker for data parallelism")
    if strategy in ("tensor", "pipeline", "hybrid") and spec.model.name != "gpt" and not spec.task:
        return f"strategy {strategy!r} splits a transformer's layers: it needs model 'gpt', not {spec.model.name!r}"
    if spec.precision == "fp16" and (strategy in ("tensor", "pipeline") or p.tensor > 1 or p.pipeline > 1):
        # GradScaler cannot unscale a mix of split (DTensor) and whole gradients, and a
        # pipeline's stages would each need to agree on every skipped step.
        return (f"precision 'fp16' needs loss scaling, which works with ddp, fsdp and HSDP only; "
                f"use precision 'bf16' with strategy {strategy!r} (same speed-up, no scaling needed)")
    if strategy == "tensor":
        if p.pipeline > 1 or p.shard:
            return "strategy 'tensor' splits layers only: parallel.pipeline and parallel.shard need strategy 'hybrid'"
        if p.tensor not in (1, world):
            return (f"strategy 'tensor' splits every layer across all workers: parallel.tensor ({p.tensor}) must "
                    f"equal workers ({world}); for data parallel x tensor use strategy 'hybrid'")
        return _tensor_error(spec, world)
    if strategy == "pipeline":
        if p.tensor > 1 or p.shard:
            return "strategy 'pipeline' splits layers into stages only: parallel.tensor and parallel.shard need 'hybrid'"
        if p.pipeline not in (1, world):
            return (f"strategy 'pipeline' makes one stage per worker: parallel.pipeline ({p.pipeline}) must equal "
                    f"workers ({world}); for data parallel x pipeline use strategy 'hybrid'")
        return _pipeline_error(spec, stages=world, data=1)
    if strategy == "hybrid":
        chosen = [name for name, on in (("tensor", p.tensor > 1), ("pipeline", p.pipeline > 1),
                                        ("shard", p.shard is not None)) if on]
        if len(chosen) != 1:
            return ("strategy 'hybrid' is data parallel times exactly one of parallel.tensor > 1, "
                    f"parallel.pipeline > 1 or parallel.shard (HSDP); got {', '.join(chosen) or 'none'}")
        degree = p.tensor * p.pipeline if p.shard is None else p.shard
        if world % degree:
            return (f"the degrees must multiply to the worker count: parallel.{chosen[0]} ({degree}) does not divide "
                    f"workers ({world}), so no whole number of data-parallel groups fits")
        if p.tensor > 1:
            return _tensor_error(spec, p.tensor)
        if p.pipeline > 1:
            return _pipeline_error(spec, stages=p.pipeline, data=world // p.pipeline)
    return None


def _tensor_error(spec: JobSpec, tp: int) -> str | None:
    if spec.task:  # a task's own tensor_plan decides what splits
        return None
    if spec.model.heads % tp or (4 * spec.model.width) % tp:
        return (f"tensor parallel degree {tp} must divide model.heads ({spec.model.heads}) so each rank "
                f"holds whole attention heads")
    return None


def _pipeline_error(spec: JobSpec, *, stages: int, data: int) -> str | None:
    if not spec.task and spec.model.layers < stages:
        return f"{stages} pipeline stages need at least as many model.layers, got {spec.model.layers}"
    share = spec.training.global_batch_size // data
    if spec.training.global_batch_size % data or share % spec.parallel.microbatches:
        return (f"each pipeline's batch (global_batch_size {spec.training.global_batch_size} / {data} data-parallel "
                f"groups) must split into parallel.microbatches ({spec.parallel.microbatches}) equal parts")
    return None


def _name_shorthand(value: Any) -> Any:
    # `model: simple_cnn` is the one-line spec users write first.
    return {"name": value} if isinstance(value, str) else value


class JobSpec(_Part):
    job_id: str = Field(
        default_factory=lambda: f"job-{uuid.uuid4().hex[:12]}",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$",
        description="Names the run directory; letters, digits, '_', '.', '-'.",
    )
    model: Annotated[ModelSpec, Field(default_factory=ModelSpec)]
    dataset: Annotated[DatasetSpec, Field(default_factory=DatasetSpec)]
    strategy: Literal[STRATEGIES] = Field(
        "ddp",
        description="ddp: whole model on every worker; fsdp: parameters, gradients and optimizer sharded; "
        "tensor: every layer split across workers; pipeline: layers split into stages; "
        "hybrid: data parallel x tensor or pipeline (2-D mesh), or HSDP (replicate x shard).",
    )
    fsdp: Annotated[FsdpSpec, Field(default_factory=FsdpSpec)]
    parallel: Annotated[ParallelSpec, Field(default_factory=ParallelSpec)]
    workers: Annotated[int, Field(ge=1, le=4096)] | ElasticWorkers = Field(
        2, description="Number of training workers, or {min, max} for an elastic job."
    )
    resources: Annotated[ResourcesSpec, Field(default_factory=ResourcesSpec)]
    training: Annotated[TrainingSpec, Field(default_factory=TrainingSpec)]
    precision: Literal[PRECISIONS] = Field(
        "fp32", description="bf16/fp16: autocast with fp32 weights; fp16 also scales the loss (GradScaler)."
    )
    checkpoint: Annotated[CheckpointSpec, Field(default_factory=CheckpointSpec)]
    evaluation: EvaluationSpec | None = Field(
        None, description="Validation during training, e.g. {every_steps: 100}; unset: only once, at the end."
    )
    failure: Annotated[FailureSpec, Field(default_factory=FailureSpec)]
    faults: list[FaultSpec] = Field(default_factory=list, max_length=100)
    storage: str = Field(default_factory=default_storage, validate_default=True,
                         description="Root under which run directories live: a path every node reaches.")
    task: str | None = Field(
        None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$",
        description="Your own training task, 'module:function': function(task_config) returns an object with "
        "model(), datasets() and loss(output, target) (see README, 'Your own code'). Unset: the built-in task "
        "that model and dataset name.",
    )
    task_config: dict[str, Any] = Field(
        default_factory=dict, description="Any JSON object; passed to the task function on every attempt."
    )
    code: str | None = Field(
        None, pattern=r"^[0-9a-f]{16,64}$",
        description="The id of a code archive uploaded to the service (POST /v1/code, `etrain submit --code DIR`); "
        "it becomes every worker's working directory.",
    )
    requirements: list[Annotated[str, Field(min_length=1, max_length=200)]] = Field(
        default_factory=list, max_length=100,
        description="pip requirements the task needs; installed on every worker by Ray (runtime_env pip).",
    )

    _shorthand_model = field_validator("model", mode="before")(_name_shorthand)

    @field_validator("storage")
    @classmethod
    def _storage_every_node_reaches(cls, value: str) -> str:
        return check_storage(value)
    _shorthand_dataset = field_validator("dataset", mode="before")(_name_shorthand)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        # An elastic job may run at any size in its range, so each must fit the mesh.
        for size in range(self.min_workers, self.max_workers + 1):
            mesh_error = parallel_error(self, size)
            if mesh_error:
                raise ValueError(f"with {size} workers: {mesh_error}" if self.elastic else mesh_error)
        live = live_error(self)
        if live:
            raise ValueError(live)
        if self.training.global_batch_size < self.max_workers:
            raise ValueError(
                f"training.global_batch_size ({self.training.global_batch_size}) is smaller than the "
                f"{self.max_workers} workers: every worker needs at least one sample per step"
            )
        text = self.dataset.name in TEXT_DATASETS
        if text != (self.model.name == "gpt") and self.model.name != "custom" and not self.task:
            raise ValueError(
                f"model {self.model.name!r} does not fit dataset {self.dataset.name!r}: gpt trains on "
                f"{' or '.join(TEXT_DATASETS)}, image models on {', '.join(IMAGE_DATASETS)}"
            )
        for fault in self.faults:
            if fault.rank >= self.max_workers:
                raise ValueError(f"faults: rank {fault.rank} does not exist with {self.max_workers} workers")
            if fault.phase == "checkpoint" and fault.at_step % self.checkpoint.every_steps:
                raise ValueError(
                    f"faults: phase 'checkpoint' at_step {fault.at_step} is not a checkpoint step "
                    f"(checkpoint.every_steps is {self.checkpoint.every_steps})"
                )
        return self

    @property
    def elastic(self) -> bool:
        return isinstance(self.workers, ElasticWorkers)

    @property
    def min_workers(self) -> int:
        return self.workers.min if self.elastic else self.workers

    @property
    def max_workers(self) -> int:
        return self.workers.max if self.elastic else self.workers

    @property
    def run_dir(self) -> str:
        return storage.join(self.storage, self.job_id)


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Parse a YAML or JSON spec file. Relative dataset paths resolve from the cwd."""
    # The service names a run record's spec.json, which may be on an object store.
    text = Path(path).read_text() if storage.is_local(str(path)) else storage.read_bytes(str(path)).decode()
    if str(path).endswith(".json"):
        data = json.loads(text)
    else:
        import yaml  # JSON is YAML too, but the json module gives clearer errors for .json

        data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a spec is a mapping of fields, got {type(data).__name__}")
    return JobSpec.model_validate(data)


def absolute_paths(spec: JobSpec, base: str | os.PathLike | None = None) -> JobSpec:
    """Ray Train workers run in their own working directory, so resolve paths first."""
    base = Path(base or os.getcwd())

    def fix(p: str | None) -> str | None:
        # abspath, not resolve: a path through a symlink must stay as written, or the
        # spec.json a service wrote would no longer equal the spec the driver loads.
        return None if p is None else os.path.abspath(os.path.join(base, os.path.expanduser(p)))

    dataset = spec.dataset.model_copy(
        update={"root": fix(spec.dataset.root), "images": fix(spec.dataset.images), "labels": fix(spec.dataset.labels)}
    )
    return spec.model_copy(update={"storage": fix(spec.storage) if storage.is_local(spec.storage) else spec.storage,
                                   "dataset": dataset})


def write_spec_json(spec: JobSpec) -> str:
    """Write <run dir>/spec.json once, atomically (fsync, then rename); return its path.
    It is immutable: an existing file is left as it is."""
    path = storage.join(spec.run_dir, "spec.json")
    if storage.exists(path):
        return path
    if not storage.is_local(path):
        storage.write_bytes(path, spec.model_dump_json(indent=2).encode())  # one PUT: whole or absent
        return path
    os.makedirs(spec.run_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(spec.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
