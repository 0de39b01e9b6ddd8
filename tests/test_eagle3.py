"""EAGLE-3: the head against the layer written with transformers' parts (as the `speculators`
package builds it), the target layers it reads against transformers' hidden states, and its
two checkpoint layouts (SpecForge's, speculators')."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers.models.llama import modeling_llama as hf

from core.step import TargetOutput
from models import native
from models.attention import CausalAttention
from models.checkpoint import CheckpointError
from models.eagle import Eagle3Head, default_aux_layers, load_eagle_head, save_eagle3_head
from models.llama import prepare_for_inference
from models.loader import load_model
from tests.paged import PagedRunner
from tests.tiny import random_eagle3_head

LAYERS = 8
CONFIG = transformers.LlamaConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=LAYERS,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)
TOKENS = [5, 17, 3, 88, 41, 41, 9, 60, 2, 33, 71, 12]


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float32 rounding, relative to the largest value (the residuals grow)."""
    return bool((a - b).abs().max() <= 1e-5 * b.abs().max())


@pytest.fixture(scope="module")
def hf_target():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.uniform_(0.5, 1.5) if "norm" in name else p.normal_(0.0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def target(hf_target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle3_target")
    hf_target.save_pretrained(directory, safe_serialization=True)
    return load_model(directory)


@pytest.fixture(scope="module")
def head(target):
    head = random_eagle3_head(target, default_aux_layers(LAYERS), draft_vocab=40)
    with torch.no_grad():  # norms that matter
        for name, p in head.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return head


def hf_layer(head: Eagle3Head) -> hf.LlamaDecoderLayer:
    """transformers' Llama layer with q, k, v over 2H and a hidden_norm (speculators' patch),
    holding the head's weights."""
    cfg = transformers.LlamaConfig(**(CONFIG.to_dict() | {"num_hidden_layers": 1}))
    cfg._attn_implementation = "eager"
    layer = hf.LlamaDecoderLayer(cfg, 0)
    h, d = cfg.hidden_size, cfg.head_dim
    for name, out in (("q_proj", cfg.num_attention_heads), ("k_proj", cfg.num_key_value_heads)):
        setattr(layer.self_attn, name, torch.nn.Linear(2 * h, out * d, bias=False))
    layer.self_attn.v_proj = torch.nn.Linear(2 * h, cfg.num_key_value_heads * d, bias=False)
    layer.hidden_norm = hf.LlamaRMSNorm(h, eps=cfg.rms_norm_eps)
    layer.load_state_dict(head.midlayer.state_dict())
    return layer.eval()


def hf_head_step(head: Eagle3Head, layer, ids: torch.Tensor, fused: torch.Tensor) -> torch.Tensor:
    """speculators' first-layer forward over one sequence: [T, H] before the final norm."""
    t = ids.shape[0]
    rotary = hf.LlamaRotaryEmbedding(layer.self_attn.config)
    positions = torch.arange(t)[None]
    cos_sin = rotary(fused[None], positions)
    embeds = layer.input_layernorm(head.target.embed_tokens(ids))[None]
    x = torch.cat([embeds, layer.hidden_norm(fused)[None]], -1)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    attn, _ = layer.self_attn(x, position_embeddings=cos_sin, attention_mask=mask)
    x = fused[None] + attn
    return (x + layer.mlp(layer.post_attention_layernorm(x)))[0]


@torch.no_grad()
def test_the_head_equals_the_layer_built_from_transformers(hf_target, target, head):
    ids = torch.tensor(TOKENS)
    n = len(TOKENS)
    hidden, aux = target(ids, torch.arange(n), CausalAttention(1, n), head.target_layers)
    states = hf_target(ids[None], output_hidden_states=True).hidden_states
    # what EAGLE-3 reads: transformers' hidden_states[i], the residual entering layer i
    expected_aux = torch.cat([states[i][0] for i in head.aux_layers], -1)
    assert close(torch.cat(aux, -1), expected_aux)
    fused = head.target_features(TargetOutput(ids, hidden, torch.empty(0), torch.cat(aux, -1)))
    ours = head(ids, fused, torch.arange(n), CausalAttention(1, n))
    theirs = hf_head_step(head, hf_layer(head), ids, head.fuse(expected_aux))
    assert close(ours, theirs)
    # logits: -inf outside the draft vocabulary, the lm_head's rows inside it
    logits = head.logits(ours)
    outside = ~head.t2d
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, head.t2d]).all()
    small = head.lm_head(head.norm(ours))
    assert torch.equal(logits[:, torch.arange(40) + head.d2t], small)


@torch.no_grad()
def test_the_target_layers_through_the_engines_kernels(hf_target, tmp_path, head):
    """The prepared target's paged forwards (a prefill, then decodes through its
    NativeDecoder) hand out the residual streams transformers' hidden_states hold."""
    hf_target.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    prepare_for_inference(model)
    if native.available():
        assert model.decoder is not None
    runner = PagedRunner(model, num_seqs=1)
    states = hf_target(torch.tensor(TOKENS)[None], output_hidden_states=True).hidden_states
    start = 0
    for chunk in (TOKENS[:9], TOKENS[9:10], TOKENS[10:]):
        runner.step([chunk], head.target_layers)
        for got, layer in zip(runner.aux, head.aux_layers, strict=True):
            assert close(got, states[layer][0, start : start + len(chunk)])
        start += len(chunk)


def speculators_dir(directory, head: Eagle3Head):
    """`head` as the speculators package writes it: the layer under `layers.0.`, the layer's
    config nested, the embedding carried along."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "draft_vocab_size": head.d2t.numel(),
        "eagle_aux_hidden_state_layer_ids": list(head.aux_layers),
        "norm_before_residual": False,
        "transformer_layer_config": CONFIG.to_dict() | {"num_hidden_layers": 1},
    }
    (directory / "config.json").write_text(json.dumps(config))
    state = {
        name.replace("midlayer.", "layers.0."): t.clone() for name, t in head.state_dict().items()
    }
    state["embed_tokens.weight"] = head.target.embed_tokens.weight.clone()
    save_file(state, str(directory / "model.safetensors"))
    return directory


@torch.no_grad()
@pytest.mark.parametrize("layout", ["specforge", "speculators"])
def test_layouts_load_to_the_same_head(target, head, tmp_path, layout):
    if layout == "specforge":
        save_eagle3_head(head, tmp_path)
        config = json.loads((tmp_path / "config.json").read_text())
        assert config["architectures"] == ["LlamaForCausalLMEagle3"]
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    else:
        speculators_dir(tmp_path, head)
    loaded = load_eagle_head(tmp_path, target)
    assert isinstance(loaded, Eagle3Head)
    assert loaded.aux_layers == head.aux_layers and torch.equal(loaded.d2t, head.d2t)
    features = torch.randn(5, 64)
    ids, positions = torch.tensor(TOKENS[:5]), torch.arange(5)
    ours = head.logits(head(ids, features, positions, CausalAttention(1, 5)))
    theirs = loaded.logits(loaded(ids, features, positions, CausalAttention(1, 5)))
    assert torch.equal(ours, theirs)


@torch.no_grad()
def test_a_full_vocabulary_head_without_lm_head_shares_the_targets(target, tmp_path):
    cfg = dataclasses.replace(target.config, num_layers=1)
    head = Eagle3Head(cfg, target, (2, 3, 4), draft_vocab=96, shared_lm_head=True)
    save_eagle3_head(head, tmp_path)
    loaded = load_eagle_head(tmp_path, target)
    assert loaded.lm_head is None and not loaded.reduced
    features = torch.randn(3, 64)
    assert torch.equal(loaded.logits(features), target.logits(loaded.norm(features)))


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [3, 2]}}, "must rise"),
        ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 9]}}, "must rise"),
        ({"vocab_size": 50}, "vocabulary of 50"),
        ({"norm_output": True}, "not supported"),
    ],
)
def test_bad_configs_name_the_problem(target, head, tmp_path, edit, message):
    save_eagle3_head(head, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text()) | edit
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=message):
        load_eagle_head(tmp_path, target)


def test_a_mapping_that_disagrees_is_refused(target, head, tmp_path):
    save_eagle3_head(head, tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))
    state["d2t"][0] += 1
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="d2t and t2d disagree"):
        load_eagle_head(tmp_path, target)
