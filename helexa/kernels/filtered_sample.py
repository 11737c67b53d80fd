"""`sample`: a batch of logits rows into tokens, each row with its own parameters, on the device.

Per row: logits / temperature; keep the top_k most likely (0: all); keep tokens while the
probability mass strictly before them (most likely first) is <= top_p, within the top-k; drop
those whose probability is below min_p times the largest; then the exponential race: token =
argmax(prob / noise) over the kept ones, noise being Exp(1) draws given as input (so a seeded
row draws them where it likes, and the two versions can be compared exactly). Rows with
temperature 0 or top_k 1 are greedy: argmax of the logits as given. (sampling.py holds the
masks and penalties applied before; it re-exports this module's two functions.)

The naive sample sorts each row, as the engine's sampler always has. The Triton one never
sorts a row, and splits each row over chunks of the vocabulary (a grid of rows x chunks), so
64 rows keep the whole GPU busy. Every launch's grid comes from the shapes alone and nothing
waits for the host (it can be captured in a CUDA graph); a row with nothing left to do in a
launch returns at once. Per call:

1. stats (rows x chunks) and combine (rows): each chunk's max and its first index, smallest
   finite logit and softmax sum; combined, the row's max, greedy token and normaliser.
2. the top-k search, then top-p's within the kept top-k (its target: top_p times their
   mass), each num_rounds rounds of pivots (rows x chunks: count, and sum the probability
   of, the chunk's logits above NUM_PIVOTS evenly spaced candidate thresholds inside the
   row's bracket) and narrow (rows: sum the chunks', move the bracket to the two pivots
   around the cut), then gather (rows x chunks: the logits inside the bracket, if at most
   max_candidates, into a per-row buffer) and resolve (rows: sort those, in 128 slots
   where they fit, and find the exact cut; a bracket too wide to gather is narrowed by one
   program over the whole row, pass after pass: slow, and rare). A row is done as soon as
   at most one logit lies inside its bracket (or exactly k above its lower end).
3. the race (rows x chunks: each chunk's best prob / noise over its kept tokens, noise
   loaded only for them) and pick (rows: the best chunk's token, or the greedy one).

So at most 2 + 2 * (num_rounds + 1) reads of the logits (num_rounds 2: 8; at 64 rows of
151,936, 39 MB, which an H100's L2 nearly holds) and one of the kept tokens' noise, in
8 + 4 * num_rounds launches. Kept sets equal the sort's where
there are no ties (tied logits at the cut are all kept; the sort keeps some).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # triton is optional: the naive path serves CPU hosts
    triton = None


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
    def _logits_tile(lrow, idx, vocab):
        """A tile of a row: out-of-range lanes -inf, -inf logits clamped to -FLT_MAX (so every
        real logit is above the -inf sentinel and the pivots stay finite)."""
        ok = idx < vocab
        x = tl.load(lrow + idx, mask=ok, other=0.0)
        return tl.where(ok, tl.maximum(x, -_FLT_MAX), float("-inf")), ok

    @triton.jit
    def _row_scale(temp_ptr, row):
        """log2(e) / temperature (temperature 0: 1), so a probability is exp2((x - max) * it)."""
        temp = tl.load(temp_ptr + row).to(tl.float32)
        return _LOG2E / tl.where(temp == 0, 1.0, temp)

    @triton.jit
    def _is_greedy(temp_ptr, top_k_ptr, row):
        return (tl.load(temp_ptr + row) == 0) | (tl.load(top_k_ptr + row) == 1)

    @triton.jit
    def _load_state(fstate_ptr, istate_ptr, row):
        """A row's state between launches: fstate [N, 8] fp32 holds m (the max), z (the
        normaliser), base (the smallest finite logit), lo, hi (the bracket (lo, hi]), the mass
        above lo and above hi, the top-p target; istate [N, 4] int32 the greedy token, the
        count above lo and above hi, and go (the search still narrowing)."""
        f = fstate_ptr + row * 8
        i = istate_ptr + row * 4
        return (
            tl.load(f), tl.load(f + 1), tl.load(f + 2), tl.load(f + 3), tl.load(f + 4),
            tl.load(f + 5), tl.load(f + 6), tl.load(f + 7),
            tl.load(i), tl.load(i + 1), tl.load(i + 2), tl.load(i + 3),
        )  # fmt: skip

    @triton.jit
    def _store_bracket(fstate_ptr, istate_ptr, row, lo, hi, mass_lo, mass_hi, target,
                       cnt_lo, cnt_hi, go):  # fmt: skip
        f = fstate_ptr + row * 8
        i = istate_ptr + row * 4
        tl.store(f + 3, lo)
        tl.store(f + 4, hi)
        tl.store(f + 5, mass_lo)
        tl.store(f + 6, mass_hi)
        tl.store(f + 7, target)
        tl.store(i + 1, cnt_lo)
        tl.store(i + 2, cnt_hi)
        tl.store(i + 3, go.to(tl.int32))

    @triton.jit
    def _pivots(base, lo, hi, NUM_PIVOTS: tl.constexpr):
        """NUM_PIVOTS candidate thresholds evenly inside (lo, hi); `base` stands for lo while
        it is -inf."""
        j = tl.arange(0, NUM_PIVOTS)
        frac = (j + 1).to(tl.float32) / (NUM_PIVOTS + 1)
        a = tl.where(lo == float("-inf"), base, lo)
        return a + (hi - a) * frac

    @triton.jit
    def _narrow(piv, cnt, mass, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, target,
                BY_MASS: tl.constexpr, NUM_PIVOTS: tl.constexpr):  # fmt: skip
        """The bracket moved to the pivots around the cut, given the count (and mass) above
        each pivot: R(t) = "count above t >= k" (top-k) or "mass above t > target" (top-p)
        holds at lo and not at hi. Also whether to go on narrowing."""
        j = tl.arange(0, NUM_PIVOTS)
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
        go = (up | down) & ((cnt_lo - cnt_hi) > 1)  # no pivot inside: float resolution
        if not BY_MASS:
            go = go & (cnt_lo != k)
        return lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, go

    @triton.jit
    def _count_above(lrow, vocab, start, m, scale, piv, BY_MASS: tl.constexpr,
                     SPAN: tl.constexpr, BLOCK_V: tl.constexpr,
                     NUM_PIVOTS: tl.constexpr):  # fmt: skip
        """The count (and, BY_MASS, the unnormalised mass) of logits [start, start + SPAN)
        above each pivot."""
        offs = tl.arange(0, BLOCK_V)
        cnt = tl.zeros([NUM_PIVOTS], dtype=tl.int32)
        mass = tl.zeros([NUM_PIVOTS], dtype=tl.float32)
        for t in range(0, SPAN, BLOCK_V):
            x, ok = _logits_tile(lrow, start + t + offs, vocab)
            above = x[:, None] > piv[None, :]
            cnt += tl.sum(above.to(tl.int32), axis=0)
            if BY_MASS:
                e = tl.where(ok, tl.exp2((x - m) * scale), 0.0)
                mass += tl.sum(tl.where(above, e[:, None], 0.0), axis=0)
        return cnt, mass

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
        """The fallback for a bracket too wide to gather: one program narrows it to the cut
        over the whole row, pass after pass. Returns lo and the count and mass above it (the
        mass only BY_MASS)."""
        go = (cnt_lo - cnt_hi) > 1
        if not BY_MASS:
            go = go & (cnt_lo != k)
        passes = 0
        while go & (passes < MAX_PASSES):
            piv = _pivots(base, lo, hi, NUM_PIVOTS)
            cnt, mass = tl.zeros([NUM_PIVOTS], dtype=tl.int32), tl.zeros([NUM_PIVOTS], tl.float32)
            for start in range(0, vocab, BLOCK_V):
                c, s = _count_above(lrow, vocab, start, m, scale, piv, BY_MASS, BLOCK_V,
                                    BLOCK_V, NUM_PIVOTS)  # fmt: skip
                cnt += c
                mass += s
            lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, go = _narrow(
                piv, cnt, mass, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, target,
                BY_MASS, NUM_PIVOTS,
            )  # fmt: skip
            passes += 1
        return lo, cnt_lo, mass_lo

    @triton.jit
    def _stats_kernel(logits_ptr, temp_ptr, part_ptr, arg_ptr, vocab, stride_l, num_chunks,
                      CHUNK: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
        """Grid (N, chunks): a chunk's max and its first index, smallest finite logit and
        exp-sum relative to its max, into part [N, chunks, 3] (max, min, sum), arg [N, chunks]."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        lrow = logits_ptr + row.to(tl.int64) * stride_l
        scale = _row_scale(temp_ptr, row)
        offs = tl.arange(0, BLOCK_V)
        m = tl.full([], float("-inf"), tl.float32)
        mn = tl.full([], float("inf"), tl.float32)
        z = tl.zeros([], tl.float32)
        arg = tl.zeros([], tl.int32)
        for t in range(0, CHUNK, BLOCK_V):
            idx = chunk * CHUNK + t + offs
            x, ok = _logits_tile(lrow, idx, vocab)
            tile_max = tl.max(x, axis=0)
            tile_arg = tl.argmax(x, axis=0, tie_break_left=True)
            arg = tl.where(tile_max > m, chunk * CHUNK + t + tile_arg, arg)
            m_new = tl.maximum(m, tile_max)
            finite = ok & (x > -_FLT_MAX)
            mn = tl.minimum(mn, tl.min(tl.where(finite, x, float("inf")), axis=0))
            e = tl.where(ok, tl.exp2((x - m_new) * scale), 0.0)
            z = z * tl.exp2((m - m_new) * scale) + tl.sum(e, axis=0)  # 0 * 0 while m is -inf
            m = m_new
        p = part_ptr + (row * num_chunks + chunk) * 3
        tl.store(p, m)
        tl.store(p + 1, mn)
        tl.store(p + 2, z)
        tl.store(arg_ptr + row * num_chunks + chunk, arg)

    @triton.jit
    def _combine_kernel(part_ptr, arg_ptr, temp_ptr, top_k_ptr, fstate_ptr, istate_ptr,
                        num_cand_ptr, num_rows, vocab, num_chunks,
                        CHUNKS: tl.constexpr):  # fmt: skip
        """Grid (N,): the chunks' stats combined into the row's state; the top-k search set
        going for rows that have one; the row's gather counts [2, N] zeroed."""
        row = tl.program_id(0)
        tl.store(num_cand_ptr + row, 0)
        tl.store(num_cand_ptr + num_rows + row, 0)
        s = tl.arange(0, CHUNKS)
        ok = s < num_chunks
        p = part_ptr + (row * num_chunks + s) * 3
        maxes = tl.load(p, mask=ok, other=float("-inf"))
        m = tl.max(maxes, axis=0)
        best = tl.argmax(maxes, axis=0, tie_break_left=True)  # the first chunk: the first index
        arg = tl.sum(tl.where(s == best, tl.load(arg_ptr + row * num_chunks + s, mask=ok), 0))
        mn = tl.minimum(tl.min(tl.load(p + 1, mask=ok, other=float("inf")), axis=0), m)
        sums = tl.load(p + 2, mask=ok, other=0.0)
        z = tl.sum(tl.where(ok, sums * tl.exp2((maxes - m) * _row_scale(temp_ptr, row)), 0.0))
        k = tl.load(top_k_ptr + row).to(tl.int32)
        go = (~_is_greedy(temp_ptr, top_k_ptr, row)) & (k > 0) & (k < vocab)
        f = fstate_ptr + row * 8
        tl.store(f, m)
        tl.store(f + 1, z)
        tl.store(f + 2, mn)
        tl.store(istate_ptr + row * 4, arg)
        _store_bracket(fstate_ptr, istate_ptr, row, float("-inf"), m, z, 0.0, 0.0,
                       vocab, 0, go)  # fmt: skip

    @triton.jit
    def _pivot_kernel(logits_ptr, temp_ptr, top_p_ptr, fstate_ptr, istate_ptr, cnt_ptr,
                      mass_ptr, vocab, stride_l, num_chunks, BY_MASS: tl.constexpr, CHUNK: tl.constexpr,
                      BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr):  # fmt: skip
        """Grid (N, chunks): for a row still narrowing, the count and mass (the top-k search:
        only if top-p follows) of its chunk's logits above each pivot, into cnt, mass [N,
        chunks, NUM_PIVOTS]."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        m, _, base, lo, hi, _, _, _, _, _, _, go = _load_state(fstate_ptr, istate_ptr, row)
        if go != 0:
            lrow = logits_ptr + row.to(tl.int64) * stride_l
            piv = _pivots(base, lo, hi, NUM_PIVOTS)
            scale = _row_scale(temp_ptr, row)
            if BY_MASS or (tl.load(top_p_ptr + row) < 1.0):  # top-p takes the top-k's mass
                cnt, mass = _count_above(lrow, vocab, chunk * CHUNK, m, scale, piv, True,
                                         CHUNK, BLOCK_V, NUM_PIVOTS)  # fmt: skip
            else:
                cnt, mass = _count_above(lrow, vocab, chunk * CHUNK, m, scale, piv, False,
                                         CHUNK, BLOCK_V, NUM_PIVOTS)  # fmt: skip
            j = (row * num_chunks + chunk) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)
            tl.store(cnt_ptr + j, cnt)
            tl.store(mass_ptr + j, mass)

    @triton.jit
    def _narrow_kernel(top_k_ptr, fstate_ptr, istate_ptr, cnt_ptr, mass_ptr, num_chunks,
                       BY_MASS: tl.constexpr, CHUNKS: tl.constexpr,
                       NUM_PIVOTS: tl.constexpr):  # fmt: skip
        """Grid (N,): the chunks' counts summed, a narrowing row's bracket moved."""
        row = tl.program_id(0)
        _, _, base, lo, hi, mass_lo, mass_hi, target, _, cnt_lo, cnt_hi, go = _load_state(
            fstate_ptr, istate_ptr, row
        )
        if go != 0:
            s = tl.arange(0, CHUNKS)[:, None]
            j = (row * num_chunks + s) * NUM_PIVOTS + tl.arange(0, NUM_PIVOTS)[None, :]
            ok = s < num_chunks
            cnt = tl.sum(tl.load(cnt_ptr + j, mask=ok, other=0), axis=0)
            mass = tl.sum(tl.load(mass_ptr + j, mask=ok, other=0.0), axis=0)
            k = tl.load(top_k_ptr + row).to(tl.int32)
            piv = _pivots(base, lo, hi, NUM_PIVOTS)
            lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, go2 = _narrow(
                piv, cnt, mass, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi, k, target,
                BY_MASS, NUM_PIVOTS,
            )  # fmt: skip
            _store_bracket(fstate_ptr, istate_ptr, row, lo, hi, mass_lo, mass_hi, target,
                           cnt_lo, cnt_hi, go2)  # fmt: skip

    @triton.jit
    def _gather_kernel(logits_ptr, fstate_ptr, istate_ptr, num_ptr, cand_ptr, vocab, stride_l,
                       CHUNK: tl.constexpr, BLOCK_V: tl.constexpr, CAP: tl.constexpr):  # fmt: skip
        """Grid (N, chunks): a narrowing row's logits inside its bracket, if at most CAP,
        appended to cand [N, CAP] (num [N] counts them; one atomic per tile)."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        _, _, _, lo, hi, _, _, _, _, cnt_lo, cnt_hi, go = _load_state(fstate_ptr, istate_ptr, row)
        if (go != 0) & (cnt_lo - cnt_hi <= CAP):
            lrow = logits_ptr + row.to(tl.int64) * stride_l
            offs = tl.arange(0, BLOCK_V)
            for t in range(0, CHUNK, BLOCK_V):
                x, ok = _logits_tile(lrow, chunk * CHUNK + t + offs, vocab)
                inside = ok & (x > lo) & (x <= hi)
                n = tl.sum(inside.to(tl.int32), axis=0)
                if n > 0:
                    first = tl.atomic_add(num_ptr + row, n, sem="relaxed")
                    pos = first + tl.cumsum(inside.to(tl.int32), axis=0) - 1
                    tl.store(cand_ptr + row * CAP + pos, x, mask=inside & (pos < CAP))

    @triton.jit
    def _cut_among(cand, m, scale, lo, cnt_lo, cnt_hi, mass_hi, k, target,
                   BY_MASS: tl.constexpr, SIZE: tl.constexpr):  # fmt: skip
        """The exact cut among the bracket's cnt_lo - cnt_hi (<= SIZE) logits at cand, sorted:
        the new lo (keep x > lo) and the count and mass above it."""
        j = tl.arange(0, SIZE)
        ok = j < cnt_lo - cnt_hi
        x = tl.sort(tl.load(cand + j, mask=ok, other=float("-inf")), descending=True)
        e = tl.where(ok, tl.exp2((x - m) * scale), 0.0)
        if BY_MASS:
            holds = (mass_hi + tl.cumsum(e, axis=0)) > target
        else:
            holds = (cnt_hi + j + 1) >= k
        last = tl.min(tl.where(holds & ok, j, cnt_lo - cnt_hi - 1), axis=0)
        cut = tl.sum(tl.where(j == last, x, 0.0), axis=0)
        below = tl.max(tl.where(ok & (x < cut), x, float("-inf")), axis=0)
        lo = tl.where(below > float("-inf"), below, lo)  # keep x > lo: x >= cut
        kept = ok & (x >= cut)
        cnt = cnt_hi + tl.sum(kept.to(tl.int32), axis=0)
        return lo, cnt, mass_hi + tl.sum(tl.where(kept, e, 0.0), axis=0)

    @triton.jit
    def _resolve_kernel(
        logits_ptr, temp_ptr, top_k_ptr, top_p_ptr, fstate_ptr, istate_ptr, cand_ptr,
        vocab, stride_l, BY_MASS: tl.constexpr, SMALL_CAP: tl.constexpr, CAP: tl.constexpr,
        BLOCK_V: tl.constexpr, NUM_PIVOTS: tl.constexpr, MAX_PASSES: tl.constexpr,
    ):  # fmt: skip
        """Grid (N,): a row still narrowing finds its cut exactly: among the gathered logits,
        sorted, or (more than CAP in the bracket) by the one-program search. After the top-k
        search, sets the top-p search going (target: top_p times the kept mass)."""
        row = tl.program_id(0)
        m, _, base, lo, hi, mass_lo, mass_hi, target, _, cnt_lo, cnt_hi, go = _load_state(
            fstate_ptr, istate_ptr, row
        )
        scale = _row_scale(temp_ptr, row)
        k = tl.load(top_k_ptr + row).to(tl.int32)
        if go != 0:
            if cnt_lo - cnt_hi <= SMALL_CAP:  # the usual bracket: a short sort
                lo, cnt_lo, mass_lo = _cut_among(
                    cand_ptr + row * CAP, m, scale, lo, cnt_lo, cnt_hi, mass_hi, k, target,
                    BY_MASS, SMALL_CAP,
                )  # fmt: skip
            elif cnt_lo - cnt_hi <= CAP:
                lo, cnt_lo, mass_lo = _cut_among(
                    cand_ptr + row * CAP, m, scale, lo, cnt_lo, cnt_hi, mass_hi, k, target,
                    BY_MASS, CAP,
                )  # fmt: skip
            else:
                lrow = logits_ptr + row.to(tl.int64) * stride_l
                lo, cnt_lo, mass_lo = _search(
                    lrow, vocab, m, scale, base, lo, cnt_lo, mass_lo, hi, cnt_hi, mass_hi,
                    k, target, BY_MASS, BLOCK_V, NUM_PIVOTS, MAX_PASSES,
                )  # fmt: skip
                if (not BY_MASS) and (tl.load(top_p_ptr + row) < 1.0):  # top-p's 100%
                    mass_lo = _mass_above(lrow, vocab, m, scale, lo, BLOCK_V)
        if BY_MASS:
            go = tl.zeros([], tl.int32)
        else:  # top-p within the top-k: its 100% is their mass
            top_p = tl.load(top_p_ptr + row).to(tl.float32)
            greedy = _is_greedy(temp_ptr, top_k_ptr, row)
            go = ((~greedy) & (top_p < 1.0) & (cnt_lo > 1)).to(tl.int32)
            target = top_p * mass_lo
        _store_bracket(fstate_ptr, istate_ptr, row, lo, m, mass_lo, 0.0, target,
                       cnt_lo, 0, go)  # fmt: skip

    @triton.jit
    def _race_kernel(logits_ptr, noise_ptr, temp_ptr, top_k_ptr, min_p_ptr, fstate_ptr,
                     part_ptr, tok_ptr, vocab, stride_l, stride_n, num_chunks,
                     CHUNK: tl.constexpr, BLOCK_V: tl.constexpr):  # fmt: skip
        """Grid (N, chunks): over a sampled row's chunk, the best prob / noise among the
        kept logits (above lo, probability >= min_p times the largest) and its first index."""
        row, chunk = tl.program_id(0), tl.program_id(1)
        if not _is_greedy(temp_ptr, top_k_ptr, row):
            m = tl.load(fstate_ptr + row * 8)
            lo = tl.load(fstate_ptr + row * 8 + 3)
            min_p = tl.load(min_p_ptr + row).to(tl.float32)
            scale = _row_scale(temp_ptr, row)
            lrow = logits_ptr + row.to(tl.int64) * stride_l
            nrow = noise_ptr + row.to(tl.int64) * stride_n
            offs = tl.arange(0, BLOCK_V)
            best = tl.full([], -1.0, tl.float32)
            token = tl.zeros([], tl.int32)
            for t in range(0, CHUNK, BLOCK_V):
                idx = chunk * CHUNK + t + offs
                x, ok = _logits_tile(lrow, idx, vocab)
                e = tl.exp2((x - m) * scale)
                keep = ok & (x > lo) & (e >= min_p)
                noise = tl.load(nrow + idx, mask=keep, other=1.0)
                ratio = tl.where(keep, e / noise, -1.0)
                tile_best = tl.max(ratio, axis=0)
                tile_arg = tl.argmax(ratio, axis=0, tie_break_left=True)
                token = tl.where(tile_best > best, chunk * CHUNK + t + tile_arg, token)
                best = tl.maximum(best, tile_best)
            tl.store(part_ptr + row * num_chunks + chunk, best)
            tl.store(tok_ptr + row * num_chunks + chunk, token)

    @triton.jit
    def _pick_kernel(temp_ptr, top_k_ptr, istate_ptr, part_ptr, tok_ptr, out_ptr, num_chunks,
                     CHUNKS: tl.constexpr):  # fmt: skip
        """Grid (N,): a greedy row's argmax, or the race's winner over the chunks."""
        row = tl.program_id(0)
        token = tl.load(istate_ptr + row * 4)
        if not _is_greedy(temp_ptr, top_k_ptr, row):
            s = tl.arange(0, CHUNKS)
            ok = s < num_chunks
            best = tl.load(part_ptr + row * num_chunks + s, mask=ok, other=-2.0)
            win = tl.argmax(best, axis=0, tie_break_left=True)  # the first chunk: first index
            toks = tl.load(tok_ptr + row * num_chunks + s, mask=ok, other=0)
            token = tl.sum(tl.where(s == win, toks, 0), axis=0)
        tl.store(out_ptr + row, token.to(tl.int64))


def _check(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous along the vocabulary")
    return t


def triton_sample(
    logits: torch.Tensor,
    noise: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    block_v: int | None = None,
    chunk_v: int | None = None,
    num_pivots: int = 16,
    num_rounds: int = 2,
    max_candidates: int = 4096,
) -> torch.Tensor:
    """As naive_sample, without sorting a row and without a host sync, in 8 + 4 * num_rounds
    Triton launches whose grids depend on the shapes only: logits, noise [N, V] fp32 (rows
    may be strided); temperature, top_p, min_p [N] fp32; top_k [N] int -> tokens [N] int64.
    Tuning knobs (powers of two): block_v, the tile; chunk_v, the span of the vocabulary one
    program takes (a multiple of block_v); num_pivots, candidate thresholds a round;
    max_candidates, the most logits a bracket may hold to be gathered and sorted."""
    if triton is None:
        raise RuntimeError("triton_sample needs triton, which is not installed; use naive_sample")
    _check(logits, "logits")
    _check(noise, "noise")
    n, vocab = logits.shape
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    chunk_v = chunk_v or min(triton.next_power_of_2(vocab), 4096)
    block_v = min(block_v or 1024, chunk_v)
    assert chunk_v % block_v == 0, (chunk_v, block_v)
    num_chunks = triton.cdiv(vocab, chunk_v)
    # two workspaces, carved into views: fewer allocations a call
    f_sizes = (n * num_chunks * 3, n * 8, n * num_chunks * num_pivots, n * max_candidates)
    i_sizes = (n * num_chunks, n * 4, n * num_chunks * num_pivots, 2 * n)
    f_work = torch.empty(sum(f_sizes), dtype=torch.float32, device=logits.device)
    i_work = torch.empty(sum(i_sizes), dtype=torch.int32, device=logits.device)
    part, fstate, mass, cand = f_work.split(f_sizes)
    tok, istate, cnt, num_cand = i_work.split(i_sizes)
    num_cand = num_cand.view(2, n)  # per search; zeroed by _combine_kernel
    rows, grid = (n,), (n, num_chunks)
    chunks = triton.next_power_of_2(num_chunks)
    tiles = {"CHUNK": chunk_v, "BLOCK_V": block_v, "num_warps": 8}
    state = (fstate, istate)
    _stats_kernel[grid](logits, temperature, part, tok, vocab, logits.stride(0), num_chunks,
                        **tiles)  # fmt: skip
    _combine_kernel[rows](part, tok, temperature, top_k, *state, num_cand, n, vocab,
                          num_chunks, CHUNKS=chunks)  # fmt: skip
    for search, by_mass in enumerate((False, True)):  # top-k, then top-p within it
        for _ in range(num_rounds):
            _pivot_kernel[grid](logits, temperature, top_p, *state, cnt, mass, vocab,
                                logits.stride(0), num_chunks, BY_MASS=by_mass,
                                NUM_PIVOTS=num_pivots, **tiles)  # fmt: skip
            _narrow_kernel[rows](top_k, *state, cnt, mass, num_chunks, BY_MASS=by_mass,
                                 CHUNKS=chunks, NUM_PIVOTS=num_pivots)  # fmt: skip
        _gather_kernel[grid](logits, *state, num_cand[search], cand, vocab, logits.stride(0),
                             CAP=max_candidates, **tiles)  # fmt: skip
        _resolve_kernel[rows](
            logits, temperature, top_k, top_p, *state, cand, vocab, logits.stride(0),
            BY_MASS=by_mass, SMALL_CAP=min(128, max(max_candidates // 4, 1)), CAP=max_candidates,
            BLOCK_V=block_v, NUM_PIVOTS=num_pivots, MAX_PASSES=64, num_warps=8,
        )  # fmt: skip
    _race_kernel[grid](logits, noise, temperature, top_k, min_p, fstate, part, tok, vocab,
                       logits.stride(0), noise.stride(0), num_chunks, **tiles)  # fmt: skip
    _pick_kernel[rows](temperature, top_k, istate, part, tok, out, num_chunks, CHUNKS=chunks)
    return out
