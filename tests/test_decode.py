"""The round loop: KV compaction, exactness of chain/cast against ar, stop handling, context errors."""
import pytest
import torch

from castspec.config import DecodeConfig
from castspec.allocate import Policy
from castspec.round import greedy_tokens, run_round
from castspec.decode import ContextLengthError, DecodeStats, decode
from castspec.sequence import Sequence
from castspec.engine import Engine
from castspec.models.draft_vocab import DRAFT_VOCAB_FILE, save_draft_vocab
from castspec.models.load import LoadError, load_drafter, save_drafter
from castspec.tree import Tree, build_tree
from conftest import llama_config, make_hf, native, qwen3_config, random_drafter


def run(target, drafter, prompt, **kw):
    kw.setdefault("max_new_tokens", 40)
    return [t for chunk in decode(target, drafter, prompt, DecodeConfig(**kw)) for t in chunk]


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def models(request, device):
    cfg = llama_config(vocab=24) if request.param == "llama" else qwen3_config(vocab=24)
    target = native(make_hf(cfg, seed=1, device=device))
    return target, random_drafter(target, block_size=8, seed=2)


def decoy_tree(truth: list[int], vocab: int) -> Tree:
    """A wrong first child, then the true continuation under the second child (plus wrong leaves), so the
    accepted rows are not contiguous after the root and compaction must really gather."""
    tokens, parents, depths = [(truth[0] + 1) % vocab], [-1], [1]
    parent = -1
    for d, tok in enumerate(truth, start=1):
        tokens.append(tok)
        parents.append(parent)
        depths.append(d)
        parent = len(tokens) - 1
        tokens.append((tok + 2) % vocab)  # a rejected sibling of the next true node
        parents.append(parent)
        depths.append(d + 1)
    return Tree(tokens, parents, depths, [0.0] * len(tokens))


class DecoyPolicy(Policy):
    """Verifies a hand-made tree: the true continuation behind a rejected decoy branch."""

    def __init__(self, truth):
        self.truth, self.emitted = truth, 1

    def max_nodes(self, depth):
        return 24

    def allocate(self, logprobs, prefixes, supports=None):
        n = self.emitted
        return [decoy_tree(self.truth[n:n + 4], 24)]


def test_compaction_equals_recomputed_cache(models):
    target, drafter = models
    prompt = [5, 3, 8, 1, 9, 2, 2, 7, 4]
    truth = run(target, None, prompt, method="ar", max_new_tokens=40)
    policy = DecoyPolicy(truth)
    seq = Sequence(target, drafter, prompt, DecodeConfig(method="cast", max_new_tokens=60), policy.max_nodes(15))
    committed = list(prompt)
    with torch.inference_mode():
        (out,) = run_round(target, drafter, [seq], policy, prefill_budget=4).sequences
        assert out.emitted == [] and not out.verified and seq.prefilled == 4  # chunked prefill: three rounds
        while seq.root is None:
            (out,) = run_round(target, drafter, [seq], policy, prefill_budget=4).sequences
        emitted = out.emitted
        while len(emitted) < 30:
            root = seq.root
            policy.emitted = len(emitted)
            (out,) = run_round(target, drafter, [seq], policy).sequences
            new, path = out.emitted, out.path
            assert out.accepted == len(path) and out.draft_logprobs is not None and len(out.tree) == 9
            assert path and path[0] == 2  # the decoy was skipped, the true branch accepted
            committed += [root] + new[:-1]
            emitted += new
            assert seq.cache.length == len(committed)
    assert emitted == truth[:len(emitted)]
    fresh = target.new_cache(len(committed) + 1)
    with torch.inference_mode():
        target(torch.tensor([committed], device=target.device), torch.arange(len(committed), device=target.device)[None],
               fresh, 0, causal=True)
    n = len(committed)
    torch.testing.assert_close(seq.cache.k[..., :n, :], fresh.k[..., :n, :], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seq.cache.v[..., :n, :], fresh.v[..., :n, :], rtol=1e-4, atol=1e-5)
    # the drafter's context cache advanced by exactly the committed positions
    seq.draft.propose(target, seq.root, 3)
    assert seq.draft.cache.length == n


def test_chain_and_cast_equal_ar_token_for_token(models):
    target, drafter = models
    g = torch.Generator().manual_seed(5)
    for _ in range(12):
        prompt = torch.randint(0, 23, (int(torch.randint(1, 25, (1,), generator=g)),), generator=g).tolist()
        ar = run(target, None, prompt, method="ar")
        assert len(ar) == 40
        for method, width, k in [("chain", "auto", 8), ("cast", 1, 8), ("cast", 7, 8), ("cast", 15, 8),
                                 ("cast", 63, 8), ("cast", 1000, 2)]:  # 1000 > the K=2 universe (254): clamped
            out = run(target, drafter, prompt, method=method, width=width, top_k_per_position=k)
            assert out == ar, (method, width)
    # random drafters still get some drafts accepted on these small vocabularies
    stats = DecodeStats()
    list(decode(target, drafter, [1, 2, 3], DecodeConfig(method="cast", width=63, max_new_tokens=60), stats))
    accepted = sum(r.accepted for r in stats.rounds)
    assert accepted > 0


def test_stop_tokens_and_max_new_tokens(models):
    target, drafter = models
    prompt = [3, 1, 4, 1, 5]
    ar = run(target, None, prompt, method="ar", max_new_tokens=30)
    stop = ar[7]
    first = ar.index(stop)
    for method in ("ar", "chain", "cast"):
        out = run(target, drafter, prompt, method=method, width=15, max_new_tokens=30, stop_token_ids=(stop,))
        assert out == ar[:first + 1]  # stops at the first stop token, inclusive, even if it was a bonus token
        assert run(target, drafter, prompt, method=method, width=15, max_new_tokens=5) == ar[:5]
        assert run(target, drafter, prompt, method=method, width=15, max_new_tokens=1) == ar[:1]
        assert run(target, drafter, prompt, method=method, width=15, max_new_tokens=0) == []


def test_context_overflow_is_a_clear_error(models):
    target, drafter = models
    with pytest.raises(ContextLengthError, match="exceeds the model's context of 512"):
        run(target, drafter, [1] * 500, method="cast", width=15, max_new_tokens=13)
    # exactly filling the context works, and trees near the end stay within it
    assert len(run(target, drafter, [1] * 480, method="cast", max_new_tokens=32, width=63)) == 32


def test_drafter_round_trips_through_public_layout(models, tmp_path):
    target, drafter = models
    save_drafter(drafter, tmp_path / "d")
    loaded = load_drafter(tmp_path / "d", target)
    for (n1, p1), (n2, p2) in zip(drafter.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert run(target, loaded, [2, 7, 1], method="cast", width=15) == run(target, drafter, [2, 7, 1],
                                                                          method="cast", width=15)


def test_draft_vocabulary_keeps_decoding_exact_and_round_trips(models, tmp_path):
    target, drafter = models
    V = target.cfg.vocab_size
    vocab = torch.arange(0, V, 2)  # every other token
    sub = drafter.converted(drafter.dtype)
    sub.set_draft_vocab(vocab)
    rows = torch.randn(3, target.cfg.hidden_size, device=target.device)
    full = drafter.draft_logprobs(rows, target)
    lp = sub.draft_logprobs(rows, target)
    # the same head restricted and renormalized: -inf outside, log q(x | x in vocab) inside
    assert torch.isinf(lp[:, 1::2]).all()
    torch.testing.assert_close(lp[:, vocab], torch.log_softmax(full[:, vocab], dim=-1), rtol=1e-5, atol=1e-5)
    # trees read the draft vocabulary's columns alone, with the token ids they stand for
    m = sub.marginals(rows, target)
    assert torch.equal(m.full, lp) and torch.equal(m.on_support, lp[:, vocab])
    assert torch.equal(m.support.cpu(), vocab.cpu())
    assert drafter.marginals(rows, target).support is None
    g = torch.Generator().manual_seed(9)
    accepted = 0
    for _ in range(6):
        prompt = torch.randint(0, V - 1, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
        ar = run(target, None, prompt, method="ar")
        for method, width in [("chain", "auto"), ("cast", 7), ("cast", 63)]:
            stats, trees = DecodeStats(), []
            out = [t for c in decode(target, sub, prompt, DecodeConfig(method=method, width=width, max_new_tokens=40),
                                     stats, on_round=lambda lp, tree, *_: trees.append((lp, tree))) for t in c]
            assert out == ar, (method, width)
            # each round's tree (built on the support) is the tree of its full-vocabulary marginals
            chain = method == "chain"
            assert trees and all(tree == build_tree(lp, lp.shape[0] if chain else width, 1 if chain else 8)
                                 for lp, tree in trees), (method, width)
            accepted += sum(r.accepted for r in stats.rounds)
    assert accepted > 0
    save_drafter(sub, tmp_path / "d")
    assert torch.equal(load_drafter(tmp_path / "d", target).draft_vocab.cpu(), vocab)
    save_draft_vocab(tmp_path / "d", torch.tensor([0, V]))  # a token the target does not have
    with pytest.raises(LoadError, match="inside the target vocabulary"):
        load_drafter(tmp_path / "d", target)
    (tmp_path / "d" / DRAFT_VOCAB_FILE).write_text("not safetensors")
    with pytest.raises(LoadError, match="not a readable draft vocabulary"):
        load_drafter(tmp_path / "d", target)
    save_draft_vocab(tmp_path / "d", None)
    assert load_drafter(tmp_path / "d", target).draft_vocab is None


def test_engine_requires_drafter_for_speculative_methods(models):
    target, _ = models
    engine = Engine(target, None, None)
    with pytest.raises(ValueError, match="needs a drafter"):
        engine.generate(input_ids=[1, 2], method="cast")
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.generate(prompt="hello", method="ar")
    r = engine.generate(input_ids=[1, 2], method="ar", max_new_tokens=4)
    assert len(r.token_ids) == 4 and r.stats.mean_accepted == 1.0


def test_greedy_tokens_are_torch_argmax_ties_included():
    """The verify step's argmax (numpy on the CPU) picks what torch's does, the first of tied maxima."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=g)
    logits[2, [5, 17, 900]] = 50.0  # a three-way tie
    logits[4, :] = -3.0  # the whole row tied
    assert greedy_tokens(logits) == logits.argmax(-1).tolist() == greedy_tokens(logits.double())
    assert greedy_tokens(logits)[2] == 5 and greedy_tokens(logits)[4] == 0
    view = torch.randn(1, 3, 7, 100, generator=g)[0, :, 2]  # a strided view
    assert greedy_tokens(view) == view.argmax(-1).tolist()
