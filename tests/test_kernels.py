"""CPU linears: the packed oneDNN path and castspec's own few-row kernels, against torch; fallbacks; the
native library's build cache and load checks. The native tests run the real library on AVX-512 BF16 CPUs and
the emulated one elsewhere (native_support)."""
import ctypes
import logging
import shutil

import pytest
import torch
import torch.nn.functional as F

from castspec import env
from castspec.native import abi
from castspec.native import build as native
from castspec.native.linear import PanelPack, WeightPack, linear, packing_available, panel_linear, panel_logprobs
from castspec.native.pack import pack_panels, packable
from native_support import mode as native_mode
from native_support import native_library


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 17])
def test_packed_linear_matches_f_linear(dtype, rows):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(40, 24, generator=g).to(dtype)
    b = torch.randn(40, generator=g).to(dtype)
    x = torch.randn(2, rows, 24, generator=g).to(dtype)
    pack = WeightPack()
    with torch.inference_mode():
        out = linear(x, w, b, pack)
    assert out.shape == (2, rows, 40) and out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), F.linear(x, w, b).float(), rtol=tol, atol=tol)
    assert (pack.get(w) is not None) == packing_available(dtype)


def test_pack_follows_in_place_updates_through_views():
    fused = torch.randn(30, 16)
    part = fused[10:20]  # like k_proj.weight inside the fused q|k|v matrix
    pack = WeightPack()
    x = torch.randn(4, 16)
    with torch.no_grad():
        before = linear(x, part, None, pack)
        fused[10:20] += 1.0  # an optimizer step or a checkpoint load through another alias
        after = linear(x, part, None, pack)
    torch.testing.assert_close(after, F.linear(x, part), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(before, after)


def test_gradients_bypass_the_pack():
    w = torch.randn(8, 4, requires_grad=True)
    out = linear(torch.randn(3, 4), w, None, WeightPack())
    out.sum().backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


@pytest.fixture
def lib(monkeypatch):
    yield from native_library(monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inner", [24, 83, 576])  # tails of every length, and a real hidden size
def test_native_kernels_match_torch(lib, dtype, inner):
    g = torch.Generator().manual_seed(inner)
    w = torch.randn(37, inner, generator=g).to(dtype)
    x = torch.randn(native.MAX_ROWS[dtype], inner, generator=g).to(dtype)
    out = native.skinny_linear(x, w)
    ref = (x.double() @ w.double().T).to(dtype)
    # fp32: summation order only; bf16: the fp32 sum rounded once to bfloat16, so at most one bf16 ulp apart
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=1e-3)
    torch.testing.assert_close(out.float(), ref.float(), **tol)
    # a row's result never depends on how many rows share the call (ar rows vs packed rows)
    assert torch.equal(native.skinny_linear(x[1:2], w)[0], out[1])
    # and `linear` takes this path for single rows without gradients, not with them
    with torch.inference_mode():
        assert torch.equal(linear(x[:1], w, None, WeightPack()), out[:1])
    assert native.skinny_linear(torch.randn(native.MAX_ROWS[dtype] + 1, inner).to(dtype), w) is None


def _gemm(lib, packed, x, outputs):
    """gemm.c's product of rows x by a weight packed by native/pack.py (fp32 sums), the rows padded with zeros to
    a multiple of 16 as layer.h does."""
    rows = x.shape[0]
    padded = torch.zeros(-(-rows // 16) * 16, x.shape[1], dtype=x.dtype)
    padded[:rows] = x
    out = torch.full((rows, outputs + 3), float("nan"))  # 3 spare columns: nothing is written past O
    entry = lib.gemm_bf16_f32 if x.dtype == torch.bfloat16 else lib.gemm_f32
    entry(packed.data_ptr(), padded.data_ptr(), out.data_ptr(), rows, outputs, x.shape[1], padded.stride(0),
          out.stride(0))
    return out


@pytest.fixture(params=["avx512", "amx"])
def tiles(request, lib):
    """Which tiles gemm.c's bf16 products run on: AVX-512, or AMX where this CPU and build have it (the library
    is switched for the test and switched back after)."""
    amx = native.amx_wanted(native.build_for(env.native_mode()))
    if request.param == "amx" and not (amx and lib.gemm_use_amx(1)):
        pytest.skip("no AMX BF16 on this CPU (or not in this build)")
    lib.gemm_use_amx(int(request.param == "amx"))
    yield request.param
    lib.gemm_use_amx(int(amx))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("outputs,inner", [(37, 24), (200, 82), (48, 576), (100, 64), (200, 1536)])  # partial/whole
# panels; the last: blocks of 3 panels for several row groups, so several blocks per thread and a partial one
def test_packed_products_match_torch_and_ignore_other_rows(lib, tiles, dtype, outputs, inner):
    """gemm.c, the whole native forwards' products: the fp32 sums of the rows (bf16 products are exact in fp32,
    so only the summation order differs from torch's) for every row count through several tiles, blocks and
    threads (on AMX: 1-4 groups of 16 rows, two at a time sharing each weight tile); a row's bits the same alone,
    in any group and at any place; columns past O left alone. On AVX-512 tiles and, where the CPU has them, AMX
    tiles (inner widths that are multiples of 32)."""
    g = torch.Generator().manual_seed(outputs)
    w = torch.randn(outputs, inner, generator=g).to(dtype)
    x = torch.randn(70, inner, generator=g).to(dtype)
    packed = pack_panels(w, lib.gemm_panel_group())
    out = _gemm(lib, packed, x, outputs)
    assert out[:, outputs:].isnan().all()
    torch.testing.assert_close(out[:, :outputs], x.double() @ w.double().T, rtol=1e-5, atol=1e-4,
                               check_dtype=False)
    for first, rows in [(0, 1), (5, 1), (3, 2), (9, 7), (1, 13), (40, 30), (2, 40), (0, 64)]:
        part = _gemm(lib, packed, x[first:first + rows].contiguous(), outputs)
        assert torch.equal(part[:, :outputs], out[first:first + rows, :outputs]), (first, rows)


@pytest.mark.parametrize("group", [1, 2, 3])
def test_bf16_panels_interleave_in_groups(group):
    """The bf16 layout: element [g, p, j, c, k] is weight row 16 * (g * group + j) + c, input 2 * p + k, and zero
    past the weight's rows (up to whole groups of panels); fp32 panels are never grouped."""
    w = torch.randn(37, 6).to(torch.bfloat16)
    packed = pack_panels(w, group)
    groups = -(-37 // (16 * group))
    assert packed.shape == (groups, 3, group, 16, 2)
    for g, p, j, c, k in [(0, 0, 0, 0, 0), (0, 2, group - 1, 5, 1), (groups - 1, 1, group - 1, 15, 0)]:
        row = 16 * (g * group + j) + c
        assert packed[g, p, j, c, k] == (w[row, 2 * p + k] if row < 37 else 0)
    assert torch.equal(pack_panels(w.float(), group), pack_panels(w.float()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 12, 20, 40])  # AVX-512: one group, a pair; on AMX: one group, a pair, more
def test_products_are_the_same_bits_whatever_the_threads(lib, tiles, dtype, rows):
    """The threads split the panels by taking units from shares (csrc/share.h), so which thread computes a panel
    varies from call to call: every panel is computed exactly once, to the same bits, with 1, 2, 3 or 5 threads
    (more threads than this machine's cores take from each other's shares as well)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(520, 576, generator=g).to(dtype)  # 33 panels (a partial one): units of 4 and 8 end unevenly
    x = torch.randn(rows, 576, generator=g).to(dtype)
    packed = pack_panels(w, lib.gemm_panel_group())
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs.append(_gemm(lib, packed, x, 520))
    finally:
        torch.set_num_threads(before)
    assert not outs[0][:, :520].isnan().any() and outs[0][:, 520:].isnan().all()
    for out in outs[1:]:
        assert torch.equal(out[:, :520], outs[0][:, :520]) and out[:, 520:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_linear_takes_any_row_count(lib, dtype):
    """panel_linear (the drafter's head on gemm.c): fp32 sums of x rounded to the weight's dtype, for any number
    of rows and leading shape; the pack follows an in-place change; no answer where gradients are on."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(70, 48, generator=g).to(dtype)
    pack = PanelPack()
    for rows in (1, 5, 17, 40):
        x = torch.randn(rows, 48, generator=g)
        with torch.inference_mode():
            got = panel_linear(x.view(1, rows, 48), w, pack)
        assert got.dtype == torch.float32 and got.shape == (1, rows, 70)
        torch.testing.assert_close(got[0], x.to(dtype).double() @ w.double().T, rtol=1e-5, atol=1e-4,
                                   check_dtype=False)
    with torch.no_grad():
        w.mul_(2)
        torch.testing.assert_close(panel_linear(x, w, pack), x.to(dtype).double() @ w.double().T, rtol=1e-5,
                                   atol=1e-4, check_dtype=False)
    with torch.enable_grad():
        assert panel_linear(x, w, pack) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_panel_logprobs_is_the_heads_log_softmax_of_chosen_rows(lib, dtype):
    """panel_logprobs (a drafter pass's head and normalization in one native call): log_softmax of the chosen
    rows' product, as torch computes it from panel_linear's sums, for row sets that skip rows (each block's root),
    repeat or reorder them, draft vocabularies that are not a multiple of 16 wide; bad rows are an error."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(8195, 64, generator=g).to(dtype) / 4
    pack = PanelPack()
    hidden = torch.randn(24, 64, generator=g)
    for rows in ([1, 2, 3, 4, 5, 6, 7], [1, 2, 9, 10, 11, 17], [23], [5, 5, 0], list(range(24))):
        with torch.inference_mode():
            got = panel_logprobs(hidden, rows, w, pack)
            want = torch.log_softmax(panel_linear(hidden[rows], w, pack), dim=-1)
        assert got.shape == (len(rows), 8195)
        torch.testing.assert_close(got, want, rtol=0, atol=2e-5)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    with torch.inference_mode(), pytest.raises(ValueError, match="rows 0..24"):
        panel_logprobs(hidden, [0, 24], w, pack)
    with torch.enable_grad():
        assert panel_logprobs(hidden, [1], w, pack) is None


def test_packing_refuses_what_gemm_cannot_multiply():
    assert not packable(torch.ones(4, 5, dtype=torch.bfloat16)) and packable(torch.ones(4, 5))
    with pytest.raises(ValueError, match="cannot pack"):
        pack_panels(torch.ones(4, 5, dtype=torch.bfloat16))


@pytest.mark.parametrize("inner", [24, 83, 576])
def test_bf16_kernel_with_fp32_outputs(lib, inner):
    """skinny_bf16_f32, the whole native forwards' products: the fp32 sums that skinny_bf16 rounds to bf16, kept
    unrounded (bf16 products are exact in fp32: only the summation order differs from torch's), and a row's
    sums the same whatever the row count."""
    g = torch.Generator().manual_seed(inner)
    w = torch.randn(37, inner, generator=g).to(torch.bfloat16)
    x = torch.randn(19, inner, generator=g).to(torch.bfloat16)

    def product(rows):
        out = torch.empty(rows.shape[0], w.shape[0])
        lib.skinny_bf16_f32(w.data_ptr(), rows.data_ptr(), out.data_ptr(), rows.shape[0], w.shape[0], inner, inner,
                            w.shape[0])
        return out

    out = product(x)
    torch.testing.assert_close(out, x.double() @ w.double().T, rtol=1e-5, atol=1e-4, check_dtype=False)
    assert torch.equal(out.to(torch.bfloat16), native._call(lib, x, w))  # skinny_bf16
    assert torch.equal(product(x[5:6].contiguous())[0], out[5])


def test_native_kernels_fall_back_cleanly(monkeypatch, tmp_path, caplog):
    mode = native_mode()  # where a native library could run here, real or emulated
    native.library.cache_clear()
    try:
        monkeypatch.setenv("CASTSPEC_NATIVE", "0")
        assert native.library() is None and native.skinny_linear(torch.randn(1, 8), torch.randn(4, 8)) is None
        native.library.cache_clear()
        monkeypatch.setenv("CASTSPEC_NATIVE", mode or "1")
        monkeypatch.setenv("CASTSPEC_CACHE", str(tmp_path))
        monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
        assert native.library() is None  # on any CPU: no build, a warning, torch's kernels
        if mode is not None:
            assert "native kernels unavailable" in caplog.text
        x, w = torch.randn(1, 8), torch.randn(4, 8)
        with torch.inference_mode():
            torch.testing.assert_close(linear(x, w, None, WeightPack()), F.linear(x, w), rtol=1e-5, atol=1e-5)
    finally:
        native.library.cache_clear()


def test_build_cache_key_covers_mode_and_compiler(lib):
    """One library per build and compiler (path and --version): a compiler upgrade builds anew."""
    mode = native.build_for(env.native_mode())
    assert native._library_path(mode, *native._compiler()).exists()
    assert native._library_path(mode, "/usr/bin/cc", "cc 1.0") != native._library_path(mode, "/usr/bin/cc", "cc 1.1")
    assert native._library_path(mode, "/usr/bin/cc", "v") != native._library_path(mode, "/opt/bin/cc", "v")
    other = "emulate" if mode != "emulate" else "avx2"
    assert native._library_path(mode, "cc", "v") != native._library_path(other, "cc", "v")


def test_per_cpu_tuning_enters_the_flags_and_the_cache_key(monkeypatch):
    """Zen 4 (AMD family 25 with AVX-512) builds gemm.c's prefetch into L2, Zen 5 (family 26) non-temporal for
    every row count (4-16 rows further ahead, more rows over smaller blocks); other CPUs and builds keep the
    defaults; a tuned build is a library of its own."""
    monkeypatch.setattr(native, "_cpu_model", lambda: ("AuthenticAMD", 25))
    tuned = native._flags("avx512")
    assert "-DPREFETCH_HINT=_MM_HINT_T1" in tuned and "-DPREFETCH_HINT=_MM_HINT_T1" not in native._flags("avx2")
    tuned_path = native._library_path("avx512", "cc", "v")
    monkeypatch.setattr(native, "_cpu_model", lambda: ("AuthenticAMD", 26))
    zen5 = native._flags("avx512")
    assert "-DPREFETCH_HINT=_MM_HINT_NTA" in zen5 and "-DPREFETCH_MIN_ROWS=1" in zen5
    assert "-DPREFETCH_LINES_PAIRS=64" in zen5 and "-DBLOCK_BYTES=98304" in zen5  # 9-16 rows; more rows
    assert "-DPREFETCH_WIDE_ROWS=4" in zen5 and "-DPREFETCH_LINES_WIDE=48" in zen5  # 4-8 rows
    assert not any(f.startswith("-DPREFETCH") for f in native._flags("avx2"))
    zen5_path = native._library_path("avx512", "cc", "v")
    for other in (("GenuineIntel", 6), None):
        monkeypatch.setattr(native, "_cpu_model", lambda other=other: other)
        assert not any(f.startswith("-DPREFETCH") for f in native._flags("avx512"))
    assert len({native._library_path("avx512", "cc", "v"), tuned_path, zen5_path}) == 3


def _builds_by_copying(monkeypatch, good):
    """native._build replaced by a copy of a good library (no compiler run); returns the list of builds."""
    builds = []

    def build(out, mode, compiler):
        builds.append(out)
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(good, out)

    monkeypatch.setattr(native, "_build", build)
    return builds


def test_a_broken_cached_library_is_rebuilt_once(lib, monkeypatch, tmp_path, caplog):
    """A cached file that does not load (truncated, say) is rebuilt, then loads and passes its checks."""
    good = native._library_path(native.build_for(env.native_mode()), *native._compiler())
    monkeypatch.setenv("CASTSPEC_CACHE", str(tmp_path))
    path = native._library_path(native.build_for(env.native_mode()), *native._compiler())
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a shared library")
    builds = _builds_by_copying(monkeypatch, good)
    native.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="castspec"):
        assert native.library() is not None
    assert builds == [path] and "castspec" not in caplog.text


def test_struct_size_mismatch_disables_the_library(lib, monkeypatch, tmp_path, caplog):
    """A struct that differs between C and native/abi.py (here: a field added on the Python side only) is
    reported and the native code is not used, after one rebuild."""
    assert abi.size_mismatches(lib) == []

    class Grown(ctypes.Structure):
        _fields_ = [*abi.Segment._fields_, ("extra", ctypes.c_int64)]

    monkeypatch.setitem(abi.SHARED, "Segment", Grown)
    good = native._library_path(native.build_for(env.native_mode()), *native._compiler())
    monkeypatch.setenv("CASTSPEC_CACHE", str(tmp_path))
    cached = native._library_path(native.build_for(env.native_mode()), *native._compiler())
    cached.parent.mkdir(parents=True)
    shutil.copyfile(good, cached)
    builds = _builds_by_copying(monkeypatch, good)
    native.library.cache_clear()
    with caplog.at_level(logging.WARNING, logger="castspec"):
        assert native.library() is None
    assert len(builds) == 1 and "Segment: C" in caplog.text and "using torch's" in caplog.text


def test_row_kernel_keeps_fp32_sums_for_fp32_activations(lib):
    """fp32 activations times bf16 weights through castspec's row kernel: the input rounded to bf16, the fp32 sums
    kept (not rounded to bf16 as a bf16 product's output would be)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 96, generator=g).bfloat16()
    for rows in (1, 5):
        x = torch.randn(rows, 96, generator=g)
        exact = x.bfloat16().double() @ w.double().T
        with torch.inference_mode():
            out = linear(x, w, None, WeightPack())
        assert out.dtype == torch.float32
        assert ((out.double() - exact).abs() <= 1e-5 * exact.abs().max()).all()
        assert not torch.equal(out, out.bfloat16().float())  # fp32 sums, not rounded ones


def check_argmax_rows():
    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(R, V, generator=g) for R, V in [(1, 49152), (16, 4099), (3, 17), (5, 1), (2, 33)]]
    special = torch.randn(5, 40, generator=g)
    special[0, 5] = special[0, 30] = 9.0  # a tie: the first
    special[1, :] = -float("inf")
    special[2, 7] = special[2, 35] = float("nan")  # NaN wins, the first one
    special[2, 3] = 99.0
    special[3, :] = -1.0
    special[3, 18], special[3, 20] = -0.0, 0.0  # equal values: the first
    special[4, 39] = float("nan")  # in the tail after the vector lanes
    for x in [*rows, special]:
        assert native.argmax_rows(x) == x.numpy().argmax(-1).tolist()
    # what it does not take: other dtypes, one row alone, a strided view
    assert native.argmax_rows(special.double()) is None and native.argmax_rows(special[0]) is None
    assert native.argmax_rows(torch.randn(8, 64)[:, ::2]) is None


def check_topk_rows():
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(R, V, generator=g) for R, V in [(7, 8192), (40, 515), (3, 17), (2, 16), (1, 5)]]
    special = torch.randn(4, 40, generator=g)
    special[0, [3, 9, 30, 33]] = 7.0  # tied across the k-th place: the smaller token ids
    special[1, :] = -float("inf")
    special[2, :20] = -float("inf")  # fewer finite values than k
    special[3, 18], special[3, 20] = -0.0, 0.0  # equal values
    special[3, 1] = special[3, 39] = 50.0  # the tail after the vector lanes
    ties = torch.randint(-6, 0, (5, 300), generator=g).float()  # many ties at every place
    for x in [*rows, special, ties]:
        for support in (None, torch.randperm(49152, generator=g)[:x.shape[1]]):
            token = (lambda c: c) if support is None else (lambda c: int(support[c]))
            for k in {1, 3, 9, min(x.shape[1], 40)} & set(range(1, x.shape[1] + 1)):
                vals, toks = native.topk_rows(x, k, support)
                want = [sorted(range(x.shape[1]), key=lambda c: (-float(row[c]), token(c)))[:k] for row in x]
                assert toks.tolist() == [[token(c) for c in w] for w in want]
                assert vals.tolist() == [[float(row[c]) for c in w] for row, w in zip(x, want)]
    # what it does not take: a row with a NaN (in the vector lanes or the tail), other dtypes, a strided view, k
    # past the row, a support of another length or dtype
    x, support = rows[0], torch.randperm(49152, generator=g)[:rows[0].shape[1]]
    for base, col in ((special, 5), (special, 37), (x, 5000)):  # filling the list, the tail, a full list
        nan = base.clone()
        nan[2, col] = float("nan")
        assert native.topk_rows(nan, 3) is None
    assert native.topk_rows(special.double(), 3) is None
    assert native.topk_rows(torch.randn(8, 64)[:, ::2], 3) is None and native.topk_rows(special, 41) is None
    assert native.topk_rows(x, 3, support[:-1]) is None and native.topk_rows(x, 3, support.int()) is None


def test_topk_rows_is_a_top_k_in_one_total_order(lib):
    """The tree builder's native top-k (topk_rows) against a sort: the k largest values descending, equal values
    by token id (the column, or the support's id for it), rows of -inf, -0.0 beside 0.0, ties across the k-th
    place, the tails after the vector lanes, and None where it does not apply (a NaN: torch decides then)."""
    check_topk_rows()


def test_argmax_rows_is_numpys_argmax(lib):
    """The verify step's greedy tokens (native argmax_rows) against numpy's argmax: first of tied maxima, the
    first NaN of a row that has one, rows of -inf, -0.0 beside 0.0, row lengths with every tail."""
    check_argmax_rows()


def test_argmax_and_topk_rows_in_the_avx2_build(monkeypatch):
    """The same on the AVX2 build (its compare is avx2.h's emulation of the AVX-512 one), where this CPU runs it."""
    if not native.cpu_supported("avx2"):
        pytest.skip("no AVX2 on this CPU")
    monkeypatch.setenv("CASTSPEC_NATIVE", "avx2")
    native.library.cache_clear()
    try:
        if native.library() is None:
            pytest.skip("the AVX2 build did not build here (no C compiler?)")
        check_argmax_rows()
        check_topk_rows()
    finally:
        native.library.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_slots_moves_a_walked_packs_rows_as_indexed_copies_do(lib, dtype):
    """The native move of a verify pack's kept cache rows (keep_slots) against torch's indexed copies, in every
    layer and head of keys and values, and None of it where it does not apply (a strided cache)."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 1, 2, 20, 16, generator=g).to(dtype) for _ in range(2))
    src, dst = [9, 12, 13, 17], 8
    want_k, want_v = k.clone(), v.clone()
    for t in (want_k, want_v):
        t[:, :, :, dst:dst + len(src)] = t.index_select(3, torch.tensor(src))
    assert native.keep_slots(k, v, src, dst)
    assert torch.equal(k, want_k) and torch.equal(v, want_v)
    assert not native.keep_slots(k[..., ::2], v[..., ::2], src, dst) and not native.keep_slots(k, v.double(), src, dst)
