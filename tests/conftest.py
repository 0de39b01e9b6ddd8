import contextlib
import os
import tempfile
import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# what engines keep between starts (cost-model curves) stays inside the test run
os.environ["TANDEM_CACHE"] = tempfile.mkdtemp(prefix="tandem-cache-")


def pytest_collection_modifyitems(config, items):
    """gpu-marked tests run where CUDA is, and on the CPU in the GPU check's dry run
    (tests/gpu/check.sh --dry-run), where those with no CPU form skip themselves."""
    if torch.cuda.is_available() or os.environ.get("TANDEM_CHECK_DEVICE") == "cpu":
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# a run spread over workers (pytest -n 2, as scripts/test.sh does) gives each one core
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    torch.set_num_threads(THREADS)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tests.tiny import write_model

    return write_model(tmp_path_factory.mktemp("target"), seed=0)


@pytest.fixture(scope="session")
def tiny_quant_target(tiny_target, tmp_path_factory):
    """The tiny target as a GGUF file of mixed block types, served at those types."""
    from tests.tiny import QUANT_MIX, write_gguf

    return write_gguf(tiny_target, tmp_path_factory.mktemp("quant") / "target.gguf", QUANT_MIX)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    from tests.tiny import write_model

    return write_model(tmp_path_factory.mktemp("draft"), layers=1, hidden=32, seed=1)


@pytest.fixture(scope="session")
def ragged16():
    """16 ragged prompts over the tiny target's vocabulary (the greedy-equality tests')."""
    from tests.engine_util import ragged_prompts

    return ragged_prompts(16, 300, seed=11)


@pytest.fixture(scope="session")
def plain16(tiny_target, ragged16):
    """The tiny target's plain greedy output (24 tokens) for `ragged16`, staggered."""
    import asyncio

    from core.params import SamplingParams
    from tests.engine_util import make_config, running, staggered

    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)

    async def plain():
        async with running(make_config(tiny_target)) as engine:
            return await staggered(engine, ragged16, greedy)

    return asyncio.run(plain())


HOST_CONVERSIONS = (
    "item",
    "tolist",
    "cpu",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
)


@pytest.fixture
def forbid_host_sync(monkeypatch):
    """While a decode step's device stage runs on the compute stream, every tensor-to-host
    conversion raises (on a GPU each one would wait for the device)."""
    guarded = threading.local()

    def guard(name):
        original = getattr(torch.Tensor, name)

        def conversion(self, *args, **kwargs):
            if getattr(guarded, "on", False):
                raise RuntimeError(f"host sync: Tensor.{name} inside a device stage")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, conversion)

    for name in HOST_CONVERSIONS:
        guard(name)
    from engine.executor import Executor

    traced = Executor._stage

    @contextlib.contextmanager
    def stage(self, plan, time, name, *args):
        stages = ("draft", "verify", "sample", "refill", "step")  # step: the whole as one graph
        guarded.on = plan.kind == "decode" and name in stages
        try:
            with traced(self, plan, time, name, *args) as fields:
                yield fields
        finally:
            guarded.on = False

    monkeypatch.setattr(Executor, "_stage", stage)


class CaptureGuard(TorchDispatchMode):
    """Refuses what a CUDA graph cannot hold: an operation whose output's shape depends on
    values (nonzero, boolean indexing, ...) or that reads a value to the host (item)."""

    REFUSED = {
        aten._local_scalar_dense.default,
        aten.nonzero.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_consecutive.default,
        aten.unique_dim.default,
        aten.bincount.default,
        aten.equal.default,
        aten.is_nonzero.default,
    }
    INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        refused = func in self.REFUSED
        if func.overloadpacket in self.INDEXING:  # a boolean index is a nonzero inside
            refused = any(i is not None and i.dtype == torch.bool for i in args[1])
        if func in (aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor):
            refused = kwargs.get("output_size") is None  # its length is the repeats' sum
        if refused:
            raise RuntimeError(f"not capturable in a graph: {func}")
        return func(*args, **kwargs)


@pytest.fixture
def forbid_capture_breaks(monkeypatch):
    """While a step runs as one graph (engine/step_graph.py), CaptureGuard is on."""
    from engine.step_graph import StepGraph

    run = StepGraph.__call__

    def guarded(self, *args):
        with CaptureGuard():
            return run(self, *args)

    monkeypatch.setattr(StepGraph, "__call__", guarded)
