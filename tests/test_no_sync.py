"""A step's device work never waits on the host for other device work: the compute thread
reads an event's value (ordered on the device by the stream), never its result, which on
CUDA synchronises the host with the device (cudaEventSynchronize)."""

from __future__ import annotations

import threading

import pytest
import torch

from core.params import SamplingParams
from engine.device import Event, cpu_thread
from models.eagle import save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, running
from tests.tiny import random_eagle_head, random_mtp_head


@pytest.fixture
def results_on_the_compute_thread(monkeypatch):
    """Calls of Event.result from the compute thread, which the step must not make."""
    calls = []
    result = Event.result

    def counted(self):
        if threading.current_thread() is cpu_thread().thread:
            calls.append(self)
        return result(self)

    monkeypatch.setattr(Event, "result", counted)
    return calls


@pytest.mark.parametrize("method, k", [("none", 3), ("draft", 3), ("mtp", 1), ("eagle", 3)])
async def test_a_step_never_synchronises_the_compute_thread(
    tiny_target, tmp_path, results_on_the_compute_thread, method, k
):
    model = load_model(tiny_target)
    heads = {"eagle": random_eagle_head(model, norms=True), "mtp": random_mtp_head(model)}
    draft = tiny_target if method == "draft" else None
    if method in heads:
        draft = tmp_path / method
        (save_eagle_head if method == "eagle" else save_mtp_head)(heads[method], draft)
    async with running(make_config(tiny_target, method, draft, k=k)) as engine:
        deltas = await engine.generate([5, 6, 7], SamplingParams(max_tokens=8, temperature=0))
    assert sum(len(d.token_ids) for d in deltas) == 8
    assert results_on_the_compute_thread == []


async def test_sampling_tensors_are_built_on_the_host_and_copied_by_the_stream(
    tiny_target, monkeypatch
):
    """The event loop builds a batch's sampling tensors in host memory (pinned for a GPU);
    the step's stream copies them (unpack), so the loop never waits for a device copy."""
    from core.params import SamplingTensors

    built = []
    build = SamplingTensors.build.__func__

    def recording(cls, params, seeds, device, vocab_size=None, pin=False):
        built.append((str(device), pin))
        return build(cls, params, seeds, device, vocab_size)  # no CUDA here to pin for

    monkeypatch.setattr(SamplingTensors, "build", classmethod(recording))
    async with running(make_config(tiny_target)) as engine:
        engine.planner.device = torch.device("cuda")  # as a GPU engine plans
        engine.planner.sampling_tensors([])
        assert built[-1] == ("cpu", True)
        engine.planner.device = torch.device("cpu")
        deltas = await engine.generate([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
    assert built[-1] == ("cpu", False) and sum(len(d.token_ids) for d in deltas) == 4
