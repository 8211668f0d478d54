"""Datasets by name: torchvision sets, users' own files, a synthetic set, and token
sets for gpt (text.py).

Every source ends as an `ImageSet`: `len()` and `batch(indices) -> (x, y)`. Sets that
fit in memory are held as tensors so a batch is one indexing operation, not a Python
loop over samples.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from workers.data import text
from workers.data.idx import read_idx
from workers.data.synthetic import synthetic
from workers.dataset_check import DatasetUnavailable, check_available  # its API, re-exported
from workers.spec import TEXT_DATASETS, DatasetSpec


class ImageSet:
    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[indices], self.labels[indices]


class FolderSet:
    """torchvision ImageFolder, read lazily: users' folders may not fit in memory."""

    def __init__(self, folder, indices: torch.Tensor):
        self.folder, self.indices = folder, indices

    def __len__(self) -> int:
        return len(self.indices)

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        items = [self.folder[int(self.indices[i])] for i in indices]
        return torch.stack([x for x, _ in items]), torch.tensor([y for _, y in items])


@dataclass
class Splits:
    train: ImageSet | FolderSet
    val: ImageSet | FolderSet
    in_channels: int
    num_classes: int
    image_size: int
    notice: str | None = None


def _as_float(images: torch.Tensor) -> torch.Tensor:
    x = images.float()
    if images.dtype == torch.uint8:
        x = x / 255.0
    if x.dim() == 3:  # N, H, W -> N, 1, H, W
        x = x.unsqueeze(1)
    elif x.shape[-1] in (1, 3) and x.shape[1] not in (1, 3):  # N, H, W, C -> N, C, H, W
        x = x.permute(0, 3, 1, 2).contiguous()
    return x


def _split(n: int, val_fraction: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    n_val = int(round(n * val_fraction))
    return perm[n_val:], perm[:n_val]


def _tensor_splits(images, labels, val_images, val_labels, spec: DatasetSpec, seed: int) -> Splits:
    x, y = _as_float(images), labels.long()
    if val_images is None:
        train_idx, val_idx = _split(len(y), spec.val_fraction, seed)
        vx, vy = x[val_idx], y[val_idx]
        x, y = x[train_idx], y[train_idx]
    else:
        vx, vy = _as_float(val_images), val_labels.long()
    # Standardise with the training set's own statistics, per channel.
    mean = x.mean(dim=(0, 2, 3), keepdim=True)
    std = x.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    x, vx = (x - mean) / std, (vx - mean) / std
    return Splits(ImageSet(x, y), ImageSet(vx, vy), x.shape[1], int(max(y.max(), vy.max() if len(vy) else 0)) + 1, x.shape[-1])


def _torchvision(spec: DatasetSpec, seed: int) -> Splits:
    from torchvision import datasets

    cls, folder, files = {
        "mnist": (datasets.MNIST, "MNIST/raw", "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-*"),
        "fashion_mnist": (datasets.FashionMNIST, "FashionMNIST/raw", "train-images-idx3-ubyte.gz, ... t10k-*"),
        "cifar10": (datasets.CIFAR10, "", "cifar-10-python.tar.gz"),
    }[spec.name]
    root = spec.root or os.path.join(os.path.expanduser("~"), ".cache", "elastic-train", "data")
    try:
        train = cls(root, train=True, download=spec.download)
        test = cls(root, train=False, download=spec.download)
    except Exception as e:  # torchvision raises RuntimeError, URLError or OSError here
        where = os.path.join(root, folder)
        how = f"could not be downloaded ({type(e).__name__})" if spec.download else "download is off"
        raise DatasetUnavailable(f"dataset {spec.name!r} is not in {where} and {how}: put {files} in {where}") from e
    return _tensor_splits(torch.as_tensor(train.data), torch.as_tensor(train.targets),
                          torch.as_tensor(test.data), torch.as_tensor(test.targets), spec, seed)


def _image_folder(spec: DatasetSpec, seed: int) -> Splits:
    from torchvision import datasets, transforms

    if not os.path.isdir(spec.root):
        raise DatasetUnavailable(f"image_folder: {spec.root} is not a directory; put one sub-folder per class there")
    tf = transforms.Compose([transforms.Resize((spec.image_size, spec.image_size)), transforms.ToTensor()])
    folder = datasets.ImageFolder(spec.root, transform=tf)
    train_idx, val_idx = _split(len(folder), spec.val_fraction, seed)
    channels = folder[0][0].shape[0]
    return Splits(FolderSet(folder, train_idx), FolderSet(folder, val_idx), channels, len(folder.classes), spec.image_size)


def _synthetic(spec: DatasetSpec, seed: int, notice: str | None = None) -> Splits:
    images, labels = synthetic(
        size=spec.size, num_classes=spec.num_classes, channels=spec.channels,
        image_size=spec.image_size, noise=spec.noise, seed=seed,
    )
    splits = _tensor_splits(images, labels, None, None, spec, seed)
    splits.num_classes = spec.num_classes
    splits.notice = notice
    return splits


def _tokens(spec: DatasetSpec, seed: int, context: int) -> Splits:
    """Held-out samples are the tail of the corpus, not a random draw: neighbouring
    windows of one file share so much text that a random split would leak."""
    if spec.name == "synthetic_tokens":
        samples, vocab = text.synthetic_tokens(size=spec.size, vocab_size=spec.vocab_size, context=context,
                                               seed=seed), spec.vocab_size
    else:
        samples = text.windows(text.encode(text.python_source(spec.root, spec.max_chars)), context)
        vocab = text.VOCAB_SIZE
    n_val = int(round(len(samples) * spec.val_fraction))
    train, val = samples[: len(samples) - n_val], samples[len(samples) - n_val :]
    return Splits(ImageSet(train[:, :-1], train[:, 1:]), ImageSet(val[:, :-1], val[:, 1:]), 1, vocab, context)


def load(spec: DatasetSpec, seed: int, context: int = 64) -> Splits:
    """`context`: tokens per sample, for the token sets."""
    notice = check_available(spec)
    if notice and spec.name in TEXT_DATASETS:
        splits = _tokens(spec.model_copy(update={"name": "synthetic_tokens"}), seed, context)
        splits.notice = notice.replace("the synthetic dataset", "synthetic tokens")
        return splits
    if notice:
        return _synthetic(spec, seed, notice)
    return LOADERS[spec.name](spec, seed, context)


LOADERS = {
    "synthetic": lambda spec, seed, context: _synthetic(spec, seed),
    "idx": lambda spec, seed, context: _tensor_splits(read_idx(spec.images), read_idx(spec.labels), None, None,
                                                      spec, seed),
    "image_folder": lambda spec, seed, context: _image_folder(spec, seed),
    **{name: lambda spec, seed, context: _torchvision(spec, seed) for name in ("mnist", "fashion_mnist", "cifar10")},
    **{name: _tokens for name in TEXT_DATASETS},
}
