"""The training text: the running interpreter's own standard library, read as bytes (vocabulary 256).

Every machine that runs Python has it, so the example downloads nothing. Third-party packages installed into the
stdlib folder (site-packages, dist-packages) are left out: they differ between machines.

Determinism: the file list is sorted, the train/val split is decided per file by a CRC32 of its relative path
(no text of one file lands in both splits), and each batch is drawn by a generator seeded from (seed, step), so a
resumed run reads exactly the batches the uninterrupted run would have read, without saving any data-loader state.
"""

from __future__ import annotations

import hashlib
import sys
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_SEPARATOR = b"\x00"  # between files; never occurs in source text, so the model can learn it as "new file"


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 (N,)
    val: torch.Tensor  # uint8 (M,)
    info: dict

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator,
              device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) int64 (batch_size, seq_len): random windows, targets shifted by one byte."""
        data = self.train if split == "train" else self.val
        if data.numel() < seq_len + 2:
            raise ValueError(f"the {split} split holds {data.numel()} bytes, fewer than seq_len + 2 = {seq_len + 2}")
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        windows = torch.stack([data[s:s + seq_len + 1] for s in starts.tolist()]).to(torch.int64)
        return windows[:, :-1].to(device), windows[:, 1:].to(device)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def load_corpus(val_percent: float = 5.0, root: Path | None = None, max_bytes: int | None = None) -> Corpus:
    """Read every *.py file of the standard library; about val_percent of the files (by path hash) form val.

    max_bytes caps each split's size (files are taken in sorted order), for quick tests.
    """
    if not 0 < val_percent < 100:
        raise ValueError(f"val_percent must be in (0, 100), got {val_percent}")
    root = stdlib_root() if root is None else Path(root)
    files = sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS & set(p.relative_to(root).parts[:-1]))
    if not files:
        raise FileNotFoundError(f"no *.py files under {root}")
    parts: dict[str, list[bytes]] = {"train": [], "val": []}
    sizes = {"train": 0, "val": 0}
    digest = hashlib.sha256()
    threshold = int(val_percent * 100)  # buckets of 0.01 %
    for path in files:
        rel = path.relative_to(root).as_posix()
        split = "val" if zlib.crc32(rel.encode()) % 10000 < threshold else "train"
        if max_bytes is not None and sizes[split] >= max_bytes:
            continue
        text = path.read_bytes()
        parts[split].append(text)
        sizes[split] += len(text) + 1
        digest.update(rel.encode() + b"\n" + text)
    tensors = {k: torch.frombuffer(bytearray(_SEPARATOR.join(v)), dtype=torch.uint8) for k, v in parts.items()}
    info = {
        "source": "stdlib *.py of the running interpreter",
        "root": str(root),
        "python": sys.version.split()[0],
        "files": {k: len(v) for k, v in parts.items()},
        "bytes": {k: int(t.numel()) for k, t in tensors.items()},
        "sha256": digest.hexdigest()[:16],
        "val_percent": val_percent,
    }
    return Corpus(tensors["train"], tensors["val"], info)
