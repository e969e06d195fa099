"""Round logs and replay analyses on a tiny model."""
import numpy as np

from castspec.analysis import analyze, fixed_shape_commit, mass_curves, predicted_widths, replay_commit
from castspec.config import DecodeConfig
from castspec.cost import CostProfile
from castspec.decode import DecodeStats, decode
from conftest import llama_config, make_hf, native, random_drafter


def collect_tiny(K=6):
    target = native(make_hf(llama_config(vocab=24), seed=1))
    drafter = random_drafter(target, block_size=5, seed=2)
    logs = []
    for prompt in ([1, 2, 3], [4, 5], [7, 7, 8, 9]):
        rounds, emitted = [], []

        def on_round(logprobs, tree, path, new):
            vals, idx = logprobs.topk(K, -1)
            rounds.append({"start": len(emitted), "top_logprobs": vals.numpy(), "top_ids": idx.numpy(),
                           "committed": len(path) + 1})

        stats = DecodeStats()
        for chunk in decode(target, drafter, prompt, DecodeConfig(method="cast", width=15, top_k_per_position=K,
                                                                  max_new_tokens=40), stats, on_round=on_round):
            emitted.extend(chunk)
        for r in rounds:
            r["continuation"] = emitted[r["start"]:r["start"] + 5]
            r["domain"] = "d"
        logs += rounds
    return logs


def test_replay_reproduces_the_committed_tokens_of_real_rounds():
    logs = collect_tiny()
    assert logs
    for log in logs:
        if len(log["continuation"]) == 5:  # rounds whose whole continuation is known
            assert replay_commit(log, 15, 6) == log["committed"]


def test_curves_analyses_and_widths():
    logs = collect_tiny()
    curves = mass_curves(logs, max_width=31, K=6)
    m = np.asarray(curves["d"]["mean_mass"])
    assert np.all(np.diff(m) <= 1e-12)  # sorted masses
    report = analyze(logs, K_small=4, budgets=(3, 7))
    assert set(report) == {"first_rejection_rank", "depth1_calibration", "rank_cap_ablation",
                           "tree_shape_at_matched_budget"}
    shape = report["tree_shape_at_matched_budget"]["d"]
    assert shape["N=7"]["top-N best-first"] >= 1 and all(fixed_shape_commit(l, 7) >= 1 for l in logs)
    prof = CostProfile({}, [1, 2, 4, 8, 16, 32], [64], [[10, 10, 10, 10, 12, 30]], [1.0], {})
    w = predicted_widths(curves, prof, 64, 31)["d"]
    assert 0 <= w["table"] <= 31 and 0 <= w["affine"] <= 31
    # recalibrated on the observed acceptance: a random drafter's masses are badly off, the calibrated ones
    # land nearer the realized hit rates
    cal = np.asarray(curves["d"]["calibrated_mass"])
    hit = np.nan_to_num(np.asarray(curves["d"]["hit_rate"]))
    assert cal.shape == m.shape and np.all(np.diff(cal) <= 1e-12) and np.all((cal >= 0) & (cal <= 1))
    assert abs(cal.sum() - hit.sum()) < abs(m.sum() - hit.sum())
    assert 0 <= w["table_cal"] <= 31 and 0 <= w["affine_cal"] <= 31
