"""Turning a batch of logits rows into tokens, each row with its own parameters, on the device.

Three steps, each a Triton kernel beside its naive twin:

- `apply_token_bitmask`: structured output's constraint: a row's logits set to -inf where its
  bitmask (int32 words, bit t % 32 of word t // 32, as llguidance fills it) has a 0 bit, so
  only the tokens its grammar allows next can be drawn. Rows that are not constrained carry
  all-ones words and pass unchanged.
- `apply_penalties`: HF's repetition penalty over the tokens a row has seen (prompt and
  output: a positive logit divided by it, a negative one multiplied), then OpenAI's frequency
  and presence penalties over its output tokens (logit -= frequency * count + presence *
  (count > 0)). The tokens come as flat (row, token id) pairs, output tokens first, so the
  host builds one array per step and no Python loop touches the device.
- `sample`: per row, logits / temperature; keep the top_k most likely (0: all); keep tokens
  while the probability mass strictly before them (most likely first) is <= top_p, within the
  top-k; drop those whose probability is below min_p times the largest; then the exponential
  race: token = argmax(prob / noise) over the kept ones, noise being Exp(1) draws given as
  input (so a seeded row draws them where it likes, and the two versions can be compared
  exactly). Rows with temperature 0 or top_k 1 are greedy: argmax of the logits as given.

The naive sample sorts each row, as the engine's sampler always has. The Triton one never
sorts: one program per row finds the max (and the greedy token) and the softmax normaliser in
one pass over the vocabulary, then searches the logit threshold that keeps exactly the top-k,
then the one that keeps exactly the top-p mass, each search a few passes that count (and sum
the probability of) the logits above NUM_PIVOTS evenly spaced candidate thresholds at once
and narrow the bracket to the two neighbouring candidates; a search stops as soon as at most
one logit lies between the bracket's ends (or exactly k above its lower end). A last pass
runs the race over the kept tokens, loading noise only for them. Kept sets equal the sort's
where there are no ties (tied logits at the cut are all kept; the sort keeps some).
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


def naive_filter(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p by sorting each row: logits [N, V] fp32; per-row
    [N] parameters (temperature 0 counts as 1 here) -> probabilities [N, V], dropped ones 0."""
    logits = logits / torch.where(temperature == 0, 1.0, temperature).unsqueeze(1)
    if bool((top_k > 0).any()) or bool((top_p < 1.0).any()):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[-1]
        ks = torch.where(top_k > 0, top_k, vocab)
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        drop = ranks >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(-1)
        cum = probs.cumsum(-1) - probs  # mass strictly before each token
        drop |= cum > top_p.unsqueeze(1)
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    if bool((min_p > 0).any()):
        floor = min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def naive_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """logits, noise [N, V] fp32 (noise: Exp(1) draws; greedy rows' are not read);
    temperature, top_p, min_p [N] fp32; top_k [N] int (0: off) -> tokens [N] int64."""
    greedy = (temperature == 0) | (top_k == 1)
    tokens = logits.argmax(-1)
    if bool(greedy.all()):
        return tokens
    probs = naive_filter(logits, temperature, top_k, top_p, min_p)
    return torch.where(greedy, tokens, (probs / noise).argmax(-1))


if triton is not None:
    _FLT_MAX = tl.constexpr(3.4028234663852886e38)
    _LOG2E = tl.constexpr(1.4426950408889634)

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

    @triton.jit
    def _logits_tile(lrow, idx, vocab):
        """A tile of a row: out-of-range lanes -inf, -inf logits clamped to -FLT_MAX (so every
        real logit is above the -inf sentinel and the pivots stay finite)."""
        ok = idx < vocab
        x = tl.load(lrow + idx, mask=ok, other=0.0)
        return tl.where(ok, tl.maximum(x, -_FLT_MAX), float("-inf")), ok

    @triton.jit
    def _mass_above(lrow, vocab, m, scale, lo, BLOCK_V: tl.constexpr):
        """The unnormalised probability mass of the logits above lo."""
        offs = tl.arange(0, BLOCK_V)
        mass = tl.zeros([BLOCK_V], dtype=tl.float32)
        for start in range(0, vocab, BLOCK_V):
            x, ok = _logits_tile(lrow, start + offs, vocab)
            mass += tl.where(ok & (x > lo), tl.exp2((x - m) * scale), 0.0)
        return tl.sum(mass, axis=0)

    @triton.jit
    def _search(
        lrow, vocab, m, scale, base, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, target,
        BY_MASS: tl.constexpr, BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr,
        MAX_PASSES: tl.constexpr,
    ):  # fmt: skip
        """Narrow (lo, hi] around the cut: R(t) = "count above t >= k" (top-k) or "mass above t
        > target" (top-p) holds at lo and not at hi. Returns lo and the count and mass above
        it (the mass only BY_MASS); the kept tokens are those above lo. `base` spaces the
        pivots while lo is -inf."""
        j = tl.arange(0, NUM_PIVOTS)
        frac = (j + 1).to(tl.float32) / (NUM_PIVOTS + 1)
        offs = tl.arange(0, BLOCK_V)
        go = (cnt_lo - cnt_hi) > 1
        if not BY_MASS:
            go = go & (cnt_lo != k)
        passes = 0
        while go & (passes < MAX_PASSES):
            a = tl.where(lo == float("-inf"), base, lo)
            piv = a + (hi - a) * frac
            cnt = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
            mass = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
            for start in range(0, vocab, BLOCK_V):
                x, ok = _logits_tile(lrow, start + offs, vocab)
                above = x[:, None] > piv[None, :]
                cnt += tl.sum(above.to(tl.int32), axis=0)
                if BY_MASS:
                    e = tl.where(ok, tl.exp2((x - m) * scale), 0.0)
                    mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
            if BY_MASS:
                holds = mass > target
            else:
                holds = cnt >= k
            inside = (piv > lo) & (piv < hi)
            jl = tl.max(tl.where(holds & inside, j, -1), axis=0)
            jh = tl.min(tl.where((~holds) & inside, j, NUM_PIVOTS), axis=0)
            up, down = jl >= 0, jh < NUM_PIVOTS
            at_l, at_h = j == jl, j == jh
            lo = tl.where(up, tl.sum(tl.where(at_l, piv, 0.0), axis=0), lo)
            cnt_lo = tl.where(up, tl.sum(tl.where(at_l, cnt, 0), axis=0), cnt_lo)
            mass_lo = tl.where(up, tl.sum(tl.where(at_l, mass, 0.0), axis=0), mass_lo)
            hi = tl.where(down, tl.sum(tl.where(at_h, piv, 0.0), axis=0), hi)
            cnt_hi = tl.where(down, tl.sum(tl.where(at_h, cnt, 0), axis=0), cnt_hi)
            mass_hi = tl.where(down, tl.sum(tl.where(at_h, mass, 0.0), axis=0), mass_hi)
            passes += 1
            go = (up | down) & ((cnt_lo - cnt_hi) > 1)  # no pivot inside: float resolution
            if not BY_MASS:
                go = go & (cnt_lo != k)
        return lo, cnt_lo, mass_lo

    @triton.jit
    def _sample_kernel(
        logits_ptr, noise_ptr, out_ptr, temp_ptr, top_k_ptr, top_p_ptr, min_p_ptr,
        vocab, stride_l, stride_n,
        BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr,
    ):  # fmt: skip
        """One program per row. Thresholds are searched on the raw logits (temperature keeps
        their order); probabilities are exp2((x - max) * log2(e) / temperature)."""
        row = tl.program_id(0)
        lrow = logits_ptr + row.to(tl.int64) * stride_l
        temp = tl.load(temp_ptr + row).to(tl.float32)
        k = tl.load(top_k_ptr + row).to(tl.int32)
        top_p = tl.load(top_p_ptr + row).to(tl.float32)
        min_p = tl.load(min_p_ptr + row).to(tl.float32)
        scale = _LOG2E / tl.where(temp == 0, 1.0, temp)
        offs = tl.arange(0, BLOCK_V)
        # pass 1: max and its first index, smallest finite logit, softmax normaliser
        m = tl.full([], float("-inf"), tl.float32)
        mn = tl.full([], float("inf"), tl.float32)
        z = tl.zeros([], tl.float32)
        arg = tl.zeros([], tl.int32)
        for start in range(0, vocab, BLOCK_V):
            x, ok = _logits_tile(lrow, start + offs, vocab)
            tile_max = tl.max(x, axis=0)
            tile_arg = tl.argmax(x, axis=0, tie_break_left=True)
            arg = tl.where(tile_max > m, start + tile_arg, arg)
            m_new = tl.maximum(m, tile_max)
            finite = ok & (x > -_FLT_MAX)
            mn = tl.minimum(mn, tl.min(tl.where(finite, x, float("inf")), axis=0))
            e = tl.where(ok, tl.exp2((x - m_new) * scale), 0.0)
            z = z * tl.exp2((m - m_new) * scale) + tl.sum(e, axis=0)
            m = m_new
        if (temp == 0) | (k == 1):
            tl.store(out_ptr + row, arg.to(tl.int64))
        else:
            mn = tl.minimum(mn, m)  # a row with no finite logit
            lo = tl.full([], float("-inf"), tl.float32)
            cnt_lo = tl.zeros([], tl.int32) + vocab
            mass_lo = z
            if (k > 0) & (k < vocab):
                lo, cnt_lo, mass_lo = _search(
                    lrow, vocab, m, scale, mn, lo, cnt_lo, mass_lo,
                    m, tl.zeros([], tl.int32), tl.zeros([], tl.float32), k, mass_lo,
                    False, BLOCK_V, NUM_PIVOTS, MAX_PASSES,
                )  # fmt: skip
            if top_p < 1.0:
                if (k > 0) & (k < vocab):  # the top-k's mass: top-p's 100%
                    mass_lo = _mass_above(lrow, vocab, m, scale, lo, BLOCK_V)
                lo, cnt_lo, mass_lo = _search(
                    lrow, vocab, m, scale, mn, lo, cnt_lo, mass_lo,
                    m, tl.zeros([], tl.int32), tl.zeros([], tl.float32), k, top_p * mass_lo,
                    True, BLOCK_V, NUM_PIVOTS, MAX_PASSES,
                )  # fmt: skip
            # the race over x > lo whose probability is >= min_p times the largest (which is 1
            # before normalising)
            nrow = noise_ptr + row.to(tl.int64) * stride_n
            best = tl.full([], -1.0, tl.float32)
            token = tl.zeros([], tl.int32)
            for start in range(0, vocab, BLOCK_V):
                idx = start + offs
                x, ok = _logits_tile(lrow, idx, vocab)
                e = tl.exp2((x - m) * scale)
                keep = ok & (x > lo) & (e >= min_p)
                noise = tl.load(nrow + idx, mask=keep, other=1.0)
                ratio = tl.where(keep, e / noise, -1.0)
                tile_best = tl.max(ratio, axis=0)
                tile_arg = tl.argmax(ratio, axis=0, tie_break_left=True)
                token = tl.where(tile_best > best, start + tile_arg, token)
                best = tl.maximum(best, tile_best)
            tl.store(out_ptr + row, token.to(tl.int64))


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


def triton_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    block_v: int | None = None,
    num_pivots: int = 4,
) -> torch.Tensor:
    """As naive_sample, without sorting, in one Triton launch (one program per row) and no
    host sync: logits, noise [N, V] fp32 (rows may be strided); temperature, top_p, min_p
    [N] fp32; top_k [N] int -> tokens [N] int64. block_v (vocabulary tile, a power of two)
    and num_pivots (candidate thresholds per pass) are tuning knobs."""
    if triton is None:
        raise RuntimeError("triton_sample needs triton, which is not installed; use naive_sample")
    _check(logits, "logits")
    _check(noise, "noise")
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    block_v = block_v or min(triton.next_power_of_2(vocab), 2048)
    _sample_kernel[(n,)](
        logits, noise, out, temperature, top_k, top_p, min_p,
        vocab, logits.stride(0), noise.stride(0),
        BLOCK_V=block_v, NUM_PIVOTS=num_pivots, MAX_PASSES=64, num_warps=8,
    )  # fmt: skip
    return out
