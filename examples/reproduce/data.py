"""Byte-level text data that needs no download.

By default the corpus is the source of the Python standard library of the
running interpreter (``sysconfig.get_paths()["stdlib"]``, ``*.py`` files,
``site-packages``/``dist-packages`` excluded). Files are put in a
deterministic order (sorted by the CRC32 of their relative path, then by path,
so a byte cap still draws from every corner of the library rather than from
the first directories alphabetically) and read until ``max_bytes``. Every
``heldout_every``-th file of that order goes to the held-out split: the split
is by file, so held-out text comes from modules never seen in training.

Tokens are bytes (vocabulary 256); files are joined with a NUL byte.
Training batches are random windows of ``seq_len + 1`` bytes of the training
stream; the held-out set is a fixed set of evenly spaced windows.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import sysconfig
import zlib
from pathlib import Path

import numpy as np

__all__ = ["Corpus", "default_files", "load_corpus"]

VOCAB = 256
SEPARATOR = b"\x00"


def default_files() -> tuple[Path, list[Path]]:
    """The standard library's ``*.py`` files: ``(root, files)`` in deterministic order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip)
        files.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return root, _order(root, files)


def _order(root: Path | None, files: list[Path]) -> list[Path]:
    def key(p):
        rel = str(p.relative_to(root)) if root is not None else str(p)
        return (zlib.crc32(rel.encode()), rel)

    return sorted(files, key=key)


@dataclasses.dataclass
class Corpus:
    """Training and held-out byte streams (``uint8`` arrays) and where they came from."""

    train: np.ndarray
    heldout: np.ndarray
    source: str
    n_train_files: int
    n_heldout_files: int

    def info(self) -> dict:
        return {
            "source": self.source,
            "train_bytes": int(self.train.size),
            "heldout_bytes": int(self.heldout.size),
            "train_files": self.n_train_files,
            "heldout_files": self.n_heldout_files,
        }

    def batches(self, rng: np.random.Generator, batch_size: int, seq_len: int):
        """Endless random training windows ``{"ids": int32[B, seq_len + 1]}``."""
        n = self.train.size - seq_len - 1
        offsets = np.arange(seq_len + 1)
        while True:
            start = rng.integers(0, n, size=batch_size)
            yield {"ids": self.train[start[:, None] + offsets].astype(np.int32)}

    def heldout_windows(self, n_windows: int, seq_len: int) -> dict:
        """``n_windows`` evenly spaced held-out windows (deterministic)."""
        n = self.heldout.size - seq_len - 1
        start = np.linspace(0, n, n_windows).astype(np.int64)
        offsets = np.arange(seq_len + 1)
        return {"ids": self.heldout[start[:, None] + offsets].astype(np.int32)}


def load_corpus(files=None, max_bytes: int = 2_000_000, heldout_every: int = 10) -> Corpus:
    """Reads ``files`` (default: the standard library) into a train / held-out split by file.

    Args:
      files: paths of text files; ``None`` or empty: the standard library. Given
        files are read in the order given; with fewer than ``heldout_every``
        files, the last one is held out.
      max_bytes: stop reading once this many bytes were read (the last file
        is truncated).
      heldout_every: every ``heldout_every``-th file (in reading order, starting
        with the ``heldout_every``-th) is held out.
    """
    if files:
        paths = [Path(f) for f in files]
        source = f"{len(paths)} file(s) from the command line"
    else:
        root, paths = default_files()
        major, minor = sys.version_info[:2]
        source = f"the Python standard library, version {major}.{minor} (*.py)"
    if not paths:
        raise ValueError("load_corpus: no input files.")
    heldout_idx = set(range(heldout_every - 1, len(paths), heldout_every))
    if not heldout_idx:
        heldout_idx = {len(paths) - 1}
    train, heldout, total = [], [], 0
    n_train = n_heldout = 0
    for i, path in enumerate(paths):
        if total >= max_bytes:
            break
        data = path.read_bytes()[: max_bytes - total]
        total += len(data)
        if i in heldout_idx:
            heldout.append(data)
            n_heldout += 1
        else:
            train.append(data)
            n_train += 1
    if len(paths) == 1 or not heldout:  # one file, or the cap hit before a held-out file
        text = b"".join(train + heldout)
        cut = int(len(text) * 0.9)
        train, heldout = [text[:cut]], [text[cut:]]
        n_heldout = max(n_heldout, 1)
    train_arr = np.frombuffer(SEPARATOR.join(train), np.uint8)
    heldout_arr = np.frombuffer(SEPARATOR.join(heldout), np.uint8)
    return Corpus(train_arr, heldout_arr, source, n_train, n_heldout)
