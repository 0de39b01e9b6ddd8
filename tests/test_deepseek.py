"""DeepSeek-V3 targets (models/deepseek.py) against transformers' DeepseekV3ForCausalLM on tiny
random checkpoints: paged forwards, the engine's greedy output, the loader's layouts."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from core.params import SamplingParams
from kv.cache import KVCache
from models.attention import CausalAttention, TorchPagedAttention
from models.checkpoint import CheckpointError
from models.deepseek import (
    DeepseekModel,
    LatentAttention,
    MoE,
    load_deepseek,
    published,
    save_deepseek,
)
from models.llama import prepare_for_inference
from models.loader import load_model
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.paged import PagedRunner
from tests.tiny import write_tokenizer

TOLERANCE = 1e-4
COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    "bos_token_id": 0,
    "eos_token_id": 0,
}
CONFIGS: dict[str, dict[str, Any]] = {
    # q through its low-rank latent, a dense first layer, 4 groups of 2 experts of which the
    # 2 best are kept, a shared expert, rotary pairs interleaved; cached width 32 + 16: the
    # native attention kernel's
    "q-lora-groups": {
        "num_hidden_layers": 3, "q_lora_rank": 24, "kv_lora_rank": 32, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 16, "v_head_dim": 12, "n_routed_experts": 8, "n_group": 4,
        "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "routed_scaling_factor": 2.5,
    },
    # q projected directly, every layer MoE, one group, no shared expert, unnormalised
    # weights, rotate-half rotary; cached width 20 + 4 (torch's attention)
    "plain-q-all-moe": {
        "num_hidden_layers": 2, "q_lora_rank": None, "kv_lora_rank": 20, "qk_nope_head_dim": 12,
        "qk_rope_head_dim": 4, "v_head_dim": 16, "n_routed_experts": 6, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 0,
        "first_k_dense_replace": 0, "norm_topk_prob": False, "rope_interleave": False,
    },
    # YaRN with DeepSeek's mscales (the softmax scale and the rotary's), 2 shared experts
    "yarn": {
        "num_hidden_layers": 2, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 8, "v_head_dim": 8, "n_routed_experts": 4, "n_group": 2,
        "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 2,
        "first_k_dense_replace": 1,
        "rope_parameters": {
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1,
            "mscale": 1.0, "mscale_all_dim": 0.8,
        },
    },
}  # fmt: skip


def hf_model(name: str, vocab: int, seed: int = 0) -> transformers.PreTrainedModel:
    """A random model whose every weight matters to the logits: wide enough that greedy
    decoding and the routers' choices do not turn on rounding."""
    torch.manual_seed(seed)
    cfg = transformers.DeepseekV3Config(vocab_size=vocab, **COMMON, **CONFIGS[name])
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "norm" in param_name:
                p.uniform_(0.5, 1.5)
            elif param_name.endswith("mlp.gate.weight"):  # router logits of about unit size:
                p.normal_(0.0, cfg.hidden_size**-0.5)  # sigmoids short of saturation, apart
            else:
                p.normal_(0.0, 0.3)
        for buffer_name, b in model.named_buffers():
            if buffer_name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    return model.eval()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    """(the config's name, its directory, transformers' model)."""
    root = tmp_path_factory.mktemp(request.param)
    reference = hf_model(request.param, write_tokenizer(root))
    reference.save_pretrained(root)
    return request.param, root, reference


def router_margins(reference: transformers.PreTrainedModel, tokens: list[list[int]]) -> float:
    """The smallest margin of any routing choice transformers makes over these sequences: a
    kept group's score over the best dropped one's, a chosen expert's over the best one left
    (below ~1e-4, float rounding could flip a choice and the logits with it)."""
    margins: list[float] = []

    def hook(router, args, _output):
        scores = F.linear(args[0].view(-1, router.hidden_dim).float(), router.weight.float())
        choice = scores.sigmoid() + router.e_score_correction_bias
        groups = choice.view(-1, router.num_group, router.num_experts // router.num_group)
        group_scores = groups.topk(2, -1).values.sum(-1).sort(-1, descending=True).values
        if router.topk_group < router.num_group:
            gap = group_scores[:, router.topk_group - 1] - group_scores[:, router.topk_group]
            margins.append(gap.min().item())
        kept = group_scores[:, router.topk_group - 1 : router.topk_group]
        allowed = groups.topk(2, -1).values.sum(-1) >= kept  # the kept groups
        masked = groups.masked_fill(~allowed[..., None], -math.inf).flatten(1)
        best = masked.sort(-1, descending=True).values
        k = router.top_k
        margins.append((best[:, k - 1] - best[:, k]).min().item())

    handles = [m.register_forward_hook(hook) for m in reference.modules()
               if type(m).__name__ == "DeepseekV3TopkRouter"]  # fmt: skip
    with torch.no_grad():
        for t in tokens:
            reference(torch.tensor([t]))
    for h in handles:
        h.remove()
    return min(margins)


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


class TorchOnly(TorchPagedAttention):
    native_max_q = -1  # every forward through torch's products, where MLA can run expanded


def run_forms(model: DeepseekModel, form: str) -> None:
    """Every forward of `model` in MLA's absorbed or expanded form."""
    for sub in model.modules():
        if isinstance(sub, LatentAttention):
            sub.expanded_min_tokens = 0 if form == "expanded" else 1 << 30


@pytest.mark.parametrize("form", ["absorbed", "expanded"])
@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "inference-kernels"])
def test_paged_prefill_decode_verify_match_transformers(checkpoint, prepared, form):
    name, root, reference = checkpoint
    model = load_model(root)
    assert isinstance(model, DeepseekModel)
    if prepared:
        prepare_for_inference(model)
    run_forms(model, form)
    backend = TorchOnly if form == "expanded" else TorchPagedAttention
    runner = PagedRunner(model, num_seqs=3, attention=backend)
    vocab = model.config.vocab_size
    schedule = [[7, 3, 10]] + [[1, 1, 1]] * 3 + [[3, 5, 4], [5, 4, 3]]
    outputs = []
    for lengths in schedule:
        starts = [len(t) for t in runner.tokens]
        chunks = [torch.randint(0, vocab, (n,)).tolist() for n in lengths]
        outputs.extend(zip(range(3), starts, runner.step(chunks), strict=True))
    expected = [hf_logits(reference, tokens) for tokens in runner.tokens]
    for seq, start, got in outputs:
        want = expected[seq][start : start + len(got)]
        assert (got - want).abs().max().item() <= TOLERANCE, (name, seq, start)
    assert expected[0].abs().max() > 1.0  # the check is not vacuous
    assert router_margins(reference, runner.tokens) > 1e-4  # no choice turned on rounding


class Recorded(TorchPagedAttention):
    """The paged attention of layer 0 (whose input, the embeddings, is the same whatever the
    cache keeps), each call's queries, keys and output recorded."""

    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __call__(self, layer, q, k, v):
        out = super().__call__(layer, q, k, v)
        if layer == 0:
            self.calls.append((q, k, out))
        return out


@pytest.mark.parametrize("prepared", [False, True], ids=["torch", "inference-kernels"])
def test_a_float16_cache_moves_latent_attention_by_its_rounding_only(checkpoint, prepared):
    """MLA's absorbed attention (one head over latent + rope rows, the rows its values too)
    over a float16 cache against a float32 one, through a prefill and decodes: every output
    moves by at most what rounding the cached rows to float16 (unit roundoff u = 2^-11)
    implies: a score by d = sum |q| |k| u / sqrt(D), the weights by a factor e^{2d}, so
    |out16 - out32| <= max |v| ((e^{2 d_max} - 1)(1 + u) + u)."""
    name, root, _ = checkpoint
    outputs = {}
    for dtype in (torch.float32, torch.float16):
        model = load_model(root)
        if prepared:
            prepare_for_inference(model)
        run_forms(model, "absorbed")
        cfg = model.config
        runner = PagedRunner(model, num_seqs=1, attention=Recorded)
        runner.cache = KVCache(cfg.num_layers, 48, 4, 1, cfg.head_dim, dtype, queries=torch.float32)
        Recorded.calls = []
        tokens = torch.randint(0, cfg.vocab_size, (23,), generator=torch.Generator().manual_seed(1))
        runner.step([tokens.tolist()])
        for token in tokens[:6].tolist():  # decodes over the prompt's rows and their own
            runner.step([[token]])
        outputs[dtype] = Recorded.calls
    u, width = 2.0**-11, cfg.head_dim
    for (q, _, out32), (_, _, out16) in zip(
        outputs[torch.float32], outputs[torch.float16], strict=True
    ):
        keys = outputs[torch.float32][-1][1][:, 0]  # [T, D] every row of the last step's seq
        d = (q.abs()[:, :, None, :] * keys.abs()[None, None]).sum(-1).max() * u / width**0.5
        v_max = keys[:, : cfg.kv_lora_rank].abs().max()
        bound = v_max * ((torch.exp(2 * d) - 1) * (1 + u) + u) + 1e-5
        latent = out32[..., : cfg.kv_lora_rank]
        assert (out16[..., : cfg.kv_lora_rank] - latent).abs().max() <= bound, (name, bound)
    moved = max((a[2] - b[2]).abs().max().item() for a, b in zip(*outputs.values(), strict=True))
    assert moved > 0  # the float16 cache did round


def test_the_absorbed_and_expanded_forms_agree(checkpoint):
    """Prefill, decodes and verifies of a batch in each form, over the same cache layout."""
    _, root, _ = checkpoint
    logits = {}
    for form in ("absorbed", "expanded"):
        model = load_deepseek(root, torch.float32, "cpu")
        run_forms(model, form)
        runner = PagedRunner(model, num_seqs=2, attention=TorchOnly)
        torch.manual_seed(1)
        steps = [[torch.randint(0, 300, (n,)).tolist() for n in lengths]
                 for lengths in ([9, 14], [1, 1], [1, 1], [4, 3])]  # fmt: skip
        logits[form] = torch.cat([torch.cat(runner.step(chunks)) for chunks in steps])
    torch.testing.assert_close(logits["expanded"], logits["absorbed"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "chunk, micro_batches",
    [(0, 1), (8, 1), (0, 2)],
    ids=["whole-prefill", "chunked-prefill", "moe-in-two-micro-batches"],
)
async def test_the_engine_decodes_as_transformers_greedy(checkpoint, chunk, micro_batches):
    name, root, reference = checkpoint
    prompts = ragged_prompts(4, reference.config.vocab_size, seed=5)
    kw = {"max_batch_tokens": chunk} if chunk else {}
    kw["moe_micro_batches"] = micro_batches
    async with running(make_config(root, **kw)) as engine:
        params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
        outs = [token_ids(await engine.generate(p, params)) for p in prompts]
    for prompt, out in zip(prompts, outs, strict=True):
        want: list[int] = []
        for _ in range(10):  # greedy through transformers' whole forward, eos not stopping it
            want.append(int(hf_logits(reference, prompt + want)[-1].argmax()))
        assert out == want, (name, prompt)


def test_moe_in_two_halves_and_by_expert_equals_one_gathered_pass(checkpoint):
    """A batch's two micro-batches, and each expert run over its tokens (prefills), give
    the rows of one pass that gathers each token's experts (decodes)."""
    _, root, _ = checkpoint
    model = load_deepseek(root, torch.float32, "cpu")
    moe = next(layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE))
    x = torch.randn(10, model.config.hidden_size)
    with torch.no_grad():
        whole = moe(x)
        moe.micro_batches = 2
        halves = moe(x)
        moe.micro_batches, moe.experts.gathered_max_tokens = 1, 0
        by_expert = moe(x)
    # rows whose entries reach ~50 summed in other orders: float32 rounding, a few units of
    # its last place at 50 (2.3e-5 seen where the products run on AVX-512 with AMX)
    torch.testing.assert_close(halves, whole, rtol=1e-5, atol=5e-5)
    torch.testing.assert_close(by_expert, whole, rtol=1e-5, atol=5e-5)
    assert whole.abs().max() > 0.1


def by_blocks(scale: torch.Tensor, shape: torch.Size, block: int = 16) -> torch.Tensor:
    """Per-block scales [ceil(out / b), ceil(in / b)] spread over a weight's shape."""
    return scale.repeat_interleave(block, 0)[: shape[0]].repeat_interleave(block, 1)[:, : shape[1]]


def test_float8_weights_are_dequantized_by_block(tmp_path, checkpoint):
    """A float8 copy of the checkpoint (a weight_scale_inv per 16 x 16 block; DeepSeek-V3's
    are 128 x 128) loads as the float32 checkpoint holding the same dequantized values."""
    _, root, _ = checkpoint
    quantized, dequantized = {}, {}
    for name, t in load_file(root / "model.safetensors").items():
        if not (t.ndim == 2 and t.numel() and name.endswith("proj.weight")):
            quantized[name] = dequantized[name] = t
            continue
        blocks = (-(-t.shape[0] // 16), -(-t.shape[1] // 16))
        scale = t.abs().amax() / 448 * (0.5 + torch.rand(blocks))
        q = (t / by_blocks(scale, t.shape)).to(torch.float8_e4m3fn)
        quantized |= {name: q, name + "_scale_inv": scale}
        dequantized[name] = q.float() * by_blocks(scale, t.shape)
    config = json.loads((root / "config.json").read_text())
    fp8 = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
    for directory, weights, extra in (("fp8", quantized, fp8), ("f32", dequantized, {})):
        (tmp_path / directory).mkdir()
        save_file(weights, tmp_path / directory / "model.safetensors")
        (tmp_path / directory / "config.json").write_text(json.dumps(config | extra))
    a = load_deepseek(tmp_path / "fp8", torch.float32, "cpu").state_dict()
    b = load_deepseek(tmp_path / "f32", torch.float32, "cpu").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def test_unsupported_checkpoints_are_refused_by_name(tmp_path, checkpoint):
    _, root, _ = checkpoint
    config = json.loads((root / "config.json").read_text())
    for change, says in (
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "rope type"),
        ({"quantization_config": {"quant_method": "awq"}}, "awq"),
    ):
        (tmp_path / "config.json").write_text(json.dumps(config | change))
        (tmp_path / "model.safetensors").write_bytes((root / "model.safetensors").read_bytes())
        with pytest.raises(CheckpointError, match=says):
            load_model(tmp_path)


# ---------------------------------------------------------------- the checkpoint's MTP layer


def with_mtp_layer(reference: transformers.PreTrainedModel, root, seed: int = 1):
    """transformers' MTP model over `reference` (random weights), its layer written into the
    checkpoint at `model.layers.{num_hidden_layers}.` under DeepSeek's published names."""
    from transformers.modeling_layers import MtpModel

    torch.manual_seed(seed)
    mtp = MtpModel(reference, 1).eval()
    layer = mtp.layers[0]
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("mlp.gate.weight"):  # as hf_model's routers
                p.normal_(0.0, reference.config.hidden_size**-0.5)
            else:
                p.normal_(0.0, 0.3)
        for name, b in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    prefix = f"model.layers.{reference.config.num_hidden_layers}."
    tensors = load_file(root / "model.safetensors")
    renamed = {name.replace("mtp_block.", "").replace("post_norm.", "shared_head.norm."): t
               for name, t in layer.state_dict().items()}  # fmt: skip
    tensors |= published(renamed, prefix, torch.float32)  # the experts one tensor each
    # DeepSeek's MTP layers carry copies of the embedding and the head (the target's are used)
    tensors[prefix + "embed_tokens.weight"] = reference.model.embed_tokens.weight.detach()
    tensors[prefix + "shared_head.head.weight"] = reference.lm_head.weight.detach()
    save_file({n: t.contiguous() for n, t in tensors.items()}, root / "model.safetensors")
    return mtp


def test_the_checkpoints_mtp_layer_matches_transformers(checkpoint, tmp_path):
    from models.mtp import load_mtp_head

    name, root, reference = checkpoint
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / f).write_bytes((root / f).read_bytes())
    (tmp_path / "model.safetensors").write_bytes((root / "model.safetensors").read_bytes())
    mtp = with_mtp_layer(reference, tmp_path)
    target = load_model(tmp_path)
    head = load_mtp_head(tmp_path, target)
    ids = torch.randint(0, reference.config.vocab_size, (1, 24))
    n = ids.shape[1] - 1
    with torch.no_grad():
        hidden = reference.model(ids).last_hidden_state  # [1, T, H], after the final norm
        positions = torch.arange(1, n + 1)[None]
        want = mtp.layers[0](
            inputs_embeds=reference.model.embed_tokens(ids[:, 1:]),
            previous_hidden_state=hidden[:, :-1],
            position_embeddings=reference.model.rotary_emb(hidden, positions),
            attention_mask=None,
            position_ids=positions,
            cache=None,
        )[0]  # after its post norm: DeepSeek's shared_head.norm
        ours = head(ids[0, 1:], hidden[0, :-1], positions[0], CausalAttention(1, n))
        got = head.shared_head.norm(ours)
    assert (got - want).abs().max().item() <= TOLERANCE, name
    assert want.abs().max() > 0.5
    with torch.no_grad():
        assert (head.logits(ours) - reference.lm_head(want)).abs().max().item() <= 1e-3


@pytest.fixture(scope="module")
def with_mtp(checkpoint, tmp_path_factory):
    """(the config's name, a copy of its checkpoint carrying an MTP layer)."""
    name, root, reference = checkpoint
    copy = tmp_path_factory.mktemp(f"{name}-mtp")
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "model.safetensors"):
        (copy / f).write_bytes((root / f).read_bytes())
    with_mtp_layer(reference, copy)
    return name, copy


GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("k", [1, 3], ids=["one-token", "chain-3"])
async def test_greedy_with_the_checkpoints_mtp_equals_plain(with_mtp, k, request):
    """k = 1: the one-token mode, whose decode steps must not wait for the host (the MoE
    layers' routing included)."""
    name, root = with_mtp
    prompts = ragged_prompts(6, 300, seed=2)
    async with running(make_config(root, max_batch_tokens=64)) as engine:
        plain = await staggered(engine, prompts, GREEDY, seed=1)
    if k == 1:
        request.getfixturevalue("forbid_host_sync")
    draft = root if k == 1 else None  # without a --draft, the target's own MTP layer
    async with running(make_config(root, "mtp", draft, k=k, max_batch_tokens=64)) as engine:
        outs = await staggered(engine, prompts, GREEDY, seed=1)
        usage = (await engine.generate(prompts[0], GREEDY))[-1].usage
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert outs == plain, name
    assert usage.draft_tokens > 0 and usage.accepted_tokens <= usage.draft_tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [1, 2])
def test_sampled_output_with_the_checkpoints_mtp_follows_the_target(tmp_path, k):
    """The chi-square of tests/test_speculative_stats.py on a DeepSeek target of VOCAB
    tokens drafted by its MTP layer (k = 1: the one-token mode), the drafts sampled."""
    import asyncio
    import dataclasses

    from tests import stats

    write_tokenizer(tmp_path)
    cfg = transformers.DeepseekV3Config(
        vocab_size=stats.VOCAB,
        hidden_size=32,
        intermediate_size=48,
        moe_intermediate_size=16,
        num_attention_heads=2,
        num_hidden_layers=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        v_head_dim=4,
        n_routed_experts=4,
        n_group=1,
        topk_group=1,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=0,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    torch.manual_seed(3)
    reference = transformers.DeepseekV3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for param_name, p in reference.named_parameters():
            # a law of 56 outcomes (34 of them drawn 5 times or more in N), whose 4% shift
            # the test rejects (p ~1e-8 at the expected counts)
            p.uniform_(0.5, 1.5) if "norm" in param_name else p.normal_(0.0, 0.4)
    reference.save_pretrained(tmp_path)
    with_mtp_layer(reference, tmp_path, seed=4)
    expected = stats.exact_joint(tmp_path)
    config = make_config(
        tmp_path,
        "mtp",
        tmp_path,
        k=k,
        pages=3 * stats.N,
        max_running=stats.N,
        max_waiting=stats.N,
        max_batch_tokens=len(stats.PROMPT) * stats.N,
        max_model_len=16,
    )
    config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, sampled_drafts=True))

    async def draws() -> dict[tuple[int, ...], int]:
        params = [SamplingParams(**stats.PARAMS) for _ in range(stats.N)]  # no seeds
        async with running(config) as engine:
            outs = await asyncio.gather(*(engine.generate(stats.PROMPT, p) for p in params))
        assert all(out[-1].usage.draft_tokens >= 1 for out in outs)
        counts: dict[tuple[int, ...], int] = {}
        for out in outs:
            counts[tuple(token_ids(out))] = counts.get(tuple(token_ids(out)), 0) + 1
        return counts

    observed = asyncio.run(draws())
    assert sum(observed.values()) == stats.N
    stats.assert_law(observed, expected, stats.N)


# ---------------------------------------------------------------- training and saving


def test_a_model_trained_here_saves_for_transformers_and_for_the_engine(tmp_path):
    """train/objectives.py's DeepSeek target, one training step (its gradients reach the
    latent up-projection and the router, the router's bias moves towards balance), saved:
    transformers and our loader read the same logits from it, and so does its MTP head."""
    import dataclasses

    from models.mtp import MTPHead, load_mtp_head, save_mtp_head
    from train import objectives

    cfg = objectives.deepseek_config(320, 0)
    torch.manual_seed(0)
    model = DeepseekModel(cfg)
    objectives.init_weights(model)
    batch = torch.randint(0, 320, (2, 33))
    objectives.lm_loss(model, batch).backward()
    attention = model.layers[1].self_attn
    assert attention.kv_b_proj.weight.grad.abs().sum() > 0
    assert model.layers[1].mlp.gate.weight.grad.abs().sum() > 0
    assert model.layers[1].mlp.gate.e_score_correction_bias.abs().sum() > 0
    model.eval()
    save_deepseek(model, tmp_path, torch.float32)
    write_tokenizer(tmp_path)
    ids = batch[:1, :20]
    with torch.no_grad():
        ours = objectives.forward_logits(model, ids)
        theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)(ids).logits[0]
        loaded = objectives.forward_logits(load_model(tmp_path), ids)
    assert (theirs - ours).abs().max().item() <= TOLERANCE
    assert (loaded - ours).abs().max().item() <= TOLERANCE

    head = MTPHead(dataclasses.replace(cfg, num_layers=1), model)
    objectives.init_weights(head)
    save_mtp_head(head.eval(), tmp_path, torch.float32)
    loaded_head = load_mtp_head(tmp_path, load_model(tmp_path))
    hidden = torch.randn(19, cfg.hidden_size)
    with torch.no_grad():
        want = head(ids[0, 1:], hidden, torch.arange(1, 20), CausalAttention(1, 19))
        got = loaded_head(ids[0, 1:], hidden, torch.arange(1, 20), CausalAttention(1, 19))
    assert (got - want).abs().max().item() <= TOLERANCE and want.abs().max() > 0.1


def test_micro_batches_are_one_or_two():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="moe_micro_batches must be 1 or 2"):
        EngineConfig(moe_micro_batches=3)


DEMO = Path(__file__).resolve().parent.parent / "models" / "demo" / "deepseek"


@pytest.mark.parametrize("k", [1, 4])
async def test_the_demo_deepseeks_mtp_layer_drafts_losslessly(k):
    """The committed DeepSeek-style target and its trained MTP layer: greedy output with the
    layer drafting equals plain decoding's, and most drafts are accepted."""
    prompts = ragged_prompts(4, 4096, seed=9)
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    async with running(make_config(DEMO, pages=512)) as engine:
        plain = [token_ids(await engine.generate(p, params)) for p in prompts]
    async with running(make_config(DEMO, "mtp", None, k=k, pages=512)) as engine:
        outs = [await engine.generate(p, params) for p in prompts]
    assert [token_ids(o) for o in outs] == plain
    drafted = sum(o[-1].usage.draft_tokens for o in outs)
    assert sum(o[-1].usage.accepted_tokens for o in outs) > 0.3 * drafted > 0
