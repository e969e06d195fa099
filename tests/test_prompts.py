"""Prompt sets: the held-out split and the sets of other kinds stay apart from training; eval-drafter over them."""
import pytest

from castspec.engine import Engine
from castspec.prompts import (DOC_MODULES, EVAL_SETS, FOLLOW_UPS, FOLLOW_UPS_ANY, UNSEEN_MODULES, Prompt,
    eval_prompts, heldout_prompts, instruction_tasks, prompt_family, training_prompts)
from castspec.train.evaluate import evaluate_drafter, r_per_domain, request_of
from conftest import llama_config, make_hf, native, random_drafter, tiny_tokenizer


def test_eval_sets_are_sized_like_the_heldout_split_and_never_trained_on():
    train_texts = {p.text for p in training_prompts()}
    # signatures whose defaults print memory addresses made some prompts differ from process to process
    assert not [t for t in train_texts if " at 0x" in t]
    assert not set(UNSEEN_MODULES) & set(DOC_MODULES)
    for name in EVAL_SETS:
        prompts = eval_prompts(name, per_domain=4)
        assert len(prompts) == len(heldout_prompts(4)) == 12, name
        assert not {p.text for p in prompts} & train_texts, name
        assert len({p.id for p in prompts}) == len(prompts), name
    turn2 = eval_prompts("mtbench-turn2", 4)
    assert all(len(p.earlier_turns) == 1 and p.chat for p in turn2)
    assert not {p.earlier_turns[0] for p in turn2} & train_texts  # the first turns are the held-out ones
    # the follow-ups of multi-turn training data are none of the second turns evaluated
    follow = set(FOLLOW_UPS_ANY).union(*FOLLOW_UPS.values())
    assert not follow & {p.text for p in eval_prompts("mtbench-turn2", 40)}
    assert all(not p.chat for p in eval_prompts("humaneval-completion", 4))
    with pytest.raises(ValueError, match="unknown prompt set"):
        eval_prompts("nope")


def test_instruction_tasks_are_drawn_by_seed_distinct_and_apart_from_evaluation():
    a = instruction_tasks(600, seed=10)
    assert a == instruction_tasks(600, seed=10) and a != instruction_tasks(600, seed=11)
    assert len({p.text for p in a}) == len(a) == len({p.id for p in a}) > 500
    assert {p.domain for p in a} == {"chat"} and all(p.chat and not p.earlier_turns for p in a)
    # every kind is there: role play, puzzles, a passage to extract from, comparisons, plans, constrained forms
    for marker in ("Pretend you are", "how do you know?", "\n\n", "Compare ", "Plan a ", "Write a haiku"):
        assert any(marker in p.text for p in a), marker
    held = {p.text for name in EVAL_SETS for p in eval_prompts(name, 40)}
    assert not {p.text for p in a} & held
    assert set(a) <= set(prompt_family("instructions", 10))  # the same draws, more of them
    assert prompt_family("training", 3) == training_prompts(seed=3)
    with pytest.raises(ValueError, match="unknown prompt family"):
        prompt_family("nope", 0)


@pytest.fixture(scope="module")
def engine():
    target = native(make_hf(llama_config(vocab=24), seed=1))
    return Engine(target, tiny_tokenizer(24), random_drafter(target, block_size=8, seed=2))


def test_a_later_turn_follows_the_targets_own_answers(engine):
    p = Prompt("chat", "t", "w5 w6", "x", earlier_turns=("w1 w2", "w3"))
    req = request_of(engine, p, 6)
    msgs = req["messages"]
    assert [m["role"] for m in msgs] == ["user", "assistant", "user", "assistant", "user"]
    first = engine.generate(messages=msgs[:1], method="ar", max_new_tokens=6).text
    assert msgs[1]["content"] == first and msgs[4]["content"] == "w5 w6"
    assert request_of(engine, Prompt("code", "t", "w7 w8", "y", chat=False), 6) == {"prompt": "w7 w8"}


def test_r_per_domain_counts_every_committed_token(engine):
    prompts = [Prompt("code", "t", "w4 w9", "a"), Prompt("chat", "t", "w2", "b", earlier_turns=("w3",))]
    table = r_per_domain(engine, prompts, 12, widths=(3,), progress=False, desc="t")
    assert set(table) == {"chain", "cast@3"}
    for per in table.values():
        assert set(per) == {"code", "chat", "mean_of_domains"}
        assert all(1.0 <= v <= 9.0 for v in per.values())  # at least the target's token, at most root + 8
        assert per["mean_of_domains"] == pytest.approx((per["code"] + per["chat"]) / 2)


def test_evaluate_drafter_relates_each_set_to_the_heldout_one(engine, monkeypatch):
    fake = {"heldout": [Prompt("code", "t", "w4 w9", "a"), Prompt("chat", "t", "w3 w5", "c")],
            "other": [Prompt("chat", "t", "w2 w2", "b")]}
    monkeypatch.setattr("castspec.train.evaluate.eval_prompts", lambda name, per_domain: fake[name])
    report = evaluate_drafter(engine, per_domain=1, max_new_tokens=10, widths=(3,), progress=False,
                              sets=("heldout", "other"))
    assert report["R"] == report["sets"]["heldout"]
    for m in ("chain", "cast@3"):
        assert report["relative_to_heldout"]["other"][m] == pytest.approx(
            report["sets"]["other"][m]["mean_of_domains"] / report["R"][m]["mean_of_domains"])
        # like against like: the other set's chat over the held-out chat (the held-out code has no counterpart)
        assert report["relative_to_heldout_by_domain"]["other"][m] == {
            "chat": pytest.approx(report["sets"]["other"][m]["chat"] / report["R"][m]["chat"])}
    only = evaluate_drafter(engine, per_domain=1, max_new_tokens=10, widths=(3,), progress=False)
    assert set(only) == {"per_domain", "max_new_tokens", "dtype", "R"} and only["R"] == report["R"]
    # sampled: every prompt once per seed, the rounds pooled; the same seeds give the same table
    sampled = [evaluate_drafter(engine, per_domain=1, max_new_tokens=10, widths=(3,), progress=False,
                                temperature=1.0, seeds=seeds) for seeds in ((0, 1), (0, 1), (0,))]
    assert sampled[0]["temperature"] == 1.0 and sampled[0]["seeds"] == [0, 1]
    assert sampled[0]["R"] == sampled[1]["R"]
    assert all(1.0 <= v <= 4.0 for t in sampled for per in t["R"].values() for v in per.values())
