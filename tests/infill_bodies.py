"""The request bodies llama.vim and llama.vscode send to /infill (read in their public
source), and bodies that make llama.cpp cut the prefix, the suffix and the other files:
test_infill.py sends them, infill_record.py recorded llama.cpp's prompts for them."""

from __future__ import annotations

PREFIX = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n"
SUFFIX = "\n\nclass Point:\n    pass\n"

# the bodies the plugins send (read in their public source): llama.vim's completion and its
# ring-buffer warm-up, llama.vscode's completion
LLAMA_VIM = {
    "input_prefix": PREFIX,
    "input_suffix": SUFFIX,
    "input_extra": [{"text": "x = 1\n", "time": [1733, 123], "filename": "a.py"}],
    "prompt": "    ",
    "n_predict": 12,
    "n_indent": 4,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 1500,
    "response_fields": [
        "content",
        "timings/prompt_n",
        "timings/prompt_ms",
        "timings/predicted_n",
        "timings/predicted_ms",
        "truncated",
        "tokens_cached",
    ],
}
LLAMA_VIM_WARM_UP = {
    "input_prefix": "",
    "input_suffix": "",
    "input_extra": [{"text": "x = 1\n", "time": [1733, 123], "filename": "a.py"}],
    "prompt": "",
    "n_predict": 0,
    "temperature": 0.0,
    "stream": False,
    "samplers": [],
    "cache_prompt": True,
    "t_max_prompt_ms": 1,
    "t_max_predict_ms": 1,
    "response_fields": [""],
}
LLAMA_VSCODE = {
    "id_slot": 0,
    "input_prefix": PREFIX,
    "input_suffix": SUFFIX,
    "input_extra": [{"text": "y = 2\n", "time": 1733000000, "filename": "b.py"}],
    "prompt": "    ",
    "n_predict": 12,
    "n_cmpl": 1,
    "top_k": 40,
    "top_p": 0.99,
    "stream": False,
    "samplers": ["top_k", "top_p", "infill"],
    "cache_prompt": True,
    "n_indent": 4,
    "t_max_prompt_ms": 500,
    "t_max_predict_ms": 2500,
}


def _code(n: int, name: str) -> str:
    """n small functions: about 14 Qwen2.5-Coder tokens each."""
    return "".join(f"def {name}_{i}(x):\n    return x * {i} + 1\n\n" for i in range(n))


BODIES = {
    "llama.vim": LLAMA_VIM,
    "llama.vim warm-up": LLAMA_VIM_WARM_UP,
    "llama.vscode": LLAMA_VSCODE,
    # past 3/4 of a batch of prefix and a quarter of suffix: both cut
    "long prefix and suffix": {
        "input_prefix": _code(150, "before"),
        "input_suffix": _code(60, "after"),
        "prompt": "    x = ",
        "n_predict": 1,
    },
    # other files past n_ctx - n_batch + 2 tokens: the first ones dropped, mid-file
    "many files": {
        "input_prefix": PREFIX,
        "input_suffix": SUFFIX,
        "input_extra": [{"text": _code(60, f"f{j}"), "filename": f"m{j}.py"} for j in range(6)],
        "n_predict": 1,
    },
    "a file without a name, specials as text": {
        "input_prefix": "x = '<|fim_prefix|>'\n",
        "input_suffix": "<|endoftext|>",
        "input_extra": [{"text": "<|file_sep|>y = 2\n"}],
        "prompt": "<|fim_middle|>",
        "n_predict": 1,
    },
}
