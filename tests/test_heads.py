"""Head training on a tiny random target: the precomputed store, a few training steps of each
kind, and validation through the engine."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest
import torch

from models.attention import CausalAttention
from models.loader import load_model
from tests.engine_util import running
from train import head_data, head_train, head_validate
from train.heads import export_head
from train.loop import TrainConfig, train

WINDOW = 32
CFG = head_data.PrecomputeConfig(
    window=WINDOW,
    topk=8,
    train_tokens=8 * WINDOW,
    heldout_tokens=2 * WINDOW,
    shard_windows=3,
    aux_layers=(0, 1),  # an EAGLE-3 head's: both layers' outputs
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_fixtures():
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run fastest on one thread, and two threads spin badly on a busy machine."""
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def target(tiny_target):
    model = load_model(tiny_target, dtype=torch.float32)
    head_train.freeze_shared(model)
    return model


@pytest.fixture(scope="module")
def store(target, tmp_path_factory):
    """A precomputed store of random token windows; its directory."""
    rng = np.random.default_rng(0)
    vocab = target.config.vocab_size
    splits = {
        "train": rng.integers(1, vocab, size=9 * WINDOW).astype(np.uint16),
        "heldout": rng.integers(1, vocab, size=3 * WINDOW).astype(np.uint16),
    }
    data_dir = tmp_path_factory.mktemp("run") / head_data.DATA_DIR
    head_data.precompute(target, splits, data_dir, CFG)
    return data_dir


def test_store_holds_the_targets_outputs(target, store):
    shards = head_data.load_split(store, "train")
    assert len(shards) == len(list((store / "train").glob("shard-*.safetensors"))) == 3
    names = ("tokens", "hidden", "topk_ids", "aux")
    data = {name: head_train.HeadData(shards).gather(name) for name in names}
    assert data["tokens"].shape == (8, WINDOW)
    assert data["hidden"].shape == (8, WINDOW, target.config.hidden_size)
    assert data["hidden"].dtype == torch.float16 and data["topk_ids"].dtype == torch.int16
    assert data["aux"].shape == (8, WINDOW, 2 * target.config.hidden_size)
    ids = data["tokens"][:2].long()
    positions, attn = torch.arange(WINDOW).repeat(2), CausalAttention(2, WINDOW)
    hidden, aux = target(ids.flatten(), positions, attn, CFG.aux_layers)
    torch.testing.assert_close(data["hidden"][:2].float().flatten(0, 1), hidden, atol=2e-3, rtol=0)
    stored = data["aux"][:2].float().flatten(0, 1)
    torch.testing.assert_close(stored, torch.cat(aux, -1), atol=2e-2, rtol=1e-3)
    argmax = target.logits(hidden).argmax(-1)
    assert torch.equal(data["topk_ids"][:2, :, 0].long().flatten(), argmax)


def test_precompute_resumes_and_refuses_other_settings(target, store):
    shard = head_data.shard_path(store, "train", 1)
    before = shard.stat().st_mtime_ns
    shard.unlink()
    other = head_data.shard_path(store, "train", 0).stat().st_mtime_ns
    tokens = {"train": np.arange(9 * WINDOW, dtype=np.uint16) % 50 + 1}
    head_data.precompute(target, tokens, store, CFG)  # redoes only the missing shard
    assert shard.exists() and shard.stat().st_mtime_ns != before
    assert head_data.shard_path(store, "train", 0).stat().st_mtime_ns == other
    with pytest.raises(ValueError, match="other settings"):
        head_data.precompute(target, tokens, store, head_data.PrecomputeConfig(window=16))


def train_head(kind, target, store, run_dir, steps=25, bf16=False):
    """A head trained `steps` steps on the store; its loss terms on its training windows
    before and after."""
    data = head_train.HeadData(head_data.load_split(store, "train"))
    torch.manual_seed(0)
    tokens = data.tokens.numpy()
    draft_ids = head_train.draft_vocabulary(tokens, 200) if kind == "eagle3" else None
    head = head_train.build_head(kind, target, draft_ids, CFG.aux_layers)
    loss = head_train.HeadLoss.default(kind)
    before = head_train.heldout_metrics(head, data, loss)
    cfg = TrainConfig(
        minutes=10,
        lr=3e-3,
        warmup_steps=1,
        final_lr_ratio=1.0,  # a constant rate
        batch=4,
        seq=WINDOW - 1,
        max_steps=steps,
        bf16=bf16,
    )
    sampler = head_train.IndexSampler(len(data), cfg.batch, seed=0)
    loss_fn = functools.partial(head_train.training_loss, head, data, loss)
    train(head, loss_fn, sampler, cfg, run_dir)
    return head, before, head_train.heldout_metrics(head, data, loss)


@pytest.mark.parametrize("kind", head_train.KINDS)
def test_a_few_steps_lower_the_loss(kind, target, store, tmp_path):
    head, before, after = train_head(kind, target, store, tmp_path)
    assert after["loss"] < 0.8 * before["loss"]
    ce = "ce0" if kind == "eagle3" else "ce"  # EAGLE-3: each unrolled step's, the first here
    assert after[ce] < before[ce]
    assert not any(p.requires_grad for p in target.parameters())


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_bfloat16_autocast_trains_as_well(kind, target, store, tmp_path):
    """The forward under bfloat16 autocast (weights and optimiser float32): the loss falls as
    far as in float32, within a tenth."""
    (tmp_path / "fp32").mkdir()
    (tmp_path / "bf16").mkdir()
    _, before, plain = train_head(kind, target, store, tmp_path / "fp32")
    _, _, autocast = train_head(kind, target, store, tmp_path / "bf16", bf16=True)
    assert autocast["loss"] < 0.8 * before["loss"]
    assert abs(autocast["loss"] - plain["loss"]) < 0.1 * plain["loss"]


@torch.no_grad()
def test_training_time_test_equals_drafting_a_chain(target, store):
    """Step j of EAGLE-3's unrolled training at column i is the head run densely over the
    committed pairs 0 .. i, then over its own outputs paired with the next true tokens: what
    the drafter computes when every earlier draft was right."""
    from tests.tiny import random_eagle3_head

    data = head_train.HeadData(head_data.load_split(store, "train"))
    head = random_eagle3_head(target, (1, 2), draft_vocab=200)
    batch = data.batch(torch.tensor([0]))
    steps, outputs = 3, []
    original = head.forward

    def recording(*args):
        out = original(*args)
        outputs.append(out)
        return out

    head.forward = recording
    head_train.eagle3_terms(head, batch, steps)
    head.forward = original
    tokens, fused = batch["tokens"][0], head.fuse(batch["aux"][0])  # [S], [S, H]
    for i in (0, 5, WINDOW - 2 - steps):
        ids, features = tokens[1 : i + 2], fused[: i + 1]
        for j in range(steps):
            n = len(ids)
            dense = head(ids, features, torch.arange(n), CausalAttention(1, n))[-1]
            torch.testing.assert_close(outputs[j][i], dense, atol=1e-4, rtol=1e-4)
            ids = torch.cat([ids, tokens[i + 2 + j : i + 3 + j]])
            features = torch.cat([features, dense[None]])


def test_only_the_heads_weights_are_trained_and_exported(target, store, tmp_path):
    embed = target.embed_tokens.weight.clone()
    head, _, _ = train_head("eagle", target, store, tmp_path, steps=2)
    assert torch.equal(target.embed_tokens.weight, embed)
    export_head(head, tmp_path / "head", torch.bfloat16)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["eagle_norms"] is True and config["num_hidden_layers"] == 1


@pytest.fixture(scope="module")
def trained_heads(target, store, tmp_path_factory):
    """Exported eagle and mtp heads, trained a few steps: kind -> directory."""
    out = {}
    for kind in ("eagle", "mtp"):
        run = tmp_path_factory.mktemp(kind)
        head, _, _ = train_head(kind, target, store, run)
        export_head(head, run / "head", torch.float32)
        out[kind] = run / "head"
    return out


@pytest.mark.parametrize("kind", ["eagle", "mtp"])
async def test_validation_is_the_engines(kind, tiny_target, trained_heads, monkeypatch):
    """The validation loads the head into the engine, and reports what the engine's own
    usage counters show for the same requests."""
    import engine.builder as builder

    loaded = []
    name = "load_mtp_head" if kind == "mtp" else "load_eagle_head"
    original = getattr(builder, name)

    def spy(directory, model):
        loaded.append(str(directory))
        return original(directory, model)

    monkeypatch.setattr(builder, name, spy)
    prompts = [list(range(1, 12)), [5, 9, 200]]
    config = head_validate.engine_config(tiny_target, kind, trained_heads[kind], 3, 4)
    result = await head_validate.engine_acceptance(config, prompts, 16)
    assert loaded == [str(trained_heads[kind])]

    from core.params import SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    steps = accepted = 0
    async with running(config) as engine:
        for prompt in prompts:
            usage = (await engine.generate(prompt, params))[-1].usage
            steps, accepted = steps + usage.spec_steps, accepted + usage.accepted_tokens
    assert result["acceptance_length"] == pytest.approx((steps + accepted) / steps)
    counters = result["counters"]
    assert counters["accepted_tokens"] == result["usage"]["accepted_tokens"] == accepted
    assert sum(counters["accepted_per_position"]) == accepted
    assert len(result["top1_given_previous"]) == 3


def test_learning_curve_subsets_nest():
    def shard(first, n):  # window w holds tokens (2w, 2w + 1)
        return {
            "tokens": torch.arange(2 * first, 2 * (first + n)).reshape(n, 2),
            "hidden": torch.zeros(n, 2, 4),
            "topk_logits": torch.zeros(n, 2, 3),
            "topk_ids": torch.zeros(n, 2, 3, dtype=torch.int32),
        }

    data = head_train.HeadData([shard(0, 8), shard(8, 8), shard(16, 4)])
    sizes = {f: data.subset(f, seed=5) for f in (0.125, 0.25, 0.5, 1.0)}
    firsts = {f: {int(t) for t in d.tokens[:, 0]} for f, d in sizes.items()}
    assert [len(d) for d in sizes.values()] == [2, 5, 10, 20]
    assert firsts[0.125] <= firsts[0.25] <= firsts[0.5] <= firsts[1.0]
    assert data.batch(torch.tensor([19, 3, 8]))["tokens"].tolist() == [[38, 39], [6, 7], [16, 17]]
    assert set(data.without("hidden").batch(torch.tensor([0]))) == {
        "tokens",
        "topk_logits",
        "topk_ids",
    }
    with pytest.raises(ValueError, match="fraction"):
        data.subset(0, seed=0)


def test_train_command_runs_epochs_and_exports_the_best_checkpoint(
    target, tiny_target, store, tmp_path
):
    """--epochs sets the steps from the data's size; the exported head is the checkpoint with
    the lowest validation loss, which train.json names."""
    from models.mtp import load_mtp_head
    from train import heads
    from train.loop import BEST

    run = store.parent
    out = tmp_path / "head"
    argv = ["--threads", "1", "train", "--run-dir", str(run), "--target", str(tiny_target),
            "--kind", "mtp", "--batch", "2", "--fraction", "0.5", "--epochs", "3",
            "--checkpoint-minutes", "0", "--minutes", "10", "--out", str(out)]  # fmt: skip
    heads.main(argv)
    summary = json.loads((run / heads.HEADS_DIR / "mtp" / "train.json").read_text())
    assert summary["windows"] == 4 and summary["steps"] == 6  # 8 windows, half, 3 epochs of 2
    assert 1 <= summary["best_step"] <= 6 and (run / heads.HEADS_DIR / "mtp" / BEST).exists()
    best = torch.load(run / heads.HEADS_DIR / "mtp" / BEST)
    exported = load_mtp_head(out, target).state_dict()
    name = next(n for n in best if n in exported and best[n].dim() == 2)
    assert torch.allclose(exported[name].float(), best[name].float(), atol=1e-2)
