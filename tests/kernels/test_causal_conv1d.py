"""The causal conv kernels: the naive ones against HF's, the Triton ones against the naive."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_fn, causal_conv1d_update

from helexa.kernels.causal_conv1d import (
    naive_causal_conv1d,
    naive_causal_conv1d_update,
    triton_causal_conv1d,
    triton_causal_conv1d_update,
)

from . import DEVICE, max_rel_error, needs_triton

WIDTH = 4


def conv_inputs(num_tokens: int, num_channels: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, num_channels, generator=gen)
    weight = torch.randn(num_channels, WIDTH, generator=gen) * 0.5
    bias = torch.randn(num_channels, generator=gen) * 0.1
    state = torch.randn(num_channels, WIDTH - 1, generator=gen)
    return x, weight, bias, state


@pytest.mark.parametrize("activation", ["silu", None])
def test_naive_conv_matches_hf_from_a_zero_state(activation):
    x, weight, bias, _ = conv_inputs(63, 60)
    out, final = naive_causal_conv1d(x, weight, bias, activation=activation)
    want = causal_conv1d_fn(x.T[None], weight, bias, activation=activation)[0].T
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, x[-(WIDTH - 1) :].T)


def test_naive_conv_continues_from_a_state_as_hf_update_does():
    x, weight, bias, state = conv_inputs(63, 60)
    hf_state = state[None].clone()
    want = causal_conv1d_update(x.T[None], hf_state, weight, bias, "silu")[0].T
    out, final = naive_causal_conv1d(x, weight, bias, state)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(final, hf_state[0])


def test_naive_conv_of_fewer_tokens_than_the_state_keeps_part_of_the_old_state():
    x, weight, bias, state = conv_inputs(2, 60)
    _, final = naive_causal_conv1d(x, weight, bias, state)
    torch.testing.assert_close(final, torch.cat([state[:, 2:], x.T], dim=1))


def test_a_prompt_in_chunks_equals_the_prompt_at_once():
    x, weight, bias, state = conv_inputs(63, 60)
    whole, whole_final = naive_causal_conv1d(x, weight, bias, state)
    first, mid = naive_causal_conv1d(x[:30], weight, bias, state)
    second, final = naive_causal_conv1d(x[30:], weight, bias, mid)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    torch.testing.assert_close(final, whole_final)


def test_naive_update_matches_hf_and_touches_only_its_rows():
    x, weight, bias, _ = conv_inputs(3, 60)
    pool = torch.randn(5, 60, WIDTH - 1, generator=torch.Generator().manual_seed(1))
    before = pool.clone()
    rows = torch.tensor([4, 0, 2])
    out = naive_causal_conv1d_update(x, pool, weight, bias, rows)
    hf_state = before[rows].clone()
    want = causal_conv1d_update(x[:, :, None], hf_state, weight, bias, "silu")[:, :, 0]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(pool[rows], hf_state)
    torch.testing.assert_close(pool[[1, 3]], before[[1, 3]])


def test_decode_steps_continue_the_prompt():
    x, weight, bias, state = conv_inputs(10, 60)
    whole, _ = naive_causal_conv1d(x, weight, bias, state)
    _, final = naive_causal_conv1d(x[:7], weight, bias, state)
    pool = final[None].clone()
    steps = [naive_causal_conv1d_update(x[t : t + 1], pool, weight, bias) for t in range(7, 10)]
    torch.testing.assert_close(torch.cat(steps), whole[7:])


# Triton against naive. Both sum W=4 products in fp32 in the same order, so they agree to a few
# fp32 ulps: a bound of 1e-5 of the output's scale leaves room only for silu's exp.
RTOL = 1e-5


@needs_triton
@pytest.mark.parametrize("num_tokens", [1, 2, 63])
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("activation", ["silu", None])
def test_triton_conv_matches_naive(num_tokens, with_state, activation):
    x, weight, bias, state = (t.to(DEVICE) for t in conv_inputs(num_tokens, 60))
    state = state if with_state else None
    out, final = triton_causal_conv1d(x, weight, bias, state, activation=activation)
    want, want_final = naive_causal_conv1d(x, weight, bias, state, activation=activation)
    assert max_rel_error(out, want) < RTOL
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)


@needs_triton
def test_triton_conv_reads_a_strided_slice_without_bias_in_bf16():
    # the model convolves a column slice of one projection's output, in bf16
    wide, weight, _, state = conv_inputs(63, 100)
    x = wide.bfloat16().to(DEVICE)[:, 20:80]
    weight, state = weight[:60].to(DEVICE), state[:60].to(DEVICE)
    out, final = triton_causal_conv1d(x, weight, None, state)
    want, want_final = naive_causal_conv1d(x, weight, None, state)
    assert out.dtype == torch.bfloat16
    # the same fp32 result made bf16: at most one ulp (2^-7) apart, as Triton's interpreter
    # truncates where torch rounds to nearest
    assert max_rel_error(out, want) < 1e-2
    torch.testing.assert_close(final, want_final, rtol=0, atol=0)


@needs_triton
@pytest.mark.parametrize("num_seqs", [1, 5])
def test_triton_update_matches_naive_and_updates_the_same_rows(num_seqs):
    x, weight, bias, _ = (t.to(DEVICE) for t in conv_inputs(num_seqs, 60))
    pool = torch.randn(7, 60, WIDTH - 1, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    rows = torch.tensor([6, 0, 3, 2, 5][:num_seqs], device=DEVICE)
    want_pool = pool.clone()
    out = triton_causal_conv1d_update(x, pool, weight, bias, rows)
    want = naive_causal_conv1d_update(x, want_pool, weight, bias, rows)
    assert max_rel_error(out, want) < RTOL
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0)


@needs_triton
def test_triton_update_without_indices_uses_the_first_rows():
    x, weight, _, _ = (t.to(DEVICE) for t in conv_inputs(3, 60))
    pool = torch.randn(3, 60, WIDTH - 1, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    want_pool = pool.clone()
    out = triton_causal_conv1d_update(x, pool, weight, None, activation=None)
    want = naive_causal_conv1d_update(x, want_pool, weight, None, activation=None)
    assert max_rel_error(out, want) < RTOL
    torch.testing.assert_close(pool, want_pool, rtol=0, atol=0)
