"""Local text corpora through Hugging Face ``datasets`` (no hub access), byte-level tokens.

The package ships a small generated corpus (``demo/corpus.txt``) so the demo and recipes run on any
machine; pass ``files=`` to train on your own text files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from torch.utils.data import DataLoader, Dataset

DEFAULT_CORPUS = Path(__file__).parent / "corpus.txt"


class TokenWindows(Dataset):
    """Fixed-length ``[seq_len + 1]`` windows over one long stream of byte tokens."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len
        self.n = (len(tokens) - 1) // seq_len

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        start = i * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]


def load_byte_tokens(files: list[str | Path]) -> torch.Tensor:
    """Read text files with ``datasets`` (local 'text' builder) and encode them as UTF-8 bytes."""
    from datasets import load_dataset

    missing = [str(f) for f in files if not Path(f).is_file()]
    if missing:
        raise ValueError(f"corpus files {missing}: not found. HINT: pass existing local text files; the hub is "
                         "not used.")
    ds = load_dataset("text", data_files=[str(f) for f in files], split="train")
    text = "\n".join(ds["text"])
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class ByteCorpus(L.LightningDataModule):
    """Train/val split of a local corpus; vocabulary 256 (bytes)."""

    def __init__(self, files: list[str] | None = None, seq_len: int = 64, batch_size: int = 8,
                 val_fraction: float = 0.05, num_workers: int = 0) -> None:
        super().__init__()
        self.files = files or [str(DEFAULT_CORPUS)]
        self.seq_len, self.batch_size = seq_len, batch_size
        self.val_fraction, self.num_workers = val_fraction, num_workers
        self.train: Dataset | None = None
        self.val: Dataset | None = None

    def setup(self, stage: str | None = None) -> None:
        tokens = load_byte_tokens(self.files)
        cut = int(len(tokens) * (1 - self.val_fraction))
        self.train = TokenWindows(tokens[:cut], self.seq_len)
        self.val = TokenWindows(tokens[cut:], self.seq_len)

    def _loader(self, ds: Dataset | None, shuffle: bool) -> DataLoader:
        assert ds is not None, "call setup() first"
        return DataLoader(ds, batch_size=self.batch_size, shuffle=shuffle, num_workers=self.num_workers,
                          drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train, True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val, False)

    def state_dict(self) -> dict[str, Any]:
        return {"files": self.files, "seq_len": self.seq_len}
