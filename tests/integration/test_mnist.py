import pytest

from tests.conftest import MNIST, run_job

pytestmark = pytest.mark.ray


def test_simple_cnn_reaches_95_percent_on_real_mnist(ray_cluster, tmp_path):
    assert (MNIST / "t10k-images-idx3-ubyte.gz").exists(), f"the real MNIST test split is expected in {MNIST}"
    spec = {
        "job_id": "mnist",
        "model": "simple_cnn",
        "dataset": {"name": "idx", "images": str(MNIST / "t10k-images-idx3-ubyte.gz"),
                    "labels": str(MNIST / "t10k-labels-idx1-ubyte.gz"), "val_fraction": 0.2},
        "workers": 2,
        "training": {"epochs": 3, "global_batch_size": 64, "optimizer": "adam", "lr": 0.001, "seed": 0},
        "checkpoint": {"every_steps": 100},
    }
    outcome = run_job(ray_cluster, spec, tmp_path)
    assert outcome.rc == 0, outcome.output[-3000:]
    assert outcome.summary["val_accuracy"] >= 0.95, outcome.summary
