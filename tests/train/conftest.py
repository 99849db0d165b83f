"""Fixtures for end-to-end runs: a small synthetic corpus, made once per session."""

import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
QUICKSTART = os.path.join(REPO, "jobs", "configs", "quickstart.yaml")


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """0.15 h of training speech (4 shards) and 0.03 h of held-out speech."""
    from mpitrain.data.synthetic import synthesize
    out = tmp_path_factory.mktemp("corpus")
    synthesize(str(out), hours=0.15, speakers=20, shards=4, seed=7, dev_hours=0.03,
               dev_speakers=4)
    return str(out)


def small_overrides(corpus, **extra):
    """--set values that point the quickstart config at the small corpus."""
    values = {"data.train": os.path.join(corpus, "train"), "data.dev": os.path.join(corpus, "dev"),
              "data.chunk_frames": 20000, "training.log_interval": 50}
    values.update(extra)
    return [f"{k}={v}" for k, v in values.items()]
