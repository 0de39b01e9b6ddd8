"""What the GPU check's engine tests share: a tiny target of FlashInfer's head size (64) with
every drafter's model, and prompts that repeat themselves (suffix decoding finds matches)."""

from __future__ import annotations

import pytest

from tests.engine_util import ragged_prompts, write_drafters
from tests.tiny import write_model


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    target = write_model(tmp_path_factory.mktemp("target"), hidden=128, head_dim=64, seed=0)
    return write_drafters(target, tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="session")
def prompts():
    return [p + p[:6] for p in ragged_prompts(4, 300, seed=5)]
