"""The Markov text source of the GPU convergence tests: deterministic, corpus-like, never a copy of the corpus."""
import pathlib

import numpy as np
import pytest
import torch

from nvfp4_dist.launch.markov_text import MarkovText

CORPUS = (pathlib.Path(__file__).resolve().parents[1] / "launch" / "data" / "fables.txt").read_bytes()


@pytest.fixture(scope="module")
def source():
    return MarkovText(CORPUS, order=3)


def test_same_seed_same_text_other_seed_other_text(source):
    a, b, c = source.sample(4, 300, seed=7), source.sample(4, 300, seed=7), source.sample(4, 300, seed=8)
    assert a.dtype == torch.int64 and a.shape == (4, 300)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_every_transition_is_one_of_the_corpus(source):
    """Each (k context bytes, next byte) of a sample occurs in the corpus, read as a ring."""
    ring = CORPUS + CORPUS[:3]
    seen = {ring[i:i + 4] for i in range(len(CORPUS))}
    sample = source.sample(2, 2000, seed=1)
    for row in sample.tolist():
        text = bytes(row)
        assert all(text[i:i + 4] in seen for i in range(len(text) - 3))


def test_samples_are_not_windows_of_the_corpus(source):
    """Long stretches are new text: no 64-byte window of a sample occurs verbatim in the corpus."""
    text = bytes(source.sample(1, 4000, seed=2)[0].tolist())
    copied = sum(text[i:i + 64] in CORPUS for i in range(0, len(text) - 64, 64))
    assert copied <= 2, copied


def test_empirical_entropy_matches_entropy_rate(source):
    """The sample's per-byte log loss under the chain itself estimates the entropy rate."""
    counts = {}
    ring = CORPUS + CORPUS[:3]
    for i in range(len(CORPUS)):
        context, successor = ring[i:i + 3], ring[i + 3]
        counts.setdefault(context, np.zeros(256))[successor] += 1
    text = bytes(source.sample(64, 1000, seed=3).flatten().tolist())
    rows = [text[r * 1000:(r + 1) * 1000] for r in range(64)]
    logs = [np.log(counts[row[i - 3:i]][row[i]] / counts[row[i - 3:i]].sum()) for row in rows for i in range(3, 1000)]
    assert -np.mean(logs) == pytest.approx(source.entropy_rate(), rel=0.05)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="order"):
        MarkovText(CORPUS, order=0)
    with pytest.raises(ValueError, match="bytes"):
        MarkovText(b"ab", order=3)
    with pytest.raises(ValueError, match="length"):
        MarkovText(CORPUS, order=3).sample(2, 3, seed=0)
