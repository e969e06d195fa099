"""The floor under measured times: byte and FLOP counts of tiny models against hand counts from their configs,
the floor as the larger of its two terms."""
import pytest
import torch

from castspec.floor import Cost, Floors, draft_cost, prefill_cost, verify_cost
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter


@pytest.mark.parametrize("config,dtype", [(llama_config(vocab=24), torch.float32),
                                          (qwen3_config(vocab=40), torch.bfloat16)])
def test_verify_cost_is_the_hand_count_from_the_config(config, dtype):
    target = native(make_hf(config), dtype)
    H, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or H // heads
    # q, k, v, o, gate, up, down in every layer and the lm_head (tied or not: read once)
    params = layers * (H * heads * d + 2 * H * kv * d + heads * d * H + 3 * H * inter) + config.vocab_size * H
    weight_item = 4 if dtype == torch.float32 else 2
    kv_item = weight_item  # caches hold the model's dtype
    rows, prefix, batch = 5, 11, 3
    cost = verify_cost(target, rows, prefix, batch)
    assert cost.nbytes == params * weight_item + batch * layers * 2 * kv * d * (prefix + rows) * kv_item
    assert cost.flops == 2 * params * rows * batch + batch * 2 * 2 * layers * heads * d * rows * (prefix + rows)
    # one request's cache and rows: the weights are read once whatever the batch
    single = verify_cost(target, rows, prefix)
    assert cost.nbytes - single.nbytes == 2 * layers * 2 * kv * d * (prefix + rows) * kv_item


def test_prefill_cost_is_the_hand_count_from_the_config():
    config = llama_config(vocab=24)
    target = native(make_hf(config))
    H, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = H // heads
    layer_params = layers * (H * heads * d + 2 * H * kv * d + heads * d * H + 3 * H * inter)
    head = config.vocab_size * H
    rows = 7
    cost = prefill_cost(target, rows)
    # every matrix read once, the lm_head for the last row only; row i attends over i + 1 keys
    assert cost.nbytes == (layer_params + head) * 4 + layers * 2 * kv * d * rows * 4
    assert cost.flops == 2 * layer_params * rows + 2 * head + 2 * 2 * layers * heads * d * (rows * (rows + 1) // 2)


def test_draft_cost_is_the_hand_count_with_and_without_a_draft_vocabulary():
    config = llama_config(vocab=24)
    target = native(make_hf(config))
    drafter = random_drafter(target, block_size=4, layers=2)  # 4 heads, 2 kv heads of 16, intermediate 96
    H, V, block, L = config.hidden_size, config.vocab_size, 4, 3
    fc = 2 * H * H  # two tapped layers fused into one hidden state
    kv_params = 2 * H * 2 * 16
    qkv = H * 4 * 16 + kv_params
    rest = 4 * 16 * H + 3 * H * 96  # o, gate, up, down
    layer = qkv + rest
    prefix, ctx, batch = 20, 3, 2
    kv_bytes = 2 * 2 * 2 * 16 * prefix * 4

    def expected(head_rows: int, depth: int = L) -> Cost:
        # the first layer for every block row; the last one's q|k|v too, the rest and the head for `depth` rows
        head = head_rows * H
        flops = (2 * fc * ctx + 2 * 2 * kv_params * ctx + 2 * layer * block + 2 * qkv * block + 2 * rest * depth
                 + 2 * 2 * 4 * 16 * (block + depth) * (prefix + block) + 2 * head * depth)
        return Cost((fc + 2 * layer + head) * 4 + batch * kv_bytes, batch * flops)

    assert draft_cost(drafter, target, prefix, batch, ctx) == expected(V)
    drafter.set_draft_vocab(torch.arange(10))
    assert draft_cost(drafter, target, prefix, batch, ctx) == expected(10)
    assert draft_cost(drafter, target, prefix, batch, ctx, depth=1) == expected(10, 1)


def test_floor_is_the_larger_term():
    floors = Floors(read_gbps=10.0, gemm_gflops=100.0)
    assert floors.floor_ms(1e9, 1e9) == pytest.approx(100.0)  # 1 GB at 10 GB/s: read-bound
    assert floors.floor_ms(1e8, 1e12) == pytest.approx(10_000.0)  # 1 TFLOP at 100 GFLOP/s: compute-bound
    assert Cost(1e9, 1e9).floor_ms(floors) == floors.floor_ms(1e9, 1e9)
    assert floors.best(Floors(5.0, 200.0)) == Floors(10.0, 200.0)


def test_measured_rates_are_positive():
    floors = Floors.measure(torch.device("cpu"), torch.bfloat16, read_repeats=2, gemm_repeats=1)
    assert floors.read_gbps > 0 and floors.gemm_gflops > 0
