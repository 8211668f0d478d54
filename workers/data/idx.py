"""IDX files, the format MNIST ships in.

Parsed here because torchvision's reader opens files uncompressed only and asserts
on bad input; users hand us .gz files straight from the MNIST site.
"""

from __future__ import annotations

import gzip

import numpy as np
import torch

_DTYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> torch.Tensor:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rb") as f:
            data = f.read()
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise
        raise ValueError(f"{path} cannot be read ({e}); is it truncated?") from e
    if len(data) < 4 or data[0] != 0 or data[1] != 0 or data[2] not in _DTYPES:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    ndim = data[3]
    dtype = np.dtype(_DTYPES[data[2]])
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError(f"{path}: the header is cut short (truncated?)")
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = int(np.prod(dims)) * dtype.itemsize
    if len(data) - header != expected:
        raise ValueError(f"{path}: header says {dims} ({expected} bytes) but holds {len(data) - header} (truncated?)")
    array = np.frombuffer(data, dtype=dtype, offset=header)
    return torch.from_numpy(array.reshape(dims).astype(array.dtype.newbyteorder("="), copy=True))
