"""castspec.bench.gpu_scale: the Qwen3-8B-shaped benchmark, its configs, and a CPU smoke run at small scale."""
import json
import math

import torch
from transformers import Qwen3Config

from castspec.bench import gpu_scale
from castspec.bench.scale_configs import QWEN3_8B, QWEN3_8B_DFLASH_B16, pair
from castspec.config import DrafterConfig, TargetConfig
from castspec.models.decoder import Decoder
from castspec.models.dflash import DFlashDrafter
from castspec.models.load import check_compatible, rope_parameters_of


def meta_pair(scale):
    """Both models of a scale on the meta device: shapes and parameter counts without memory."""
    target_json, drafter_json = pair(scale)
    hf = Qwen3Config(**{k: v for k, v in target_json.items() if k != "architectures"})
    with torch.device("meta"):
        target = Decoder(TargetConfig.from_hf(hf), rope_parameters_of(hf), hf, dtype=torch.bfloat16, device="meta")
        drafter = DFlashDrafter(DrafterConfig.from_json(drafter_json), dtype=torch.bfloat16, device="meta")
    return target, drafter


def test_the_full_pair_has_qwen3_8b_and_dflash_b16_shapes():
    target, drafter = meta_pair("full")
    t, d = target.cfg, drafter.cfg
    assert (t.hidden_size, t.num_layers, t.num_heads, t.num_kv_heads, t.head_dim, t.intermediate_size,
            t.vocab_size) == (4096, 36, 32, 8, 128, 12288, 151936)
    assert t.qk_norm and not t.tie_word_embeddings and t.rms_norm_eps == 1e-6
    assert rope_parameters_of(Qwen3Config(**QWEN3_8B))["rope_theta"] == 1e6
    # Qwen3-8B's published size: 8.19 B parameters, 6.95 B of them outside the embedding and the head
    params = sum(p.numel() for p in target.parameters())
    assert params == 8_190_735_360
    assert params - 2 * 151936 * 4096 == 6_946_075_648
    assert (d.num_layers, d.block_size, d.num_draft_positions, d.mask_token_id, d.target_layer_ids) == \
        (5, 16, 15, 151669, [1, 9, 17, 25, 33])
    assert drafter.fc.weight.shape == (4096, 5 * 4096)
    check_compatible(d, target, "z-lab/Qwen3-8B-DFlash-b16")  # a drafter for this target
    assert QWEN3_8B_DFLASH_B16["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_the_small_pair_keeps_the_structure():
    (target, drafter), (full, full_drafter) = meta_pair("small"), meta_pair("full")
    t, f = target.cfg, full.cfg
    assert t.model_type == f.model_type and t.qk_norm and not t.tie_word_embeddings
    assert t.num_heads // t.num_kv_heads == f.num_heads // f.num_kv_heads
    assert t.intermediate_size / t.hidden_size == f.intermediate_size / f.hidden_size
    assert drafter.cfg.block_size == full_drafter.cfg.block_size
    check_compatible(drafter.cfg, target, "small")


def test_small_benchmark_runs_on_cpu_and_reports_every_part(tmp_path, monkeypatch):
    """The whole benchmark at small scale, padded forwards on (eager on CPU) and off: every number is there,
    finite and positive. (Torch's kernels only: castspec's native CPU build is not what this benchmark is for.)"""
    monkeypatch.setenv("CASTSPEC_NATIVE", "0")
    out = tmp_path / "scale.json"
    packed = [1, 2, 8, 64, 128]
    assert gpu_scale.main(["--device", "cpu", "--scale", "small", "--graphs", "on", "--out", str(out),
                           "--prefixes", "32,96", "--packed", ",".join(map(str, packed)), "--tokens", "6",
                           "--reps", "1", "--warmup", "1"]) == 0
    r = json.loads(out.read_text())
    assert r["scale"] == "small" and r["dtype"] == "bf16" and set(r["modes"]) == {"graphs", "eager"}
    assert r["configs"]["target"]["num_hidden_layers"] == 8 and r["weight_bytes"] > 0

    def positive(x):
        return isinstance(x, (int, float)) and math.isfinite(x) and x > 0

    assert all(positive(v) for v in r["floors"].values())
    for name, mode in r["modes"].items():
        assert mode["graphs"] == (name == "graphs")
        ar = mode["ar"]
        assert all(positive(ar[k]) for k in ("decode_ms_per_token", "whole_call_ms_per_token", "floor_ms",
                                             "ratio_to_floor", "floor_ms_at_copy_rate"))
        v = mode["verify"]
        assert v["packed"] == packed and v["prefix_lens"] == [32, 96]
        assert all(positive(x) for rows in (v["ms"], v["floor_ms"], v["ratio_to_floor"]) for row in rows for x in row)
        assert [row[0] for row in v["ratio_to_one_row"]] == [1.0, 1.0]
        assert len(mode["draft"]["ms"]) == 2 and all(positive(x) for x in mode["draft"]["ms"])
        assert set(mode["host"]["per_width_ms"]) == {str(n - 1) for n in packed}
        cast = mode["host"]["cast_round"]
        assert cast["width"] == 63 and cast["rounds"] >= 1 and positive(cast["host_ms_per_round"])
    counts = r["modes"]["graphs"]["graph_counts"]
    assert {"1", "2", "8", "64", "128"} <= set(counts["target"]["padded"])  # JSON keys: the buckets used
    assert counts["drafter"]["padded"] and counts["target"]["captured"] == 0  # eager on CPU
    assert positive(r["transformers"]["whole_call_ms_per_token"])
    s = r["summary"]
    assert s["mode"] == "graphs" and set(s["verify64_over_verify1"]) == {"32", "96"}
    assert all(positive(s[k]) for k in ("ar_ratio_to_floor", "draft_per_ar_step", "host_ms_per_round_cast63",
                                        "ar_speedup_vs_transformers_whole_call", "ar_eager_over_graphs"))
