"""The training data of ``python -m fla train``: the corpus shipped in the package, a
byte-level tokenizer, and a resumable, rank-sharded sampler of fixed-length windows.

Nothing is downloaded: the default corpus is ``fla/cli/data/shakespeare.txt.gz`` (see the
README next to it); ``--corpus FILE`` trains on any other text file (``.gz`` or plain).
"""
from __future__ import annotations

import gzip
import math
from dataclasses import dataclass
from pathlib import Path

import torch

DATA_DIR = Path(__file__).resolve().parent / "data"
DEFAULT_CORPUS = DATA_DIR / "shakespeare.txt.gz"


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; then BOS, EOS and PAD. ``model_vocab_size`` rounds
    the vocabulary up to a multiple of 8 for the embedding and head (ids past PAD are
    never produced by the data; generation never emits them either)."""

    bos_token_id = 256
    eos_token_id = 257
    pad_token_id = 258
    vocab_size = 259
    model_vocab_size = 264

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_dict(self) -> dict:
        return {"type": "bytes", "vocab_size": self.vocab_size,
                "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
                "pad_token_id": self.pad_token_id}


class IncrementalDecoder:
    """Turns a stream of byte tokens into text, holding back an incomplete UTF-8 sequence
    until its last byte arrives (for streaming generation)."""

    def __init__(self):
        import codecs
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token: int) -> str:
        return self._dec.decode(bytes([token])) if 0 <= token < 256 else ""

    def flush(self) -> str:
        return self._dec.decode(b"", final=True)


class CorpusError(ValueError):
    """The corpus file is missing, unreadable or too short."""


def read_corpus(path: str | Path | None = None) -> torch.Tensor:
    """The corpus as a uint8 tensor of bytes."""
    path = Path(path) if path is not None else DEFAULT_CORPUS
    if not path.is_file():
        raise CorpusError(f"corpus file {str(path)!r} not found")
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise CorpusError(f"cannot read corpus {str(path)!r}: {exc}") from None
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


@dataclass
class Splits:
    train: torch.Tensor   # uint8 bytes
    val: torch.Tensor

    def unigram_bits_per_byte(self) -> float:
        """Cross-entropy of the validation bytes under the training bytes' frequencies
        (add-one smoothed): the loss of a model that ignores context."""
        counts = torch.bincount(self.train.long(), minlength=256).double() + 1.0
        logp = (counts / counts.sum()).log2()
        val_counts = torch.bincount(self.val.long(), minlength=256).double()
        return float(-(val_counts * logp).sum() / val_counts.sum())


def split(data: torch.Tensor, val_fraction: float, seq_len: int) -> Splits:
    """The last ``val_fraction`` of the bytes are the validation split."""
    n_val = max(int(len(data) * val_fraction), seq_len + 1)
    if len(data) - n_val < 2 * seq_len:
        raise CorpusError(f"the corpus has {len(data)} bytes: too short for windows of "
                          f"{seq_len} tokens with a validation split of {n_val} bytes")
    return Splits(train=data[:-n_val], val=data[-n_val:])


class WindowSampler:
    """Batches of ``seq_len``-token windows of the training bytes, sharded over ranks.

    Each epoch cuts the training bytes into non-overlapping windows starting at a random
    shift and visits them in a random order (both drawn from ``seed`` and the epoch), as
    ``torch.utils.data.DistributedSampler`` does: global step ``s`` uses the window indices
    ``order[s·B : (s+1)·B]`` of the epoch's order, ``B`` the global batch, and rank ``r``
    takes every ``world``-th of them from ``r`` on. The union over ranks is therefore the
    single-process batch of the same global size, and a resumed run draws exactly the
    batches it would have drawn (the batch is a function of the step alone).
    """

    def __init__(self, data: torch.Tensor, seq_len: int, global_batch: int, seed: int,
                 rank: int = 0, world: int = 1):
        if global_batch % world:
            raise ValueError(f"--batch-size {global_batch} is not divisible by the "
                             f"{world} processes")
        self.data, self.seq_len, self.global_batch = data, seq_len, global_batch
        self.seed, self.rank, self.world = seed, rank, world
        self.windows = (len(data) - seq_len) // seq_len   # one window kept for the shift
        if self.windows < global_batch:
            raise ValueError(f"the training split holds {self.windows} windows of "
                             f"{seq_len} tokens, fewer than the batch of {global_batch}")
        self.steps_per_epoch = self.windows // global_batch
        self._epoch, self._shift, self._order = None, 0, None

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 100003 + epoch)
            self._shift = int(torch.randint(self.seq_len, (1,), generator=gen))
            self._order = torch.randperm(self.windows, generator=gen)
            self._epoch = epoch

    def epoch_of(self, step: int) -> float:
        return step / self.steps_per_epoch

    def batch(self, step: int) -> torch.Tensor:
        """This rank's ``[global_batch / world, seq_len]`` int64 tokens for ``step``."""
        epoch, within = divmod(step, self.steps_per_epoch)
        self._set_epoch(epoch)
        idx = self._order[within * self.global_batch:(within + 1) * self.global_batch]
        idx = idx[self.rank::self.world]
        starts = self._shift + idx * self.seq_len
        offsets = torch.arange(self.seq_len)
        return self.data[starts[:, None] + offsets].long()


def eval_batches(data: torch.Tensor, seq_len: int, global_batch: int, max_batches: int,
                 rank: int = 0, world: int = 1) -> list[torch.Tensor]:
    """Fixed validation batches (the same every evaluation): the first ``max_batches``
    global batches of consecutive windows of the split (0: all of it), window ``i`` on
    rank ``i % world``, so that every world size evaluates the same windows."""
    windows = (len(data) - 1) // seq_len
    if max_batches > 0:
        windows = min(windows, max_batches * global_batch)
    windows -= windows % world
    mine = torch.arange(rank, windows, world)
    per_rank = max(1, global_batch // world)
    out = []
    for i in range(0, len(mine), per_rank):
        idx = mine[i:i + per_rank]
        out.append(data[idx[:, None] * seq_len + torch.arange(seq_len)].long())
    return out


def bits_per_byte(nats_per_token: float) -> float:
    return nats_per_token / math.log(2)
