"""The real datasets load offline, and a missing one says what to install."""

import gzip
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from lockstep.demo import data


def test_mnist_is_the_real_5k_digits_split_4000_1000():
    train, test = data.mnist()
    assert len(train) == 4000 and len(test) == 1000
    images = torch.cat([train.tensors[0], test.tensors[0]])
    labels = torch.cat([train.tensors[1], test.tensors[1]])
    assert images.shape == (5000, 1, 28, 28) and 0.0 <= images.min() < images.max() <= 1.0
    assert torch.bincount(labels).tolist() == [500] * 10
    assert (images.flatten(1) > 0).float().mean() < 0.3  # handwriting: mostly background


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I",
                                                                    *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reads_idx_files_from_a_folder(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 6), ("t10k", 4)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (n, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", rng.integers(0, 10, n))
    train, test = data.fashion_mnist(tmp_path)
    assert len(train) == 6 and len(test) == 4
    assert train[0][0].shape == (1, 28, 28)


def test_truncated_idx_file_is_an_error(tmp_path):
    path = tmp_path / "x-idx1-ubyte.gz"
    write_idx(path, np.arange(10))
    with gzip.open(path, "rb") as f:
        raw = f.read()
    with gzip.open(path, "wb") as f:
        f.write(raw[:-3])
    with pytest.raises(ValueError, match="truncated"):
        data.read_idx(path)


def test_missing_fashion_mnist_says_what_to_install(tmp_path):
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist(tmp_path)


def test_kjv_text_and_character_windows():
    text = data.kjv_text()
    assert text.startswith("In the beginning God created")
    assert 4_000_000 < len(text) < 4_500_000
    train, test = data.kjv_chars(block_size=32)
    x, y = train[5]
    assert x.shape == y.shape == (32,) and torch.equal(x[1:], y[:-1])
    assert "".join(train.vocab[i] for i in train[0][0].tolist()) == text[:32]
    assert len(test) > 0 and test.vocab == train.vocab
