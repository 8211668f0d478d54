"""workers/data: the real MNIST test split, IDX parsing, synthetic data, availability checks."""

from __future__ import annotations

import gzip
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch

from workers.data import DatasetUnavailable, check_available, load
from workers.data.idx import read_idx
from workers.data.synthetic import synthetic
from workers.spec import DatasetSpec

MNIST = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist" / "raw"
IMAGES = MNIST / "t10k-images-idx3-ubyte.gz"
LABELS = MNIST / "t10k-labels-idx1-ubyte.gz"
needs_mnist = pytest.mark.skipif(not (IMAGES.is_file() and LABELS.is_file()), reason=f"no MNIST files in {MNIST}")


def idx_bytes(array: np.ndarray, code: int) -> bytes:
    header = bytes([0, 0, code, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    return header + array.tobytes()


# ---------------------------------------------------------------- real MNIST

@needs_mnist
def test_read_idx_reads_the_mnist_test_split():
    images, labels = read_idx(str(IMAGES)), read_idx(str(LABELS))
    assert images.shape == (10000, 28, 28) and images.dtype == torch.uint8
    assert labels.shape == (10000,) and labels.dtype == torch.uint8
    assert sorted(labels.unique().tolist()) == list(range(10))
    assert labels[:10].tolist() == [7, 2, 1, 0, 4, 1, 4, 9, 5, 9]  # the well-known first test digits
    assert images.max() == 255 and images.min() == 0
    assert 0 < images.float().mean() < 255


@needs_mnist
def test_load_idx_splits_8000_2000():
    spec = DatasetSpec(name="idx", images=str(IMAGES), labels=str(LABELS), val_fraction=0.2)
    splits = load(spec, seed=0)
    assert (len(splits.train), len(splits.val)) == (8000, 2000)
    assert (splits.in_channels, splits.num_classes, splits.image_size) == (1, 10, 28)
    assert splits.notice is None
    assert splits.train.images.shape == (8000, 1, 28, 28) and splits.train.images.dtype == torch.float32
    assert splits.val.images.shape == (2000, 1, 28, 28)
    # Standardised with the training set's statistics.
    assert abs(splits.train.images.mean().item()) < 1e-3
    assert abs(splits.train.images.std().item() - 1) < 1e-3
    # A partition: together the two splits hold every label exactly once.
    all_labels = read_idx(str(LABELS)).long()
    together = torch.bincount(splits.train.labels, minlength=10) + torch.bincount(splits.val.labels, minlength=10)
    assert torch.equal(together, torch.bincount(all_labels, minlength=10))
    x, y = splits.train.batch(torch.tensor([0, 5, 7]))
    assert x.shape == (3, 1, 28, 28) and y.tolist() == splits.train.labels[[0, 5, 7]].tolist()


@needs_mnist
def test_load_idx_split_depends_on_the_seed():
    spec = DatasetSpec(name="idx", images=str(IMAGES), labels=str(LABELS), val_fraction=0.2)
    a, b, c = load(spec, seed=0), load(spec, seed=0), load(spec, seed=1)
    assert torch.equal(a.val.labels, b.val.labels) and torch.equal(a.val.images, b.val.images)
    assert not torch.equal(a.val.labels, c.val.labels)


# ---------------------------------------------------------------- read_idx

def test_read_idx_decodes_big_endian_types(tmp_path):
    values = np.arange(-6, 6, dtype=">i4").reshape(3, 4)
    path = tmp_path / "ints.idx"
    path.write_bytes(idx_bytes(values, 0x0C))
    out = read_idx(str(path))
    assert out.shape == (3, 4)
    assert out.tolist() == values.tolist()
    gz = tmp_path / "floats.idx.gz"
    floats = np.linspace(0, 1, 5, dtype=">f4")
    gz.write_bytes(gzip.compress(idx_bytes(floats, 0x0D)))
    assert torch.allclose(read_idx(str(gz)), torch.tensor(floats.astype(np.float32)))


@pytest.mark.parametrize("content", [b"", b"hello, this is not an IDX file", b"\x00\x00\x07\x01" + b"\x00" * 8],
                         ids=["empty", "text", "unknown-type"])
def test_read_idx_rejects_a_non_idx_file(tmp_path, content):
    path = tmp_path / "not.idx"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="not an IDX file") as info:
        read_idx(str(path))
    assert str(path) in str(info.value)


def test_read_idx_rejects_a_truncated_file(tmp_path):
    data = idx_bytes(np.arange(100, dtype=np.uint8).reshape(10, 10), 0x08)
    path = tmp_path / "short.idx"
    path.write_bytes(data[:-30])
    with pytest.raises(ValueError, match=r"header says \[10, 10\] \(100 bytes\) but holds 70 \(truncated\?\)") as info:
        read_idx(str(path))
    assert str(path) in str(info.value)


@needs_mnist
def test_read_idx_rejects_a_truncated_mnist_file(tmp_path):
    path = tmp_path / "t10k-labels-idx1-ubyte"
    path.write_bytes(gzip.decompress(LABELS.read_bytes())[:5008])
    with pytest.raises(ValueError, match=r"header says \[10000\] \(10000 bytes\) but holds 5000"):
        read_idx(str(path))


def _truncated_gz(tmp_path):
    data = gzip.compress(idx_bytes(np.arange(1000, dtype=np.uint8) % 251, 0x08))
    path = tmp_path / "labels.idx.gz"
    path.write_bytes(data[: len(data) // 2])
    return path


def _truncated_header(tmp_path):
    path = tmp_path / "header.idx"
    path.write_bytes(idx_bytes(np.zeros((5, 4, 4), np.uint8), 0x08)[:9])  # stops inside the dimensions
    return path


def _partial_element(tmp_path):
    path = tmp_path / "ints.idx"
    path.write_bytes(idx_bytes(np.arange(10, dtype=">i4"), 0x0C)[:-2])  # the last int32 half there
    return path


@pytest.mark.parametrize("make", [_truncated_gz, _truncated_header, _partial_element],
                         ids=["gz-cut-short", "header-cut-short", "partial-element"])
def test_read_idx_names_the_file_for_any_truncation(tmp_path, make):
    path = make(tmp_path)
    with pytest.raises(ValueError) as info:
        read_idx(str(path))
    assert str(path) in str(info.value)


# ---------------------------------------------------------------- synthetic

def test_synthetic_is_deterministic_for_a_seed():
    kw = dict(size=64, num_classes=4, channels=2, image_size=8, noise=1.0)
    x1, y1 = synthetic(seed=3, **kw)
    x2, y2 = synthetic(seed=3, **kw)
    x3, y3 = synthetic(seed=4, **kw)
    assert x1.shape == (64, 2, 8, 8) and y1.shape == (64,)
    assert y1.min() >= 0 and y1.max() < 4
    assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert not torch.equal(x1, x3)


def test_synthetic_dataset_through_load():
    spec = DatasetSpec(name="synthetic", size=200, num_classes=5, channels=3, image_size=12, val_fraction=0.25)
    a, b, c = load(spec, seed=7), load(spec, seed=7), load(spec, seed=8)
    assert (len(a.train), len(a.val)) == (150, 50)
    assert (a.in_channels, a.num_classes, a.image_size) == (3, 5, 12)
    assert a.train.images.shape == (150, 3, 12, 12)
    assert torch.equal(a.train.images, b.train.images) and torch.equal(a.val.labels, b.val.labels)
    assert not torch.equal(a.train.images, c.train.images)


def test_synthetic_classes_are_learnable_structure():
    # Without noise every sample is its class prototype exactly.
    x, y = synthetic(size=40, num_classes=3, channels=1, image_size=8, noise=0.0, seed=1)
    for cls in range(3):
        members = x[y == cls]
        assert len(members) > 0
        assert torch.equal(members, members[:1].expand_as(members))


# ---------------------------------------------------------------- availability

def test_check_available_is_quiet_for_synthetic_and_present_files(tmp_path):
    assert check_available(DatasetSpec(name="synthetic")) is None
    images, labels = tmp_path / "i.idx", tmp_path / "l.idx"
    images.write_bytes(b"x")
    labels.write_bytes(b"x")
    assert check_available(DatasetSpec(name="idx", images=str(images), labels=str(labels))) is None


def test_check_available_names_the_missing_path(tmp_path):
    present = tmp_path / "images.idx.gz"
    present.write_bytes(b"x")
    missing = tmp_path / "nowhere" / "labels.idx.gz"
    spec = DatasetSpec(name="idx", images=str(present), labels=str(missing))
    with pytest.raises(DatasetUnavailable) as info:
        check_available(spec)
    assert str(missing) in str(info.value)
    assert str(present) not in str(info.value)


def test_check_available_names_a_missing_image_folder(tmp_path):
    spec = DatasetSpec(name="image_folder", root=str(tmp_path / "photos"))
    with pytest.raises(DatasetUnavailable, match=str(tmp_path / "photos")):
        check_available(spec)


def test_fallback_to_synthetic_gives_a_one_line_notice(tmp_path):
    missing = tmp_path / "gone.gz"
    spec = DatasetSpec(name="idx", images=str(missing), labels=str(missing), fallback_to_synthetic=True,
                       size=64, val_fraction=0.25)
    notice = check_available(spec)
    assert isinstance(notice, str) and "\n" not in notice
    assert str(missing) in notice and "synthetic" in notice
    splits = load(spec, seed=0)
    assert splits.notice == notice
    assert (len(splits.train), len(splits.val)) == (48, 16)


@pytest.fixture
def offline(monkeypatch):
    """No name resolves: the test behaves the same on a machine with internet."""
    def refuse(*args, **kwargs):
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (offline test)")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)


@pytest.mark.timeout(60)
def test_torchvision_set_offline_fails_naming_the_directory(tmp_path, offline):
    root = tmp_path / "data"
    root.mkdir()
    spec = DatasetSpec(name="mnist", root=str(root), download=True)
    with pytest.raises(DatasetUnavailable) as info:
        check_available(spec)
    message = str(info.value)
    assert os.path.join(str(root), "MNIST", "raw") in message
    assert "could not be downloaded" in message
    assert "train-images-idx3-ubyte.gz" in message
    assert "offline test" in str(info.value.__cause__)  # it did try, and failed on the network


def test_torchvision_set_without_download_fails_naming_the_directory(tmp_path):
    spec = DatasetSpec(name="cifar10", root=str(tmp_path), download=False)
    with pytest.raises(DatasetUnavailable) as info:
        check_available(spec)
    assert str(tmp_path) in str(info.value)
    assert "cifar-10-python.tar.gz" in str(info.value)


def test_torchvision_set_missing_falls_back_to_synthetic_when_asked(tmp_path):
    spec = DatasetSpec(name="mnist", root=str(tmp_path), download=False, fallback_to_synthetic=True)
    notice = check_available(spec)
    assert notice is not None and "synthetic" in notice
