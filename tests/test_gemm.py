"""The compiled matrix products (`trainer/csrc/gemm.cpp`) against float64 references, on every tile
remainder (rows, columns and the summed dimension not multiples of the tiles or the vector width),
strided rows, a summed dimension past the cache block, and from run to run the same bits. Each test
runs both forms, whichever this CPU takes by default: the register-tiled loops (a decoding step's, and
the gradients' on AVX-512) and the packed one (the training forward's, and every product's on AVX2), set through
`torch.ops.posttrain.gemm_form`."""

from __future__ import annotations

import itertools

import pytest
import torch

from trainer import kernels


@pytest.fixture(scope="module")
def built():
    op = kernels.ops()
    assert op is not None, "the compiled kernels did not build: `python -m trainer.kernels -v`"
    return op


@pytest.fixture(params=["tiled", "packed"])
def ops(built, request):
    """The kernels with every product in one form (the default, "auto", restored after)."""
    before = built.gemm_form(request.param)
    try:
        yield built
    finally:
        built.gemm_form(before)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """float32 sums of up to a few thousand terms: relative to the largest output."""
    scale = want.abs().max().item() or 1.0
    err = (got.double() - want).abs().max().item() / scale
    assert err < 2e-6, err


SIZES = [1, 3, 4, 5, 8, 9, 17, 33, 70]


@pytest.mark.parametrize("M,N", list(itertools.product([1, 2, 5, 8, 13, 67, 151], [1, 3, 4, 7, 16, 49, 130])))
def test_linear_forward_and_both_gradients_on_every_remainder(ops, M, N):
    g = torch.Generator().manual_seed(M * 1000 + N)
    for K in (1, 7, 16, 33, 300):
        x, w, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g), torch.randn(N, generator=g)
        dy = torch.randn(M, N, generator=g)
        _close(ops.linear_fwd(x, w, None), x.double() @ w.double().T)
        _close(ops.linear_fwd(x, w, b), x.double() @ w.double().T + b.double())
        _close(ops.linear_dx(dy, w), dy.double() @ w.double())
        _close(ops.linear_dw(dy, x), dy.double().T @ x.double())


def test_long_sums_past_the_cache_block_and_strided_rows(ops):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(600, 1100, generator=g)
    x = big[:, 37:37 + 576]  # rows strided by 1100, columns contiguous
    w = torch.randn(1000, 576, generator=g)
    dy = torch.randn(600, 1000, generator=g)
    _close(ops.linear_fwd(x, w, None), x.double() @ w.double().T)
    _close(ops.linear_dx(dy, w), dy.double() @ w.double())         # sums 1000 terms: 4 blocks of 256
    _close(ops.linear_dw(dy, x), dy.double().T @ x.double())       # 600 terms, 1000 x 576 out
    _close(ops.linear_dw(dy[:0], x[:0]), torch.zeros(1000, 576, dtype=torch.float64))  # an empty sum is 0
    # past the packed form's block of 1,024 columns, twice, with a remainder
    x2, w2, dy2 = torch.randn(300, 40, generator=g), torch.randn(2100, 40, generator=g), torch.randn(300, 70, generator=g)
    big2 = torch.randn(300, 2200, generator=g)
    _close(ops.linear_fwd(x2, w2, None), x2.double() @ w2.double().T)
    _close(ops.linear_dw(dy2, big2), dy2.double().T @ big2.double())
    # a weight's gradient over a megabyte of dY, which the tiled loops copy a block at a time, its last
    # block of rows ending 3 rows into a tile
    dy3, x3 = torch.randn(300, 1003, generator=g), torch.randn(300, 70, generator=g)
    _close(ops.linear_dw(dy3, x3), dy3.double().T @ x3.double())


def test_a_rows_outputs_do_not_depend_on_the_rows_beside_it(ops):
    """Within one form, a row of x W^T or of dY W is the same bits whichever rows share the call
    (the head's log-probs recompute a block of rows in the backward pass and get the forward's)."""
    g = torch.Generator().manual_seed(2)
    x, w, dy = torch.randn(300, 200, generator=g), torch.randn(150, 200, generator=g), torch.randn(300, 150, generator=g)
    full_y, full_dx = ops.linear_fwd(x, w, None), ops.linear_dx(dy, w)
    for lo, hi in ((0, 1), (7, 100), (101, 300)):
        assert torch.equal(ops.linear_fwd(x[lo:hi], w, None), full_y[lo:hi])
        assert torch.equal(ops.linear_dx(dy[lo:hi], w), full_dx[lo:hi])


@pytest.mark.parametrize("M", [5, 300])  # below and above the packed form's rows on AVX2
def test_layers_side_by_side_are_the_bits_of_their_concatenation(ops, M):
    """linears_fwd (q/k/v and gate/up in one call) writes each layer's product at its columns: the
    bits of torch.cat over linear_fwd, biases or None, widths that are not multiples of a tile."""
    g = torch.Generator().manual_seed(M)
    x = torch.randn(M, 200, generator=g)
    ws = [torch.randn(n, 200, generator=g) for n in (150, 49, 49, 1030)]
    bs = [torch.randn(150, generator=g), None, torch.randn(49, generator=g), None]
    want = torch.cat([ops.linear_fwd(x, w, b) for w, b in zip(ws, bs)], dim=-1)
    assert torch.equal(ops.linears_fwd(x, ws, bs), want)
    assert torch.equal(ops.linears_fwd(x, ws[:1], bs[:1]), want[:, :150])


@pytest.mark.parametrize("M", [5, 300])
def test_layers_input_gradient_is_one_sum_over_their_columns(ops, M):
    """linears_dx (the gradient through q/k/v or gate/up) adds each layer's product where the one
    before left it: the bits of linear_dx on the stacked weight, one FMA chain per element, and a
    sum past the 256-column block across a layer's edge."""
    g = torch.Generator().manual_seed(M + 1)
    ws = [torch.randn(n, 70, generator=g) for n in (150, 49, 1, 300)]
    dy = torch.randn(M, 500, generator=g)
    got = ops.linears_dx(dy, ws)
    assert torch.equal(got, ops.linear_dx(dy, torch.cat(ws)))
    _close(got, dy.double() @ torch.cat(ws).double())
    wide = torch.randn(M, 520, generator=g)[:, :500]  # dy's rows at a stride (a slice of a wider tensor)
    assert torch.equal(ops.linears_dx(wide, ws), ops.linear_dx(wide.contiguous(), torch.cat(ws)))


def test_same_bits_whatever_the_thread_count(ops):
    """Each output is summed by one thread in one order: 1 and 2 threads give identical bits."""
    g = torch.Generator().manual_seed(1)
    x, w, dy = torch.randn(130, 576, generator=g), torch.randn(1536, 576, generator=g), torch.randn(130, 1536, generator=g)
    before = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            outs.append((ops.linear_fwd(x, w, None), ops.linear_dx(dy, w), ops.linear_dw(dy, x)))
    finally:
        torch.set_num_threads(before)
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_the_form_is_named_and_a_wrong_name_refused(built):
    assert built.gemm_form("") == "auto"
    with pytest.raises(RuntimeError, match="gemm_form: fast is not a form: use auto, packed or tiled"):
        built.gemm_form("fast")
    assert built.gemm_form("") == "auto"


def test_auto_takes_the_form_measured_faster_on_this_cpu(built):
    """"auto": the packed form for a forward of 256 rows or more, on AVX-512 unless the weight has
    over 32 times as many rows (an output head over a vocabulary); the tiled loops for fewer rows (a
    decoding step's), and for an output head on AVX-512. No vendor enters: one ISA, one choice. The
    forms differ in the forward's bits, which tell which ran; both gradients are one FMA chain per
    element either way, the same bits, so their form is speed only."""
    g = torch.Generator().manual_seed(3)
    avx2 = kernels.variant() != "avx512"
    cases = ((300, 150, "packed"), (16, 150, "tiled"),
             (300, 32 * 300 + 32, "packed" if avx2 else "tiled"))
    for rows, out, want in cases:
        w = torch.randn(out, 200, generator=g)
        x, dy = torch.randn(rows, 200, generator=g), torch.randn(rows, out, generator=g)
        got = {}
        try:
            for form in ("tiled", "packed", "auto"):
                built.gemm_form(form)
                got[form] = (built.linear_fwd(x, w, None), built.linear_dx(dy, w), built.linear_dw(dy, x))
        finally:
            built.gemm_form("auto")
        assert not torch.equal(got["tiled"][0], got["packed"][0])  # the forward's bits tell the forms apart
        assert torch.equal(got["auto"][0], got[want][0]), f"{rows} x {out}: auto did not take the {want} form"
        for grad in (1, 2):
            assert torch.equal(got["tiled"][grad], got["packed"][grad])
            assert torch.equal(got["auto"][grad], got["tiled"][grad])


def test_bad_operands_are_refused_by_name(ops):
    x, w = torch.randn(4, 8), torch.randn(5, 8)
    with pytest.raises(RuntimeError, match="linear_fwd: shapes disagree"):
        ops.linear_fwd(x, torch.randn(5, 9), None)
    with pytest.raises(RuntimeError, match="linear_fwd: x must be a 2-d float32"):
        ops.linear_fwd(x.double(), w, None)
    with pytest.raises(RuntimeError, match="linear_fwd: w must be a 2-d float32 CPU tensor with contiguous rows"):
        ops.linear_fwd(x, torch.randn(8, 5).T, None)
    with pytest.raises(RuntimeError, match="linear_fwd: b must be a contiguous float32"):
        ops.linear_fwd(x, w, torch.randn(4))
    with pytest.raises(RuntimeError, match="linears_fwd: 2 weights and 1 biases: give one bias"):
        ops.linears_fwd(x, [w, w], [None])
    with pytest.raises(RuntimeError, match=r"linears_fwd: shapes disagree: x \[4, 8\], w 1 \[5, 9\]"):
        ops.linears_fwd(x, [w, torch.randn(5, 9)], [None, None])
    with pytest.raises(RuntimeError, match="linears_fwd: b 1 must be a contiguous float32 \\[5\\]"):
        ops.linears_fwd(x, [w, w], [None, torch.randn(4)])
    with pytest.raises(RuntimeError, match=r"linears_dx: shapes disagree: dy \[4, 6\] against weights 10 rows in all"):
        ops.linears_dx(torch.randn(4, 6), [w, w])
    with pytest.raises(RuntimeError, match=r"linears_dx: shapes disagree: w 0 \[5, 8\], w 1 \[1, 9\]"):
        ops.linears_dx(torch.randn(4, 6), [w, torch.randn(1, 9)])
    with pytest.raises(RuntimeError, match="linear_dx: shapes disagree"):
        ops.linear_dx(torch.randn(4, 6), w)
    with pytest.raises(RuntimeError, match="linear_dw: shapes disagree"):
        ops.linear_dw(torch.randn(3, 5), x)
