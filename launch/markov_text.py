"""An endless byte stream that reads like a corpus but never repeats: an order-k Markov chain fitted to it.

Training on a small corpus for longer than an epoch measures memorisation: losses fall towards 0.2
nats/byte, where a 2% gap is a few thousandths of a nat. Samples of the corpus's k-gram statistics are
new text at every step, so the loss settles near the chain's entropy rate instead and compares
models on what they learn. The corpus is read as a ring, so every k-byte context has a successor.

    source = MarkovText(corpus_bytes, order=3)
    windows = source.sample(count=8, length=2049, seed=0)   # int64 [8, 2049], the same for the same seed
"""
from __future__ import annotations

import numpy as np
import torch

BYTE_VOCAB = 256


class MarkovText:
    """Next-byte distributions of every k-byte context of a corpus, and sampling from them."""

    def __init__(self, corpus: bytes, order: int = 3):
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        data = np.frombuffer(corpus, dtype=np.uint8)
        if data.size <= order:
            raise ValueError(f"the corpus has {data.size} bytes; an order-{order} chain needs more than {order}")
        self.order = order
        ring = np.concatenate([data, data[:order]]).astype(np.int64)
        contexts = self._keys(np.stack([ring[i:i + data.size] for i in range(order)], axis=1))
        successors = ring[order:order + data.size]
        self._context_keys, context_index = np.unique(contexts, return_inverse=True)
        counts = np.zeros((self._context_keys.size, BYTE_VOCAB), dtype=np.float64)
        np.add.at(counts, (context_index, successors), 1.0)
        self._cdf = np.cumsum(counts / counts.sum(axis=1, keepdims=True), axis=1)
        self._cdf[:, -1] = 1.0  # no draw in [0, 1) falls past the last byte
        self._corpus = data

    @staticmethod
    def _keys(contexts: np.ndarray) -> np.ndarray:
        """Integer key of each row of k context bytes."""
        keys = np.zeros(contexts.shape[0], dtype=np.int64)
        for column in range(contexts.shape[1]):
            keys = keys * BYTE_VOCAB + contexts[:, column]
        return keys

    def entropy_rate(self) -> float:
        """The chain's entropy in nats per byte, weighting each context by its corpus frequency."""
        probabilities = np.diff(self._cdf, axis=1, prepend=0.0)
        weights = np.zeros(self._context_keys.size)
        ring = np.concatenate([self._corpus, self._corpus[:self.order]]).astype(np.int64)
        keys = self._keys(np.stack([ring[i:i + self._corpus.size] for i in range(self.order)], axis=1))
        np.add.at(weights, np.searchsorted(self._context_keys, keys), 1.0)
        with np.errstate(divide="ignore", invalid="ignore"):
            per_context = -np.nansum(np.where(probabilities > 0, probabilities * np.log(probabilities), 0.0), axis=1)
        return float((weights * per_context).sum() / weights.sum())

    def sample(self, count: int, length: int, seed: int) -> torch.Tensor:
        """`count` independent byte sequences of `length` as int64 [count, length]; deterministic in seed."""
        if count < 1 or length <= self.order:
            raise ValueError(f"need count >= 1 and length > order {self.order}, got count={count}, length={length}")
        rng = np.random.default_rng(seed)
        out = np.empty((count, length), dtype=np.int64)
        start = rng.integers(0, self._corpus.size - self.order + 1, size=count)
        for i in range(self.order):
            out[:, i] = self._corpus[start + i]
        for position in range(self.order, length):
            context = np.searchsorted(self._context_keys, self._keys(out[:, position - self.order:position]))
            draws = rng.random(count)
            out[:, position] = (self._cdf[context] <= draws[:, None]).sum(axis=1)
        return torch.from_numpy(out)
