"""One request to server.py on CUDA, as the README serves it (auto dtype and attention: bfloat16
and FlashInfer where it imports), with speculation. --dry-run: on the CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from engine.parallel import free_port
from tests.engine_util import wait_healthy
from tests.tiny import write_model

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
DEVICE = "cpu" if os.environ.get("TANDEM_CHECK_DEVICE") == "cpu" else "cuda"


@pytest.mark.timeout(180)
def test_one_completion_through_the_server(tmp_path):
    target = write_model(tmp_path / "t", hidden=128, head_dim=64)
    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "server.py",
            "--model",
            str(target),
            "--port",
            str(port),
            "--device",
            DEVICE,
            "--speculative",
            "ngram",
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_healthy(port, 120)
        body = {"prompt": "hello hello hello", "max_tokens": 12, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        post = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(post, timeout=60) as response:
            answer = json.load(response)
        assert answer["usage"]["completion_tokens"] == 12
        assert answer["choices"][0]["text"]
    finally:
        server.terminate()
        _, err = server.communicate(timeout=30)
        print(err[-2000:])
