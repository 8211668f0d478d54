"""The one definition of a training job.

The API, the CLI and `ray job submit` all end in a `JobSpec`. This module imports
neither torch nor ray so the control plane can validate specs without them.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MODELS = ("simple_cnn", "resnet18", "mlp", "custom")
DATASETS = ("mnist", "fashion_mnist", "cifar10", "idx", "image_folder", "synthetic")
STRATEGIES = ("ddp", "fsdp")
OPTIMIZERS = ("sgd", "adam", "adamw")
SCHEDULES = ("constant", "cosine", "step")
PRECISIONS = ("fp32", "bf16", "fp16")
FAULT_KINDS = ("crash", "exception", "hang")


def default_storage() -> str:
    """Run directories live under the user's cache unless the spec says otherwise."""
    env = os.environ.get("ETRAIN_STORAGE")
    if env:
        return env
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(Path.home(), ".cache")
    return os.path.join(cache, "elastic-train", "runs")


class _Part(BaseModel):
    # Unknown keys are almost always typos ("max_step"); say so instead of ignoring them.
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Part):
    name: Literal[MODELS] = Field("simple_cnn", description="Model architecture.")
    hidden: int = Field(128, ge=1, le=65536, description="Hidden width (mlp).")
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
    eval_batch_size: int = Field(512, ge=1, le=1_000_000)

    @model_validator(mode="after")
    def _default_length(self) -> TrainingSpec:
        if self.epochs is None and self.max_steps is None:
            self.epochs = 1
        return self


class CheckpointSpec(_Part):
    every_steps: int = Field(50, ge=1, le=100_000_000, description="Commit a checkpoint every N steps.")
    keep: int = Field(3, ge=1, le=1000, description="Committed checkpoints to retain.")


class FailureSpec(_Part):
    max_failures: int = Field(3, ge=-1, le=1000, description="Infrastructure failures to retry; -1: no limit.")
    collective_timeout_s: int = Field(
        30, ge=5, le=3600, description="A collective that waits this long fails (detects hangs)."
    )


class FsdpSpec(_Part):
    cpu_offload: bool = Field(False, description="Keep sharded parameters and optimizer state in CPU memory.")


class FaultSpec(_Part):
    at_step: int = Field(..., ge=1, description="Fire while running this step (1-based).")
    rank: int = Field(0, ge=0, description="World rank that fails.")
    kind: Literal[FAULT_KINDS] = Field(..., description="crash: SIGKILL; exception: raise; hang: stop progressing.")
    phase: Literal["step", "checkpoint"] = Field(
        "step", description="checkpoint: fire while the checkpoint of at_step is being written."
    )


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
        "ddp", description="ddp: whole model on every worker; fsdp: parameters, gradients and optimizer sharded."
    )
    fsdp: Annotated[FsdpSpec, Field(default_factory=FsdpSpec)]
    workers: int = Field(2, ge=1, le=4096, description="Number of training workers.")
    resources: Annotated[ResourcesSpec, Field(default_factory=ResourcesSpec)]
    training: Annotated[TrainingSpec, Field(default_factory=TrainingSpec)]
    precision: Literal[PRECISIONS] = Field(
        "fp32", description="bf16/fp16: autocast with fp32 weights; fp16 also scales the loss (GradScaler)."
    )
    checkpoint: Annotated[CheckpointSpec, Field(default_factory=CheckpointSpec)]
    failure: Annotated[FailureSpec, Field(default_factory=FailureSpec)]
    faults: list[FaultSpec] = Field(default_factory=list, max_length=100)
    storage: str = Field(default_factory=default_storage, description="Root under which run directories live.")

    _shorthand_model = field_validator("model", mode="before")(_name_shorthand)
    _shorthand_dataset = field_validator("dataset", mode="before")(_name_shorthand)

    @model_validator(mode="after")
    def _consistent(self) -> JobSpec:
        if self.training.global_batch_size % self.workers:
            raise ValueError(
                f"training.global_batch_size ({self.training.global_batch_size}) must be divisible "
                f"by workers ({self.workers}) so every worker gets the same share"
            )
        for fault in self.faults:
            if fault.rank >= self.workers:
                raise ValueError(f"faults: rank {fault.rank} does not exist with {self.workers} workers")
            if fault.phase == "checkpoint" and fault.at_step % self.checkpoint.every_steps:
                raise ValueError(
                    f"faults: phase 'checkpoint' at_step {fault.at_step} is not a checkpoint step "
                    f"(checkpoint.every_steps is {self.checkpoint.every_steps})"
                )
        return self

    @property
    def run_dir(self) -> str:
        return os.path.join(self.storage, self.job_id)


def load_spec(path: str | os.PathLike) -> JobSpec:
    """Parse a YAML or JSON spec file. Relative dataset paths resolve from the cwd."""
    text = Path(path).read_text()
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
    return spec.model_copy(update={"storage": fix(spec.storage), "dataset": dataset})


def write_spec_json(spec: JobSpec) -> str:
    """Write <run dir>/spec.json once, atomically (fsync, then rename); return its path.
    It is immutable: an existing file is left as it is."""
    path = os.path.join(spec.run_dir, "spec.json")
    if os.path.exists(path):
        return path
    os.makedirs(spec.run_dir, exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(spec.model_dump_json(indent=2))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path
