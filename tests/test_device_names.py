"""Device names: "cuda" with and without an index reaches a stream worker as an index torch
takes; an unknown name is refused by the config, and a CUDA device on a machine without one
by the command line."""

from __future__ import annotations

import pytest
import torch

import server
from engine.config import EngineConfig
from engine.device import _Worker


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


@pytest.mark.parametrize(
    "device, flashinfer, dtype, backend",
    [
        ("cpu", True, "float32", "torch"),
        ("cuda", True, "bfloat16", "flashinfer"),
        ("cuda:0", False, "bfloat16", "torch"),
    ],
)
def test_auto_dtype_and_attention_follow_the_device(
    monkeypatch, device, flashinfer, dtype, backend
):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: (object() if flashinfer else None) if name == "flashinfer" else real(name),
    )
    config = EngineConfig(device=device)
    assert (config.torch_dtype, config.backend) == (dtype, backend)


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
