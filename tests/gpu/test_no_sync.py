"""MTP's one-token mode on CUDA, with torch's attention and FlashInfer's: no device stage of a
decode step synchronises with the host.

Run on an accelerator with tests/gpu/check.sh; skipped on a CPU. While a decode step's draft,
verify, sample or refill runs, torch's sync debug mode turns any synchronising call into an
error (the step then fails its requests). The mode is process-wide, so the host's download of
a step's tokens (a synchronising copy by design) waits until no guarded stage runs.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

from core.params import SamplingParams
from core.step import Outcome
from engine.executor import Executor
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, staggered
from tests.tiny import random_mtp_head, write_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="torch's sync debug mode is CUDA's"),
]

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture
def sync_is_an_error(monkeypatch):
    """A decode step's device stages raise on any host sync; the download (which must sync)
    never overlaps one of them."""
    lock = threading.Lock()
    stage, of = Executor._stage, Outcome.of.__func__

    @contextlib.contextmanager
    def guarded_stage(self, plan, time, name, *args):
        if plan.kind != "decode" or name not in ("draft", "verify", "sample", "refill"):
            with stage(self, plan, time, name, *args) as fields:
                yield fields
            return
        with lock:
            torch.cuda.set_sync_debug_mode("error")
            try:
                with stage(self, plan, time, name, *args) as fields:
                    yield fields
            finally:
                torch.cuda.set_sync_debug_mode("default")

    def guarded_download(cls, verdict):
        with lock:
            return of(cls, verdict)

    monkeypatch.setattr(Executor, "_stage", guarded_stage)
    monkeypatch.setattr(Outcome, "of", classmethod(guarded_download))


@pytest.mark.parametrize(
    "attention, graphs", [("torch", "off"), ("torch", "on"), ("flashinfer", "off")]
)
async def test_one_token_mode_never_syncs_on_cuda(tmp_path, sync_is_an_error, attention, graphs):
    """With graphs too: a bucket's first forward is captured inside the step, unsynchronised."""
    if attention == "flashinfer":
        pytest.importorskip("flashinfer")
    target_dir = write_model(tmp_path / "t", hidden=128, head_dim=64, seed=0)
    save_mtp_head(random_mtp_head(load_model(target_dir), seed=7), tmp_path / "h")
    prompts = ragged_prompts(8, 300, seed=11)
    on_cuda = {"device": "cuda", "attention": attention, "cuda_graphs": graphs}
    plain_config = make_config(target_dir, **on_cuda)
    async with running(plain_config) as engine:
        expected = await staggered(engine, prompts, GREEDY)
    config = make_config(target_dir, "mtp", tmp_path / "h", k=1, **on_cuda)
    async with running(config) as engine:
        outs = await staggered(engine, prompts, GREEDY, seed=5)
    assert outs == expected  # a sync would have failed its step's requests
