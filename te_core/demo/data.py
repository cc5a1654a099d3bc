"""Training text that needs no download: the Python standard library's own source files.

Byte-level tokens (vocabulary 256), files in sorted order, so a run is reproducible on any
machine with the same Python; batches are drawn with a seeded generator.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import List, Tuple

import torch

VOCAB_SIZE = 256


def stdlib_dir() -> str:
    """Directory of the running interpreter's standard library (where os.py lives)."""
    path = sysconfig.get_paths().get("stdlib")
    if path and os.path.isfile(os.path.join(path, "os.py")):
        return path
    return os.path.dirname(os.path.abspath(os.__file__))


def stdlib_sources(root: str) -> List[str]:
    """The .py files directly in the stdlib and its packages, skipping tests and site-packages."""
    skip = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        found.extend(os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py"))
    return found


def load_corpus(max_bytes: int) -> Tuple[torch.Tensor, int]:
    """The first max_bytes bytes of the concatenated sources as uint8 tokens, and the file count."""
    chunks, total, files = [], 0, 0
    for path in stdlib_sources(stdlib_dir()):
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        files += 1
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    if len(blob) < 4096:
        raise RuntimeError(f"found only {len(blob)} bytes of Python source under {stdlib_dir()}; the demo needs more")
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8).clone(), files


@dataclass
class BatchSampler:
    """Random (batch, seq_len + 1) windows of a token stream, reproducible from `seed`."""

    tokens: torch.Tensor
    batch_size: int
    seq_len: int
    seed: int

    def __post_init__(self):
        if self.tokens.numel() <= self.seq_len + 1:
            raise ValueError(f"corpus of {self.tokens.numel()} tokens is shorter than seq_len + 1 = {self.seq_len + 1}")
        self.generator = torch.Generator().manual_seed(self.seed)

    def next(self, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each (batch, seq_len) int64 on `device`; targets are inputs shifted by one."""
        high = self.tokens.numel() - self.seq_len - 1
        starts = torch.randint(0, high, (self.batch_size,), generator=self.generator)
        offsets = torch.arange(self.seq_len + 1)
        windows = self.tokens[starts[:, None] + offsets[None, :]].long()
        return windows[:, :-1].to(device), windows[:, 1:].to(device)


def split(tokens: torch.Tensor, val_fraction: float = 0.05) -> Tuple[torch.Tensor, torch.Tensor]:
    """(train, validation): the last val_fraction of the stream is held out."""
    cut = int(tokens.numel() * (1.0 - val_fraction))
    return tokens[:cut], tokens[cut:]
