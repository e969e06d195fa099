"""Drafter training: block layout vs brute force, a tiny end-to-end run, exact resume, bad input."""
import copy
import json

import pytest
import torch

from castspec.cli import main
from castspec.config import DecodeConfig
from castspec.decode import decode
from castspec.models.draft_vocab import save_draft_vocab
from castspec.models.load import load_drafter
from castspec.train.blocks import (block_inputs, block_mask, chain_acceptance, parse_window_schedule, teacher_rows,
    window_at)
from castspec.prompts import FOLLOW_UPS, FOLLOW_UPS_ANY, Prompt, follow_ups
from castspec.sampling import mix_seed
from castspec.train.datagen import (PROMPTS_FILE, DataGenConfig, answered_prompts, batched_generate, encode_prompt,
    generate_dataset, load_prompts, load_records, self_written_prompts, shard_files)
from castspec.train.diagnose import diagnose, ngram_baselines
from castspec.train.replay import committed_per_round, replay_r, walk
from castspec.train.trainer import (BatchFeed, TrainConfig, TrainError, TrainState, decay_weights, draw_anchors,
    drafter_config_for, init_drafter, scale_fc_init, sequence_loss, target_features, target_pass, train)
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer


@pytest.mark.parametrize("window", [0, 1, 3])
def test_block_mask_matches_brute_force(window):
    anchors = torch.tensor([3, 4, 9])
    T, bs = 12, 4
    m = block_mask(anchors, T, bs, window)
    for q in range(len(anchors) * bs):
        blk = q // bs
        for k in range(T + len(anchors) * bs):
            if k < T:
                a = int(anchors[blk])
                expect = k < a and (window == 0 or k >= a - window)
            else:
                expect = (k - T) // bs == blk
            assert bool(m[q, k]) == expect, (q, k)


def test_window_schedule():
    sched = parse_window_schedule("8:200, 64:400")
    assert sched == [(8, 200), (64, 400)]
    assert [window_at(sched, s) for s in (0, 199, 200, 399, 400, 10_000)] == [8, 8, 64, 64, 0, 0]
    assert parse_window_schedule("") == []
    for bad in ("8", "8:x", "0:10", "8:200,64:100"):
        with pytest.raises(ValueError):
            parse_window_schedule(bad)


def test_bad_context_window_is_a_one_line_error(tmp_path, capsys):
    assert main(["train-drafter", "--data", str(tmp_path), "--out", str(tmp_path / "o"),
                 "--context-window", "8"]) == 2
    assert "--context-window" in capsys.readouterr().err


def test_block_inputs_and_acceptance():
    tokens = torch.arange(10, 20)
    loss_mask = torch.arange(10) >= 4
    ids, pos, labels = block_inputs(tokens, torch.tensor([4, 8]), 4, 99, loss_mask)
    assert ids.tolist() == [[14, 99, 99, 99], [18, 99, 99, 99]]
    assert pos.tolist() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert labels.tolist() == [[15, 16, 17], [19, -100, -100]]
    pred = torch.tensor([[15, 0, 17], [19, 5, 5]])
    assert chain_acceptance(pred, labels).tolist() == [2, 2]


@pytest.fixture(scope="module")
def tiny_data():
    target = native(make_hf(llama_config(vocab=32, num_hidden_layers=4), seed=3))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 31, (int(torch.randint(3, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(24)]
    responses = batched_generate(target, prompts, 40, stop_ids=set())
    return target, [{"prompt_ids": p, "response_ids": r} for p, r in zip(prompts, responses)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_generate_equals_each_prompts_own_decode(tiny_data, temperature):
    # continuous batching (3 at a time, newcomers prefilled beside the others' steps) changes no prompt's tokens:
    # greedy, and sampled with seed 7 + i for prompt i; stop tokens are kept and end a response
    target, records = tiny_data
    prompts = [r["prompt_ids"] for r in records[:7]]
    stops = {5, 9}
    got = batched_generate(target, prompts, 25, stops, temperature=temperature, seeds=[7 + i for i in range(7)],
                           batch_size=3, prefill_budget=8)
    for i, (p, out) in enumerate(zip(prompts, got)):
        cfg = DecodeConfig(method="ar", max_new_tokens=25, temperature=temperature,
                           seed=7 + i if temperature else None, stop_token_ids=tuple(sorted(stops)))
        assert out == [t for c in decode(target, None, p, cfg) for t in c]
    assert any(out[-1] in stops for out in got) and any(len(out) == 25 for out in got)


ROPE = {"rope_type": "default", "rope_theta": 10000.0}


def tiny_config(**kw):
    base = dict(steps=30, seqs_per_step=2, anchors_per_seq=6, block_size=6, num_layers=2, num_taps=2,
                mask_token_id=31, lr=3e-3, warmup=5, bf16=False, checkpoint_every=10, export_every=30)
    base.update(kw)
    return TrainConfig(**base)


def test_tiny_training_learns_and_decodes_exactly(tiny_data, tmp_path):
    target, records = tiny_data
    state = train(target, records, tmp_path, tiny_config(steps=60, lr=1e-2), ROPE, progress=False)
    losses = [h["loss"] for h in state.history]
    assert losses[-1] < 0.8 * losses[0]  # a clear drop (random tiny targets leave a high floor)
    drafter = load_drafter(tmp_path / "drafter", target, dtype=torch.float32)
    for rec in records[:4]:
        cfg = dict(max_new_tokens=30)
        ar = [t for c in decode(target, None, rec["prompt_ids"], DecodeConfig(method="ar", **cfg)) for t in c]
        for method in ("chain", "cast"):
            out = [t for c in decode(target, drafter, rec["prompt_ids"], DecodeConfig(method=method, width=15, **cfg))
                   for t in c]
            assert out == ar


def _one_sequence(tiny_data, kl_weight: float):
    """A fresh drafter and the first record's anchors, config and position weights: one sequence's loss inputs."""
    target, records = tiny_data
    cfg = tiny_config(kl_weight=kl_weight)
    drafter = init_drafter(target, drafter_config_for(target, cfg, ROPE), from_target=False, seed=0)
    anchors = draw_anchors(records[0], cfg, torch.Generator().manual_seed(0))
    return target, records, cfg, drafter, anchors, decay_weights(cfg.block_size - 1, cfg.gamma)


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_a_draft_vocabulary_of_every_token_leaves_the_loss_unchanged(tiny_data, kl_weight):
    target, records, cfg, drafter, anchors, weights = _one_sequence(tiny_data, kl_weight)
    full, acc = sequence_loss(target, drafter, records[0], anchors, cfg, weights)
    drafter.set_draft_vocab(torch.arange(target.cfg.vocab_size))
    every, acc_every = sequence_loss(target, drafter, records[0], anchors, cfg, weights)
    torch.testing.assert_close(every, full)
    assert acc_every == acc


@pytest.mark.parametrize("kl_weight", [0.0, 0.5])
def test_a_cut_block_is_the_loss_of_a_drafter_with_that_block_size(tiny_data, kl_weight):
    # --short-blocks: a sequence's blocks cut to N rows train exactly as a drafter of block size N would (the same
    # weights, the first N - 1 position weights); uncut, the loss is the whole block's
    target, records, cfg, drafter, anchors, weights = _one_sequence(tiny_data, kl_weight)
    whole, _ = sequence_loss(target, drafter, records[0], anchors, cfg, weights)
    same, _ = sequence_loss(target, drafter, records[0], anchors, cfg, weights, block_rows=cfg.block_size)
    cut, _ = sequence_loss(target, drafter, records[0], anchors, cfg, weights, block_rows=3)
    small = copy.copy(drafter)
    small.cfg = copy.copy(drafter.cfg)
    small.cfg.block_size = 3
    ref, _ = sequence_loss(target, small, records[0], anchors, cfg, weights[:2])
    torch.testing.assert_close(same, whole)
    torch.testing.assert_close(cut, ref)
    assert not torch.allclose(cut, whole)


def test_short_blocks_are_drawn_for_their_share_of_sequences_and_leave_other_runs_as_they_were(tiny_data):
    _, records = tiny_data
    draws = {}
    for share in (0.0, 0.5):
        cfg = tiny_config(short_blocks=share, seqs_per_step=8)
        feed = BatchFeed(records, cfg, TrainState(), torch.Generator().manual_seed(0))
        draws[share] = [item for _ in range(8) for item in feed.next()]
    cuts = [cut for _, _, cut in draws[0.5]]
    assert set(cuts) == {None, 3} and 0.25 < cuts.count(3) / len(cuts) < 0.75
    assert all(cut is None for _, _, cut in draws[0.0])
    # without the share the generator draws only anchors: the batches are those of runs before the option
    first = draw_anchors(draws[0.0][0][0], tiny_config(), torch.Generator().manual_seed(0))
    assert torch.equal(draws[0.0][0][1], first)


def test_training_on_a_draft_vocabulary_ignores_other_tokens_and_ships_it(tiny_data, tmp_path):
    target, records = tiny_data
    vocab = torch.arange(0, target.cfg.vocab_size, 2)  # even tokens only
    src = tmp_path / "vocab"
    src.mkdir()
    save_draft_vocab(src, vocab)
    cfg = tiny_config(steps=40, lr=1e-2, draft_vocab=str(src))
    drafter = init_drafter(target, drafter_config_for(target, cfg, ROPE), from_target=False, seed=0)
    drafter.set_draft_vocab(vocab)
    anchors = draw_anchors(records[0], cfg, torch.Generator().manual_seed(0))
    # odd labels carry no loss: a record whose response is all odd tokens has none at all
    odd = dict(records[0], response_ids=[t | 1 for t in records[0]["response_ids"]])
    zero, _ = sequence_loss(target, drafter, odd, anchors, cfg, decay_weights(cfg.block_size - 1, cfg.gamma))
    assert zero.item() == 0.0
    state = train(target, records, tmp_path / "run", cfg, ROPE, progress=False)
    losses = [h["loss"] for h in state.history]
    assert losses[-1] < 0.8 * losses[0]
    shipped = load_drafter(tmp_path / "run" / "drafter", target, dtype=torch.float32)
    assert torch.equal(shipped.draft_vocab, vocab)
    rec = records[1]
    ar = [t for c in decode(target, None, rec["prompt_ids"], DecodeConfig(method="ar", max_new_tokens=30)) for t in c]
    out = [t for c in decode(target, shipped, rec["prompt_ids"], DecodeConfig(method="cast", width=15,
                                                                                  max_new_tokens=30)) for t in c]
    assert out == ar
    with pytest.raises(TrainError, match="draft-vocab"):
        train(target, records, tmp_path / "bad", tiny_config(draft_vocab=str(tmp_path)), ROPE, progress=False)


@pytest.mark.parametrize("nb", [3, 5, 8])
def test_block_rows_attending_in_groups_equal_all_rows_over_all_keys(tiny_data, nb):
    # training's grouped attention (DraftSegment.group_rows) skips only keys the block mask hides: the hidden
    # states and the gradients equal the pass over every key, with whole groups, a partial last one, or one group
    target, _ = tiny_data
    drafter = init_drafter(target, drafter_config_for(target, tiny_config(block_size=4), ROPE), from_target=False, seed=0)
    T, bs, H = 30, 4, target.cfg.hidden_size
    gen = torch.Generator().manual_seed(nb)
    anchors = torch.sort(torch.randperm(T - 10, generator=gen)[:nb] + 8).values
    mask = block_mask(anchors, T, bs, window=6).view(1, 1, -1, T + nb * bs)
    emb = torch.randn(1, nb * bs, H, generator=gen)
    pos = torch.randint(0, T, (1, nb * bs), generator=gen)
    feats = torch.randn(1, T, len(drafter.cfg.target_layer_ids) * H, generator=gen)

    def run(group_rows):
        drafter.zero_grad()
        out = drafter(emb, pos, feats, torch.arange(T).view(1, -1), mask=mask, group_rows=group_rows)
        out.pow(2).sum().backward()
        return out.detach(), [p.grad.clone() for p in drafter.parameters()]

    dense, dense_grads = run(0)
    for group_rows in (bs, 2 * bs, 3 * bs):
        grouped, grads = run(group_rows)
        torch.testing.assert_close(grouped, dense, rtol=1e-5, atol=1e-5)
        for g, ref in zip(grads, dense_grads):
            torch.testing.assert_close(g, ref, rtol=1e-4, atol=1e-4)


def test_every_drafter_parameter_gets_a_gradient(tiny_data):
    # The fused q|k|v and gate|up matrices alias the named Parameters; a forward that used the fused tensor
    # directly left those Parameters without gradients (they never trained) while the loss still fell.
    target, records = tiny_data
    cfg = tiny_config()
    drafter = init_drafter(target, drafter_config_for(target, cfg, ROPE), from_target=False, seed=0)
    anchors = draw_anchors(records[0], cfg, torch.Generator().manual_seed(0))
    loss, _ = sequence_loss(target, drafter, records[0], anchors, cfg, decay_weights(cfg.block_size - 1, cfg.gamma))
    loss.backward()
    missing = [n for n, p in drafter.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing
    with torch.no_grad():  # inference still runs on the fused tensors, which must stay aliased
        drafter.layers[0].self_attn.k_proj.weight.add_(1.0)
        drafter.layers[0].mlp.up_proj.weight.add_(1.0)
    k_rows = slice(target.cfg.num_heads * target.cfg.head_dim, None)
    assert torch.equal(drafter.layers[0].self_attn.qkv_weight[k_rows][:drafter.layers[0].self_attn.k_proj.weight.shape[0]],
                       drafter.layers[0].self_attn.k_proj.weight)
    assert torch.equal(drafter.layers[0].mlp.gate_up_weight.chunk(2)[1], drafter.layers[0].mlp.up_proj.weight)


def test_teacher_distributions_line_up_with_the_labels(tiny_data):
    """The target's next-token distributions for the KL loss sit where the labels are: on greedy data (the
    target's own responses) their argmax is the label at every labelled block position, and each row is a
    normalized distribution; the features are those of the plain feature pass."""
    target, records = tiny_data
    cfg = tiny_config()
    bs = cfg.block_size
    for i, rec in enumerate(records[:4]):
        tokens = torch.tensor(rec["prompt_ids"] + rec["response_ids"])
        anchors = draw_anchors(rec, cfg, torch.Generator().manual_seed(i))
        feats, teacher = target_pass(target, tokens, [0, 2], teacher_rows(anchors, bs, tokens.numel()))
        assert torch.equal(feats, target_features(target, tokens, [0, 2]))
        _, _, labels = block_inputs(tokens, anchors, bs, 31, torch.arange(tokens.numel()) >= len(rec["prompt_ids"]))
        assert teacher.shape == (*labels.shape, 32)
        assert torch.equal(teacher.argmax(-1)[labels >= 0], labels[labels >= 0]) and (labels >= 0).any()
        assert torch.allclose(teacher.logsumexp(-1), torch.zeros(labels.shape), atol=1e-5)
        even = torch.arange(0, 32, 2)  # over a draft vocabulary: the same distributions, renormalized over it
        _, on_even = target_pass(target, tokens, [0, 2], teacher_rows(anchors, bs, tokens.numel()), even)
        torch.testing.assert_close(on_even, torch.log_softmax(teacher[..., even], dim=-1), atol=1e-5, rtol=1e-5)


def test_kl_loss_mixes_linearly_with_cross_entropy_and_trains(tiny_data, tmp_path):
    target, records = tiny_data
    drafter = init_drafter(target, drafter_config_for(target, tiny_config(), ROPE), from_target=False, seed=0)
    anchors = draw_anchors(records[0], tiny_config(), torch.Generator().manual_seed(0))
    w = decay_weights(tiny_config().block_size - 1, 7.0)
    losses = {a: sequence_loss(target, drafter, records[0], anchors, tiny_config(kl_weight=a), w)[0]
              for a in (0.0, 0.5, 1.0)}
    assert losses[1.0] > 0 and losses[0.5].item() == pytest.approx((losses[0.0] + losses[1.0]).item() / 2, rel=1e-5)
    losses[1.0].backward()
    assert all(p.grad is not None for p in drafter.parameters())
    state = train(target, records, tmp_path / "kl", tiny_config(steps=40, lr=1e-2, kl_weight=0.5), ROPE,
                  progress=False)
    assert state.history[-1]["loss"] < 0.8 * state.history[0]["loss"]
    with pytest.raises(TrainError, match="kl-weight must be between 0 and 1"):
        train(target, records, tmp_path / "bad", tiny_config(kl_weight=1.5), ROPE, progress=False)
    with pytest.raises(TrainError, match="gamma must be positive"):
        train(target, records, tmp_path / "bad", tiny_config(gamma=0.0), ROPE, progress=False)


def test_scaled_fc_init_evens_out_feature_sizes(tiny_data):
    target, records = tiny_data
    cfg = tiny_config()
    drafter = init_drafter(target, drafter_config_for(target, cfg, ROPE), from_target=False, seed=0)
    before = drafter.fc.weight.detach().clone()
    scale_fc_init(target, drafter, records[:4], 64)
    feats = torch.cat([target_features(target, torch.tensor(r["prompt_ids"] + r["response_ids"]),
                                       drafter.cfg.target_layer_ids)[0, 1:] for r in records[:4]])
    rms = feats.float().pow(2).mean(0).sqrt()
    ratio = drafter.fc.weight[0] / before[0]
    torch.testing.assert_close(ratio * rms, torch.full_like(rms, rms.median().item()), rtol=1e-4, atol=1e-4)


def test_resume_equals_uninterrupted(tiny_data, tmp_path):
    target, records = tiny_data
    cfg = tiny_config(steps=20, checkpoint_every=10, context_windows="2:5,4:15")  # the curriculum spans the split
    train(target, records, tmp_path / "full", cfg, ROPE, progress=False)
    train(target, records, tmp_path / "split", cfg, ROPE, progress=False, stop_after=10)
    again = train(target, records, tmp_path / "split", cfg, ROPE, progress=False, stop_after=10)
    assert again.step == 10  # rerunning a finished leg trains nothing more
    train(target, records, tmp_path / "split", cfg, ROPE, progress=False)  # resumes at step 10
    a = torch.load(tmp_path / "full" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "split" / "checkpoint.pt", weights_only=False)
    assert a["state"]["step"] == b["state"]["step"] == 20
    for k in a["drafter"]:
        torch.testing.assert_close(a["drafter"][k], b["drafter"][k], rtol=0, atol=0)


def test_bad_training_input(tiny_data, tmp_path):
    target, records = tiny_data
    with pytest.raises(TrainError, match="exceed the target vocabulary"):
        train(target, [{"prompt_ids": [1, 2], "response_ids": [500, 3]}], tmp_path / "a", tiny_config(), ROPE,
              progress=False)
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(TrainError, match="corrupt or unreadable"):
        train(target, records, tmp_path / "b", tiny_config(), ROPE, progress=False)


def test_replay_round_matches_greedy_walk():
    logprobs = torch.log_softmax(torch.tensor([[3.0, 2.0, 0, 0, 0], [0, 3.0, 2.0, 0, 0], [0, 0, 3.0, 0, 2.0]]), -1)
    # chain proposes 0,1,2; the target continues 0,1,4,...: chain commits 2 accepted + 1 = 3
    assert committed_per_round(logprobs, [0, 1, 4, 3], None, 2) == 3
    # a tree with the runner-up at depth 3 commits 0,1,4 + the target's next token
    assert committed_per_round(logprobs, [0, 1, 4, 3], 7, 2) == 4
    # a wrong first token commits only the target's own token
    assert committed_per_round(logprobs, [3, 1, 4, 3], 7, 2) == 1


def test_walk_roots_each_round_where_the_last_ended():
    commits = {10: 3, 13: 1, 14: 2}  # rounds at 11 and 12 would commit 5, but the walk never roots there
    assert walk(lambda a: commits.get(a, 5), 10, 16) == (6, 3)


def test_replay_r_runs_on_a_trained_drafter(tiny_data, tmp_path):
    target, records = tiny_data
    train(target, records, tmp_path, tiny_config(steps=10), ROPE, progress=False)
    drafter = load_drafter(tmp_path / "drafter", target, dtype=torch.float32)
    r = replay_r(target, drafter, [dict(r, domain="x") for r in records[:4]], widths=(3, 15), top_k=4)
    # best-first trees are nested, so a wider one never commits less; every round commits at least one token
    assert r["chain"]["x"] >= 1.0 and 1.0 <= r["cast@3"]["x"] <= r["cast@15"]["x"] + 1e-9
    # the chain accepts position 1 exactly when its top-1 is right, and never more than every position's hits
    acc = r["top1_accuracy_by_position"]
    assert len(acc) == drafter.cfg.num_draft_positions
    assert acc[0] - 1e-9 <= r["chain"]["x"] - 1 <= sum(acc) + 1e-9
    assert r["top1_accuracy_by_position_by_domain"] == {"x": acc}  # one domain: the same counts
    # the walk roots each round where the last one ended and weighs by rounds: between 1 and the longest round
    for key in ("chain", "cast@3", "cast@15"):
        assert 1.0 <= r[f"walk/{key}"]["x"] <= drafter.cfg.num_draft_positions + 1


def test_initialization_options_and_warm_start(tiny_data, tmp_path):
    target, records = tiny_data
    dcfg = drafter_config_for(target, tiny_config(), ROPE)
    d = init_drafter(target, dcfg, from_target=True, seed=0, norm_init="target")
    torch.testing.assert_close(d.norm.weight, target.model.norm.weight.float())
    torch.testing.assert_close(d.layers[-1].mlp.gate_up_weight, target.model.layers[-1].mlp.gate_up_weight.float())
    small = init_drafter(target, dcfg, from_target=False, seed=0, norm_init="small")
    assert small.norm.weight.abs().max() < 0.5 * d.norm.weight.abs().mean()
    # warm start: a run initialized from an exported drafter starts from exactly its weights
    train(target, records, tmp_path / "a", tiny_config(steps=10), ROPE, progress=False)
    state = train(target, records, tmp_path / "b", tiny_config(steps=1, lr=0.0, init_from=str(tmp_path / "a" / "drafter")),
                  ROPE, progress=False)
    assert state.step == 1
    a = load_drafter(tmp_path / "a" / "drafter", target, dtype=torch.float32).state_dict()
    b = load_drafter(tmp_path / "b" / "drafter", target, dtype=torch.float32).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k])
    start = str(tmp_path / "a" / "drafter")
    with pytest.raises(TrainError, match="cannot warm-start"):  # other taps: fc does not fit
        train(target, records, tmp_path / "c", tiny_config(steps=1, tap_layers=[0, 2], init_from=start), ROPE,
              progress=False)
    # another block size: the same weights (a block is the root and its mask rows, none has weights of its own)
    train(target, records, tmp_path / "k", tiny_config(steps=1, lr=0.0, block_size=5, init_from=start), ROPE,
          progress=False)
    k = load_drafter(tmp_path / "k" / "drafter", target, dtype=torch.float32)
    assert k.cfg.block_size == 5 and k.cfg.num_draft_positions == 4
    for key in a:
        torch.testing.assert_close(a[key], k.state_dict()[key])
    with pytest.raises(TrainError, match="cannot warm-start"):  # fewer layers than the start: nothing to grow
        train(target, records, tmp_path / "c", tiny_config(steps=1, num_layers=1, init_from=start), ROPE,
              progress=False)
    # growing: a 3-layer run from the 2-layer drafter starts as exactly that drafter (its new layer adds zero)
    train(target, records, tmp_path / "g", tiny_config(steps=1, lr=0.0, num_layers=3, init_from=start), ROPE,
          progress=False)
    g = load_drafter(tmp_path / "g" / "drafter", target, dtype=torch.float32)
    assert g.cfg.num_layers == 3
    for k in a:
        torch.testing.assert_close(a[k], g.state_dict()[k])
    assert not g.layers[2].self_attn.o_proj.weight.any() and not g.layers[2].mlp.down_proj.weight.any()
    assert g.layers[2].mlp.gate_up_weight.any()  # the rest of the new layer is random, so that it can learn
    old = load_drafter(tmp_path / "a" / "drafter", target, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    H, T, C = old.cfg.hidden_size, old.cfg.block_size, 4
    args = (torch.randn(1, T, H, generator=gen), torch.arange(C, C + T)[None],
            torch.randn(1, C, len(old.cfg.target_layer_ids) * H, generator=gen), torch.arange(C)[None])
    with torch.inference_mode():
        torch.testing.assert_close(g(*args), old(*args))
    # growing its taps: [1, 1] -> [0, 1, 2, 1]; the old taps keep their fc columns, the new ones start at zero,
    # so the grown drafter fuses the same context rows from the wider features
    train(target, records, tmp_path / "t", tiny_config(steps=1, lr=0.0, tap_layers=[0, 1, 2, 1], init_from=start),
          ROPE, progress=False)
    t = load_drafter(tmp_path / "t" / "drafter", target, dtype=torch.float32)
    assert t.cfg.target_layer_ids == [0, 1, 2, 1]
    for k in a:
        if k != "fc.weight":
            torch.testing.assert_close(a[k], t.state_dict()[k])
    fc_old, fc_new = a["fc.weight"], t.fc.weight
    torch.testing.assert_close(fc_new[:, H:2 * H], fc_old[:, :H])
    torch.testing.assert_close(fc_new[:, 3 * H:], fc_old[:, H:])
    assert not fc_new[:, :H].any() and not fc_new[:, 2 * H:3 * H].any()
    wide = torch.randn(1, C, 4 * H, generator=gen)
    narrow = torch.cat([wide[..., H:2 * H], wide[..., 3 * H:]], dim=-1)
    with torch.inference_mode():
        torch.testing.assert_close(t(args[0], args[1], wide, args[3]), old(args[0], args[1], narrow, args[3]))
    with pytest.raises(TrainError, match="cannot warm-start"):  # [1, 1] is not a subsequence of [1, 0]
        train(target, records, tmp_path / "u", tiny_config(steps=1, tap_layers=[1, 0], init_from=start), ROPE,
              progress=False)


def test_ngram_baselines_known_answer():
    train = [{"prompt_ids": [9], "response_ids": [1, 2, 3, 1, 2, 3, 1, 2]}]
    test = [{"prompt_ids": [9], "response_ids": [1, 2, 3, 1]}]
    out = ngram_baselines(train, test)
    # unigram: 1 (ties go to the first seen) hits 2 of 4; every bigram and trigram context of the test was seen
    assert out["unigram"] == 0.5 and out["bigram"] == 1.0 and out["trigram"] == 1.0


def test_diagnose_drafter(tiny_data, tmp_path, capsys):
    target, records = tiny_data
    train(target, records, tmp_path / "run", tiny_config(steps=4), ROPE, progress=False)
    drafter = load_drafter(tmp_path / "run" / "drafter", target, dtype=torch.float32)
    with torch.inference_mode():
        report = diagnose(target, drafter, records, test_records=6)
    assert report["test_records"] == 6 and set(report["ngram_top1"]) == {"unigram", "bigram", "trigram"}
    acc = report["drafter_top1_by_position"]
    assert len(acc) == drafter.cfg.num_draft_positions and all(0 <= a <= 1 for a in acc)
    assert report["replay_R"]["chain"] >= 1.0
    assert main(["diagnose-drafter", "--data", str(tmp_path / "nothing"), "--drafter", "x"]) == 2
    assert "no training data" in capsys.readouterr().err


def test_draft_vocab_command(tiny_data, tmp_path, capsys):
    target, records = tiny_data
    make_hf(llama_config(vocab=32, num_hidden_layers=4), seed=3).save_pretrained(tmp_path / "target")
    (tmp_path / "data" / "shards").mkdir(parents=True)
    torch.save(records, tmp_path / "data" / "shards" / "shard-00000.pt")
    train(target, records, tmp_path / "run", tiny_config(steps=2), ROPE, progress=False)
    drafter_dir = tmp_path / "run" / "drafter"
    args = ["draft-vocab", "--drafter", str(drafter_dir), "--data", str(tmp_path / "data"),
            "--target", str(tmp_path / "target")]
    assert main(args + ["--size", "12"]) == 0
    report = json.loads(capsys.readouterr().out)
    vocab = load_drafter(drafter_dir, target).draft_vocab
    assert report["draft_vocab"] == 12 == len(vocab)
    counts = torch.bincount(torch.tensor([t for r in records for t in r["response_ids"]]), minlength=32)
    assert report["train_coverage"] == pytest.approx(counts[vocab].sum().item() / counts.sum().item())
    assert counts[vocab].min() >= counts.sort(descending=True).values[11]  # the 12 most frequent tokens
    # --grow keeps the current vocabulary (even its rarest tokens) and adds the most frequent others; datasets
    # given as a comma list count together
    rare = torch.tensor(sorted(counts.sort().indices[:5].tolist()))
    save_draft_vocab(drafter_dir, rare)
    both = str(tmp_path / "data") + "," + str(tmp_path / "data")
    grow = ["draft-vocab", "--drafter", str(drafter_dir), "--data", both, "--target", str(tmp_path / "target")]
    assert main(grow + ["--size", "12", "--grow"]) == 0
    grown = load_drafter(drafter_dir, target).draft_vocab
    assert len(grown) == 12 and set(rare.tolist()) <= set(grown.tolist())
    assert json.loads(capsys.readouterr().out)["train_coverage"] == pytest.approx(
        counts[grown].sum().item() / counts.sum().item())
    assert main(grow + ["--size", "4", "--grow"]) == 2 and "larger than --size" in capsys.readouterr().err
    assert main(args + ["--size", "0"]) == 0 and load_drafter(drafter_dir, target).draft_vocab is None
    capsys.readouterr()
    for bad, msg in [(["--size", "33"], "--size must be"), (["--data", str(tmp_path)], "no training data"),
                     (["--drafter", str(tmp_path)], "not a drafter directory"),
                     (["--size", "12", "--grow"], "no draft vocabulary to grow")]:
        assert main(args + bad) == 2
        assert msg in capsys.readouterr().err


def test_decoding_rounds_draft_what_the_training_layout_shows(tiny_data):
    """Train/serve consistency: at every round of real decoding (`cast`, so the context grows by accepted tree
    paths and compactions), the drafter's marginals equal those of the training layout (one feature pass over
    the final sequence, the block anchored at the round's root, context strictly before it)."""
    target, records = tiny_data
    drafter = random_drafter(target, block_size=6, seed=4)
    L = drafter.cfg.num_draft_positions
    for rec in records[:3]:
        prompt, emitted, rounds = rec["prompt_ids"], [], []

        def on_round(logprobs, tree, path, new):
            rounds.append((len(prompt) + len(emitted) - 1, logprobs.clone()))  # (root position, marginals)
            emitted.extend(new)

        first = True
        for chunk in decode(target, drafter, prompt, DecodeConfig(method="cast", width=7, max_new_tokens=30),
                            on_round=on_round):
            if first:
                emitted.extend(chunk)
                first = False
        assert len(rounds) >= 3
        tokens = torch.tensor(prompt + emitted)
        T = tokens.numel()
        feats = target_features(target, tokens, drafter.cfg.target_layer_ids)
        anchors = torch.tensor([a for a, _ in rounds])
        ids, pos, _ = block_inputs(tokens, anchors, L + 1, drafter.cfg.mask_token_id, torch.ones(T, dtype=torch.bool))
        mask = block_mask(anchors, T, L + 1).view(1, 1, -1, T + ids.numel())
        with torch.no_grad():
            hidden = drafter(target.embed(ids.view(1, -1)), pos.view(1, -1), feats, torch.arange(T).view(1, -1),
                             mask=mask).view(anchors.numel(), L + 1, -1)[:, 1:]
            teacher = drafter.draft_logprobs(hidden, target)
        for b, (_, lp) in enumerate(rounds):
            torch.testing.assert_close(lp, teacher[b, :lp.shape[0]], atol=2e-4, rtol=1e-4)


def test_dataset_shards_do_not_depend_on_grouping_parts_or_resume(tmp_path):
    # several shards decoded in one continuous batch, or one at a time, in two parts, or resumed after a lost
    # shard: the same records (sampled at T = 1, so the seeds must follow the prompts, not the calls)
    target = native(make_hf(llama_config(vocab=24), seed=1))
    tok = tiny_tokenizer(24)
    prompts = [Prompt("chat", "t", " ".join(f"w{(3 * i + j) % 20 + 1}" for j in range(i % 4 + 1)), f"p{i}")
               for i in range(10)]

    def make(out, shards_per_call, parts=((0, 1),)):
        cfg = DataGenConfig(max_new_tokens=12, batch_size=3, temperature=1.0, seed=5, shards_per_call=shards_per_call)
        for part in parts:
            generate_dataset(target, tok, prompts, out, cfg, stop_ids={0}, part=part)
        return [torch.load(f, weights_only=True) for f in shard_files(out)]

    one = make(tmp_path / "one", 1)
    assert len(one) == 4 and sum(len(s) for s in one) == 10
    assert make(tmp_path / "grouped", 3) == one
    assert make(tmp_path / "parts", 2, parts=((1, 2), (0, 2))) == one
    shard_files(tmp_path / "grouped")[1].unlink()
    assert make(tmp_path / "grouped", 3) == one


def test_self_written_prompts_are_the_targets_whole_distinct_user_turns(tmp_path):
    # the target continues its template where a user's text begins; kept: turns it ended itself, 3+ words, distinct
    target = native(make_hf(llama_config(vocab=24), seed=1))
    tok = tiny_tokenizer(24)
    prompts = self_written_prompts(target, tok, 40, seed=4, stop_ids={0}, temperature=1.0, max_tokens=8, batch_size=7)
    assert prompts == self_written_prompts(target, tok, 40, seed=4, stop_ids={0}, temperature=1.0, max_tokens=8)
    assert prompts != self_written_prompts(target, tok, 40, seed=5, stop_ids={0}, temperature=1.0, max_tokens=8)
    start = tok("<user>", add_special_tokens=False)["input_ids"]
    raw = [batched_generate(target, [start], 8, {0}, 1.0, seeds=[mix_seed(4, k)])[0] for k in range(40)]
    whole = [(k, tok.decode(ids, skip_special_tokens=True).strip()) for k, ids in enumerate(raw) if ids[-1] == 0]
    expect, seen = [], set()
    for k, text in whole:
        if len(text.split()) >= 3 and text.lower() not in seen:
            seen.add(text.lower())
            expect.append((f"self/4/{k}", text))
    assert 0 < len(expect) < 40 and len(whole) < 40  # some turns were cut off, some kept
    assert [(p.id, p.text) for p in prompts] == expect
    assert all(p.domain == "chat" and p.source == "self" and p.chat for p in prompts)
    # leads, taken in turn: the turns begin with theirs, the target writes the rest from there
    leads = ("w5 ", "w6 w7 ")
    led = self_written_prompts(target, tok, 40, seed=4, stop_ids={0}, temperature=1.0, max_tokens=8, leads=leads)
    starts = [tok("<user> " + lead, add_special_tokens=False)["input_ids"] for lead in leads]
    raw = [batched_generate(target, [starts[k % 2]], 8, {0}, 1.0, seeds=[mix_seed(4, k)])[0] for k in range(40)]
    texts = {f"self/4/{k}": (leads[k % 2] + tok.decode(ids, skip_special_tokens=True)).strip()
             for k, ids in enumerate(raw)}
    assert {p.text.split()[0] for p in led} == {"w5", "w6"} and all(p.text == texts[p.id] for p in led)


def test_make_data_self_written_prompts_are_kept_and_followed_up(tmp_path, capsys):
    # make-data --prompts self draws once into OUT/prompts.jsonl; a rerun resumes on the same prompts, and
    # --follow-up continues the conversations from that file
    target = tmp_path / "target"
    make_hf(llama_config(vocab=24), seed=1).save_pretrained(target)
    tiny_tokenizer(24).save_pretrained(target)
    args = ["--target", str(target), "--dtype", "fp32", "--max-new-tokens", "6", "--batch-size", "4", "--seed", "2"]
    assert main(["make-data", "--out", str(tmp_path / "d"), "--prompts", "self", "--max-prompts", "30"] + args) == 0
    kept = load_prompts(tmp_path / "d" / PROMPTS_FILE)
    records = load_records(tmp_path / "d")
    assert 0 < len(kept) <= 30 and [r["id"] for r in records] == [p.id for p in kept]
    shard_files(tmp_path / "d")[0].unlink()
    assert main(["make-data", "--out", str(tmp_path / "d"), "--prompts", "self", "--max-prompts", "30"] + args) == 0
    assert load_prompts(tmp_path / "d" / PROMPTS_FILE) == kept and load_records(tmp_path / "d") == records
    assert main(["make-data", "--out", str(tmp_path / "f"), "--follow-up", str(tmp_path / "d")] + args) == 0
    assert main(["make-data", "--out", str(tmp_path / "g"), "--self-lead", "w3"] + args) == 2  # not --prompts self
    second = load_records(tmp_path / "f")
    assert [r["id"].rsplit("/", 2)[0] for r in second] == [p.id for p in kept]
    capsys.readouterr()


def test_follow_up_data_continues_the_conversation_after_the_datasets_own_answers(tmp_path):
    # make-data --follow-up: a second user turn of our own after each answer of a first-turn dataset; the
    # prompt holds the whole conversation (first turn, the target's answer as the dataset has it, follow-up)
    target = native(make_hf(llama_config(vocab=24), seed=1))
    tok = tiny_tokenizer(24)
    firsts = [Prompt(["code", "math", "chat"][i % 3], "t", f"w{i + 3} w{i + 4}", f"p{i}") for i in range(5)]
    cfg = DataGenConfig(max_new_tokens=6, batch_size=2)
    generate_dataset(target, tok, firsts, tmp_path / "first", cfg, stop_ids={0})
    answered = answered_prompts(tmp_path / "first", tok, firsts)
    records = load_records(tmp_path / "first")
    assert [p.id for p, _ in answered] == [r["id"] for r in records]
    assert [a for _, a in answered] == [tok.decode(r["response_ids"], skip_special_tokens=True) for r in records]
    second = follow_ups(answered, seed=3)
    assert second == follow_ups(answered, seed=3) and len({p.id for p in second}) == len(second)
    for p, (first, answer) in zip(second, answered):
        assert p.domain == first.domain and p.text in FOLLOW_UPS_ANY + FOLLOW_UPS[p.domain]
        assert p.earlier_turns == (first.text,) and p.earlier_answers == (answer,)
    generate_dataset(target, tok, second, tmp_path / "second", cfg, stop_ids={0})
    for r, p, first in zip(load_records(tmp_path / "second"), second, records):
        text = tok.apply_chat_template([{"role": "user", "content": p.earlier_turns[0]},
                                        {"role": "assistant", "content": p.earlier_answers[0]},
                                        {"role": "user", "content": p.text}], add_generation_prompt=True,
                                       tokenize=False)
        assert r["prompt_ids"] == tok.encode(text, add_special_tokens=False) and r["id"] == p.id
        assert r["prompt_ids"][:len(first["prompt_ids"])] == first["prompt_ids"]  # the first turn, as it was
    with pytest.raises(ValueError, match="answers to its earlier turns"):
        encode_prompt(tok, Prompt("chat", "t", "w3", "x", earlier_turns=("w4",)))
    with pytest.raises(ValueError, match="none of the training prompts"):
        answered_prompts(tmp_path / "first", tok, firsts[1:])
