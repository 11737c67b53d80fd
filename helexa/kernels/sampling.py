"""Turning a batch of logits rows into tokens, each row with its own parameters, on the device.

Three steps, each a Triton kernel beside its naive twin; the first two here:

- `apply_token_bitmask`: structured output's constraint: a row's logits set to -inf where its
  bitmask (int32 words, bit t % 32 of word t // 32, as llguidance fills it) has a 0 bit, so
  only the tokens its grammar allows next can be drawn. Rows that are not constrained carry
  all-ones words and pass unchanged.
- `apply_penalties`: HF's repetition penalty over the tokens a row has seen (prompt and
  output: a positive logit divided by it, a negative one multiplied), then OpenAI's frequency
  and presence penalties over its output tokens (logit -= frequency * count + presence *
  (count > 0)). The tokens come as flat (row, token id) pairs, output tokens first, so the
  host builds one array per step and no Python loop touches the device.
- `sample` (its own module, filtered_sample.py): per row, temperature, top-k, top-p and
  min-p, then the exponential race over the kept tokens.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


SEEN = 1 << 30  # the Triton counts' flag for a token in the prompt (the low bits count output)


def naive_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place on logits [N, V] (any float dtype): -inf where bitmask [N, ceil(V / 32)]
    int32 has bit t % 32 of word t // 32 clear."""
    n, vocab = logits.shape
    shifts = torch.arange(32, device=bitmask.device, dtype=torch.int32)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, W, 32]
    allowed = bits.reshape(n, -1)[:, :vocab].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def naive_apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    num_output: int,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """In place on logits [N, V] fp32 contiguous. rows, tokens [P] int: (row, token id) pairs,
    the first num_output a row's output tokens (each occurrence once), the rest the prompt
    tokens it has seen; token ids >= V are ignored. repetition, frequency, presence [N] fp32
    (1, 0, 0: none)."""
    vocab = logits.shape[-1]
    flat = logits.view(-1)
    pos = rows.long() * vocab + tokens.long()
    ok = tokens < vocab
    seen = pos[ok].unique()
    vals, rep = flat[seen], repetition[seen // vocab]
    flat[seen] = torch.where(vals > 0, vals / rep, vals * rep)
    out_pos, counts = pos[:num_output][ok[:num_output]].unique(return_counts=True)
    row = out_pos // vocab
    # presence * (count > 0) is presence where count > 0; elsewhere both terms are 0
    flat[out_pos] -= frequency[row] * counts.to(logits.dtype) + presence[row]


if triton is not None:

    @triton.jit
    def _token_bitmask_kernel(logits_ptr, bitmask_ptr, vocab, stride_l, stride_b,
                              BLOCK: tl.constexpr):  # fmt: skip
        """Grid (N, V / BLOCK): a tile of a row's logits, -inf where its bit is clear."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < vocab
        words = tl.load(bitmask_ptr + row * stride_b + cols // 32, mask=ok, other=-1)
        banned = ((words >> (cols % 32)) & 1) == 0
        tl.store(logits_ptr + row * stride_l + cols, float("-inf"), mask=ok & banned)

    @triton.jit
    def _count_tokens_kernel(
        counts_ptr, rows_ptr, tokens_ptr, num_pairs, num_output, vocab,
        SEEN_FLAG: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """counts [N, V] int32: +1 per output pair, the SEEN_FLAG bit per prompt pair."""
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = i < num_pairs
        row = tl.load(rows_ptr + i, mask=ok, other=0).to(tl.int64)
        tok = tl.load(tokens_ptr + i, mask=ok, other=0).to(tl.int64)
        ok = ok & (tok >= 0) & (tok < vocab)
        ptrs = counts_ptr + row * vocab + tok
        tl.atomic_add(ptrs, 1, mask=ok & (i < num_output), sem="relaxed")
        tl.atomic_or(ptrs, SEEN_FLAG, mask=ok & (i >= num_output), sem="relaxed")

    @triton.jit
    def _apply_penalties_kernel(
        logits_ptr, counts_ptr, rep_ptr, freq_ptr, pres_ptr, vocab, stride_l,
        SEEN_FLAG: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """Grid (N, V / BLOCK); rows without penalties return at once."""
        row = tl.program_id(0)
        rep = tl.load(rep_ptr + row)
        freq = tl.load(freq_ptr + row)
        pres = tl.load(pres_ptr + row)
        if (rep != 1.0) | (freq != 0.0) | (pres != 0.0):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            ok = cols < vocab
            lptrs = logits_ptr + row.to(tl.int64) * stride_l + cols
            logit = tl.load(lptrs, mask=ok, other=0.0)
            c = tl.load(counts_ptr + row.to(tl.int64) * vocab + cols, mask=ok, other=0)
            count = c & (SEEN_FLAG - 1)
            seen = ((c & SEEN_FLAG) != 0) | (count > 0)
            logit = tl.where(
                seen, tl.where(logit > 0, tl.math.div_rn(logit, rep), logit * rep), logit
            )
            logit = logit - (freq * count.to(tl.float32) + pres * (count > 0).to(tl.float32))
            tl.store(lptrs, logit, mask=ok)


def _check(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocabulary")
    return t


def triton_apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """As naive_apply_token_bitmask, one launch, no host sync: logits [N, V] (rows may be
    strided), bitmask [N, ceil(V / 32)] int32 on the same device."""
    if triton is None:
        raise RuntimeError(
            "triton_apply_token_bitmask needs triton, which is not installed; "
            "use naive_apply_token_bitmask"
        )
    _check(logits, "logits")
    _check(bitmask, "bitmask")
    n, vocab = logits.shape
    if n == 0:
        return
    block = min(triton.next_power_of_2(vocab), 4096)
    _token_bitmask_kernel[(n, triton.cdiv(vocab, block))](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block, num_warps=4
    )


def triton_apply_penalties(
    logits: torch.Tensor,
    rows: torch.Tensor,
    tokens: torch.Tensor,
    num_output: int,
    repetition: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> None:
    """As naive_apply_penalties, in two Triton launches and no host sync: the pairs counted
    into an [N, V] int32 buffer (atomics), then one pass over the rows with penalties.
    logits [N, V] fp32 (rows may be strided), rows and tokens [P] int contiguous."""
    if triton is None:
        raise RuntimeError(
            "triton_apply_penalties needs triton, which is not installed; use naive_apply_penalties"
        )
    _check(logits, "logits")
    n, vocab = logits.shape
    num_pairs = tokens.numel()
    if n == 0 or num_pairs == 0:
        return
    counts = torch.zeros(n, vocab, dtype=torch.int32, device=logits.device)
    block = 1024
    _count_tokens_kernel[(triton.cdiv(num_pairs, block),)](
        counts, rows, tokens, num_pairs, num_output, vocab, SEEN_FLAG=SEEN, BLOCK=block
    )
    block = min(triton.next_power_of_2(vocab), 2048)
    _apply_penalties_kernel[(n, triton.cdiv(vocab, block))](
        logits, counts, repetition, frequency, presence, vocab, logits.stride(0),
        SEEN_FLAG=SEEN, BLOCK=block, num_warps=4,
    )  # fmt: skip
