"""Tokenizer directory, chat template, and the incremental detokenizer on a byte-level BPE."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import tokenizers
from tokenizers import decoders, pre_tokenizers, processors, trainers

from models.checkpoint import CheckpointError
from models.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = [
    "héllo wörld 日本語 🙂",
    "hello world, the quick brown fox jumps over the lazy dog",
    "naïve café déjà vu",
    "print('hello world')",
]
TEXT = "héllo wörld! 日本語のテキスト 🙂🙃 café ñandú — done"
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(directory: Path, bos_processor: bool = False, **config: object) -> Path:
    """A byte-level BPE small enough that multi-byte characters span several tokens."""
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    if bos_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    settings = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>", "lstrip": False, "special": True},
        "chat_template": TEMPLATE,
    } | config
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_tokenizer(tmp_path_factory.mktemp("tok")))


def stream(
    tokenizer: Tokenizer, prompt: list[int], output: list[int], sizes: list[int]
) -> list[str]:
    """Deltas for `output` added in chunks of the given sizes (then flushed)."""
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas, i = [], 0
    for n in sizes:
        deltas.append(detok.add(output[i : i + n]))
        i += n
    assert i == len(output)
    deltas.append(detok.flush())
    return deltas


def test_special_tokens_and_vocab(tokenizer):
    assert tokenizer.bos_token_id == 0 and tokenizer.eos_token_id == 1
    assert tokenizer.vocab_size == 300
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_characters_split_across_tokens(tokenizer):
    """The stream tests below are meaningful: some tokens alone are broken UTF-8."""
    ids = tokenizer.encode(TEXT)
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("prompt", ["", "héllo ", "日本"])
def test_stream_token_by_token(tokenizer, prompt):
    prompt_ids, output = tokenizer.encode(prompt), tokenizer.encode(TEXT)
    deltas = stream(tokenizer, prompt_ids, output, [1] * len(output))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(output) == TEXT


def test_stream_in_chunks(tokenizer):
    """Speculative steps add several tokens at once."""
    output = tokenizer.encode(TEXT * 3)
    rng = random.Random(0)
    for _ in range(5):
        sizes = []
        while sum(sizes) < len(output):
            sizes.append(min(rng.randint(0, 5), len(output) - sum(sizes)))
        deltas = stream(tokenizer, [], output, sizes)
        assert not any("\ufffd" in d for d in deltas)
        assert "".join(deltas) == TEXT * 3


def test_stream_ending_mid_character(tokenizer):
    output = tokenizer.encode("ok 🙂")
    while "\ufffd" not in tokenizer.decode(output):
        output = output[:-1]
    deltas = stream(tokenizer, [], output, [1] * len(output))
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(output).removesuffix("\ufffd") == "ok "


def test_stream_skips_special_tokens(tokenizer):
    output = tokenizer.encode("héllo", add_special_tokens=False) + [tokenizer.eos_token_id]
    assert "".join(stream(tokenizer, [], output, [1] * len(output))) == "héllo"


def test_stream_decodes_a_small_window(tokenizer, monkeypatch):
    widths = []
    decode = tokenizer.decode

    def recording(ids, skip_special_tokens=True):
        widths.append(len(ids))
        return decode(ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", recording)
    prompt, output = tokenizer.encode(TEXT * 4), tokenizer.encode(TEXT * 4)
    stream(tokenizer, prompt, output, [1] * len(output))
    assert max(widths) <= 10


def test_chat_template(tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages)
    assert text == "<s><|system|>be brief</s>\n<|user|>hi</s>\n<|assistant|>"
    no_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == text.removesuffix("<|assistant|>")
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert ids[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in ids


def test_chat_template_raise_exception(tokenizer):
    with pytest.raises(ValueError, match="unknown role tool"):
        tokenizer.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_sandboxed(tmp_path):
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    tok = Tokenizer(build_tokenizer(tmp_path, chat_template=escape))
    with pytest.raises(Exception, match="unsafe|not safely"):
        tok.apply_chat_template([])


def test_named_templates_and_jinja_file(tmp_path):
    named = [{"name": "default", "template": "D"}, {"name": "tool_use", "template": "T"}]
    assert Tokenizer(build_tokenizer(tmp_path / "a", chat_template=named)).chat_template == "D"
    directory = build_tokenizer(tmp_path / "b", chat_template=None)
    (directory / "chat_template.jinja").write_text("J{{ bos_token }}")
    assert Tokenizer(directory).apply_chat_template([]) == "J<s>"


def test_add_bos_token(tmp_path):
    bare = tokenizers.Tokenizer.from_file(str(build_tokenizer(tmp_path / "a") / "tokenizer.json"))
    plain = bare.encode("hello").ids
    added = Tokenizer(build_tokenizer(tmp_path / "b", add_bos_token=True))
    assert added.encode("hello") == [0, *plain]
    assert added.encode("hello", add_special_tokens=False) == plain
    by_processor = Tokenizer(build_tokenizer(tmp_path / "c", bos_processor=True))
    assert by_processor.encode("hello") == [0, *plain]
    off = Tokenizer(build_tokenizer(tmp_path / "d", bos_processor=True, add_bos_token=False))
    assert off.encode("hello") == plain
    # a BOS the text spells is kept, never doubled, whatever the rule
    for tokenizer in (added, by_processor, off):
        assert tokenizer.encode("<s>hello") == [0, *plain]


def test_missing_tokenizer(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        Tokenizer(tmp_path)
