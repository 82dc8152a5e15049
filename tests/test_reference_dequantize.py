"""Dequantization of every copy under every RHT / random-sign / row-scaled setting (and 2D weights, SR gradients,
the 4over6 bound), held bit for bit to tests/helpers/dequantize_oracle.py, written from docs/numerics.md alone."""
import itertools

import numpy as np
import pytest
import torch

import nvfp4_dist as nv
from nvfp4_dist import ops
from tests.helpers import dequantize_oracle

ROWS, COLS = 48, 64


def data(seed=0):
    """BF16 [48, 64] with columns over three decades, exact zeros and a -0.0."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(ROWS, COLS, generator=generator) * torch.logspace(-1.5, 1.5, COLS)
    x[5, :16] = 0.0
    x[7, 3] = -0.0
    return x.to(torch.bfloat16)


SETTINGS = [pytest.param(rht, random_sign, row_scaled,
                         id=f"rht={rht}-random_sign={random_sign}-row_scaled={row_scaled}")
            for rht, random_sign, row_scaled in itertools.product((False, True), repeat=3)]


def check_copies(q, what):
    assert q.has_rowwise and q.has_columnwise
    for copy in ("rowwise", "columnwise"):
        expected = dequantize_oracle.dequantize(q, copy)
        got = ops.dequantize(q, torch.float32, copy).reshape(ROWS, COLS).numpy()
        mismatch = ~((got == expected) | (np.isnan(got) & np.isnan(expected)))
        assert not mismatch.any(), (f"{what} {copy}: {int(mismatch.sum())} values differ, first at "
                                    f"{np.argwhere(mismatch)[0].tolist()}")
        assert np.array_equal(np.signbit(got), np.signbit(expected)), f"{what} {copy}: signs of zeros"
        in_bf16 = ops.dequantize(q, torch.bfloat16, copy).reshape(ROWS, COLS)
        assert torch.equal(in_bf16, torch.from_numpy(expected).to(torch.bfloat16)), f"{what} {copy} as BF16"


@pytest.mark.parametrize("rht,random_sign,row_scaled", SETTINGS)
def test_activation_copies_dequantize_as_the_spec_says(rht, random_sign, row_scaled):
    recipe = nv.NVFP4Recipe(rht=rht, rht_random_sign=random_sign, row_scaled_activation=row_scaled)
    q = ops.quantize(data(), "activation", recipe=recipe)
    assert (q.rht, q.rht_random_sign if rht else random_sign, q.row_scaled) == (rht, random_sign, row_scaled)
    check_copies(q, f"activation rht={rht} random_sign={random_sign} row_scaled={row_scaled}")


@pytest.mark.parametrize("rht,random_sign", list(itertools.product((False, True), repeat=2)))
def test_gradient_copies_with_stochastic_rounding_dequantize_as_the_spec_says(rht, random_sign):
    recipe = nv.NVFP4Recipe(rht=rht, rht_random_sign=random_sign)
    check_copies(ops.quantize(data(1), "gradient", recipe=recipe, sr_seed=7), f"gradient rht={rht}")


@pytest.mark.parametrize("weight_2d", [False, True])
def test_weight_copies_dequantize_as_the_spec_says(weight_2d):
    check_copies(ops.quantize(data(2), "weight", recipe=nv.NVFP4Recipe(weight_2d=weight_2d)), "weight")


def test_the_4over6_bound_decodes_with_its_own_global_scale():
    recipe = nv.NVFP4Recipe(rht=False, nvfp4_4over6="all", nvfp4_4over6_e4m3_use_256="all")
    q = ops.quantize(data(3), "activation", recipe=recipe)
    assert q.e4m3_bound == 256
    check_copies(q, "4over6 (bound 256)")
