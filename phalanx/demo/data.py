"""Character-level data for the demo: the text shipped with the package, cut into fixed-length windows."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

import phalanx

CORPUS_PATH = Path(__file__).parent / "data" / "tiny_corpus.txt"


def load_corpus(path: str | Path | None = None) -> str:
    """The demo corpus (or the text file at ``path``)."""
    return Path(path or CORPUS_PATH).read_text(encoding="utf-8")


class CharWindows(Dataset):
    """Map-style dataset of windows ``(x, y)``, ``y`` being ``x`` shifted by one character.

    Window ``i`` starts at ``i * stride``; with ``stride=1`` every position is a start, so a shuffled
    sampler draws random windows.
    """

    def __init__(self, data: Tensor, block_size: int, stride: int = 1) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"need more than {block_size} tokens, got {data.numel()}")
        self.data = data
        self.block_size = block_size
        self.stride = stride
        self._len = (data.numel() - block_size - 1) // stride + 1

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        if not -self._len <= index < self._len:
            raise IndexError(index)
        start = (index % self._len) * self.stride
        chunk = self.data[start : start + self.block_size + 1]
        return chunk[:-1], chunk[1:]


class CharDataModule(phalanx.DataModule):
    """Reads the corpus, builds the character vocabulary and splits the text 90/10 into train/val.

    The vocabulary is built in ``__init__`` so that ``vocab_size`` is known before the model is made.
    Training windows start at every position and are shuffled; validation windows are fixed and
    non-overlapping, so every validation measures the same text.
    """

    def __init__(
        self,
        block_size: int = 64,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        text: str | None = None,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.block_size = block_size
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_workers = num_workers
        self.text = load_corpus() if text is None else text
        self.chars = sorted(set(self.text))
        self.stoi = {ch: i for i, ch in enumerate(self.chars)}
        self.itos = dict(enumerate(self.chars))
        self.train_data: Tensor | None = None
        self.val_data: Tensor | None = None
        self.train_dataset: CharWindows | None = None
        self.val_dataset: CharWindows | None = None

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        """Character ids of ``text``; raises KeyError on a character outside the vocabulary."""
        return [self.stoi[ch] for ch in text]

    def decode(self, ids: Iterable[int] | Tensor) -> str:
        if isinstance(ids, Tensor):
            ids = ids.reshape(-1).tolist()
        return "".join(self.itos[int(i)] for i in ids)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        data = torch.tensor(self.encode(self.text), dtype=torch.long)
        n_train = int(len(data) * (1.0 - self.val_fraction))
        self.train_data, self.val_data = data[:n_train], data[n_train:]
        self.train_dataset = CharWindows(self.train_data, self.block_size, stride=1)
        self.val_dataset = CharWindows(self.val_data, self.block_size, stride=self.block_size)

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        return DataLoader(
            self.train_dataset,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=True,
            num_workers=self.num_workers,
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return DataLoader(self.val_dataset, batch_size=self.batch_size, shuffle=False, num_workers=self.num_workers)
