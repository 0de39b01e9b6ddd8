"""Device names: "cuda" with and without an index reaches a stream worker as an index torch
takes; an unknown name is refused by the config, and a CUDA device on a machine without one
by the command line."""

from __future__ import annotations

import pytest
import torch

import server
from engine.builder import Builder
from engine.config import EngineConfig
from engine.device import _Worker
from models.attention import TorchPagedAttention
from models.flashinfer_backend import FlashInferBackend


@pytest.mark.parametrize("name, index", [("cuda", 0), ("cuda:0", 0), ("cuda:1", 1)])
def test_a_stream_worker_sets_the_device_by_index(monkeypatch, name, index):
    chosen = []

    def set_device(device):  # torch's own refuses a torch.device without an index
        if isinstance(device, torch.device) and device.index is None:
            raise ValueError("Expected a torch.device with a specified index")
        chosen.append(device)

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    worker = _Worker("test", torch.device(name))
    ran = []
    worker.put(lambda: ran.append(True))
    worker.close()
    assert chosen == [index] and ran == [True]


@pytest.mark.parametrize("name", ["tpu", "cuda:x", "cuda0", "mps"])
def test_an_unknown_device_is_refused(name):
    with pytest.raises(ValueError, match="unknown device"):
        EngineConfig(device=name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("name", ["cuda", "cuda:0"])
def test_a_cuda_device_without_cuda_is_a_usage_error(capsys, name):
    with pytest.raises(SystemExit) as exit:
        server.config_from_args(["--device", name])
    assert exit.value.code == 2
    assert "no CUDA device" in capsys.readouterr().err


def pretend_flashinfer(monkeypatch, present: bool) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if present else None) if name == "flashinfer" else real(name),
    )


@pytest.mark.parametrize(
    "device, flashinfer, dtype, graphs, want",
    [
        ("cpu", True, "auto", "auto", ("float32", "torch", False)),
        ("cuda", True, "auto", "auto", ("bfloat16", "torch", True)),  # graphs capture torch's
        ("cuda", True, "auto", "off", ("bfloat16", "flashinfer", False)),
        ("cuda:0", False, "auto", "auto", ("bfloat16", "torch", True)),
        ("cuda", True, "float32", "off", ("float32", "torch", False)),  # no float32 FlashInfer
    ],
)
def test_auto_dtype_attention_and_graphs_follow_the_device(
    monkeypatch, device, flashinfer, dtype, graphs, want
):
    pretend_flashinfer(monkeypatch, flashinfer)
    config = EngineConfig(device=device, dtype=dtype, cuda_graphs=graphs)
    assert (config.torch_dtype, config.backend, config.graphs) == want


def test_flashinfer_runs_under_graphs_where_both_are_asked_for(monkeypatch):
    pretend_flashinfer(monkeypatch, True)
    config = EngineConfig(device="cuda", attention="flashinfer", cuda_graphs="on")
    assert (config.backend, config.graphs) == ("flashinfer", True)
    assert not EngineConfig(device="cuda", attention="flashinfer").graphs  # auto: eager


@pytest.mark.parametrize("attention", ["auto", "flashinfer"])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_flashinfer_serves_the_head_sizes_it_has_kernels_for(monkeypatch, attention, head_dim):
    """auto takes torch for another head size; flashinfer refuses it at start."""
    pretend_flashinfer(monkeypatch, True)
    builder = Builder(EngineConfig(device="cuda", attention=attention, cuda_graphs="off"))
    if head_dim == 16 and attention == "flashinfer":
        with pytest.raises(ValueError, match="no kernels for the model's head size 16"):
            builder.attention(head_dim)
        return
    backend = builder.attention(head_dim)
    if head_dim == 64:
        assert isinstance(backend, FlashInferBackend)
    else:
        assert backend is TorchPagedAttention


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"attention": "flashinfer"}, "CUDA only"),
        ({"attention": "flashinfer", "device": "cuda", "dtype": "float32"}, "no float32"),
        ({"dtype": "float8"}, "unsupported dtype"),
        ({"batch_invariant": True, "attention": "flashinfer", "device": "cuda"}, "torch"),
    ],
)
def test_impossible_combinations_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields)
