"""A draft model (vLLM's "draft_model" method): a second, smaller model sharing the target's
tokenizer drafts each speculating row's next tokens, greedily, one forward of its own per
token.

Its KV cache has the target's number of blocks and block size, so the target's block
tables and slots address it and it keeps no books of its own. Each step, before the
target's forward, it runs
  1. the target's step with the drafts left out: every row's chunk as scheduled (prompt
     chunks, decode rows) and a speculating row's own tokens (its last one; a hybrid
     target's row that rolled back, the few it recomputes), whose last logits give d1;
  2. d1..d(k-1) fed back, one decode row per speculating sequence, for d2..dk;
  3. dk itself, for its KV alone (in the same forward as other rows' step 2, where rows
     draft different lengths): the target may accept it, and then holds that position.
After every step its cache holds every position the target's holds, computed from the same
tokens (a rejected draft's, past them, is written over later as the target's is): so the
prefix cache, preemption and chunked prefill need nothing of it. Its drafts are its argmax,
a point mass, for which verify.accepted_sampled's rule is exact.

Under tensor parallel the draft is built whole (`parallel.unsharded`) and runs on rank 0
alone, before rank 0 sends the target's step to the other ranks: they never see it.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from helexa.engine.layers.linear import PREFILL_STEP
from helexa.engine.model_runner import ModelRunner
from helexa.engine.parallel import unsharded
from helexa.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from helexa.engine.engine_args import EngineArgs
    from helexa.engine.loader.load import LoadedModel
    from helexa.engine.sequence import Sequence

log = logging.getLogger(__name__)

# Texts both tokenizers must turn into the same ids: words, code, digits, whitespace runs,
# accents and CJK (where byte-level vocabularies of different families part ways).
PROBES = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def area(w, h):\n    return w * h  # 42\n",
    "1234567890 3.14159 -7e-3",
    "   indented\ttabs\n\n",
    "naïve café, Größe, 東京, こんにちは",
)


def load_draft(args: EngineArgs, device: torch.device, target: LoadedModel) -> LoadedModel:
    """The draft model `args.speculative_model` names, loaded whole on `device` as the target
    is; ValueError when it cannot draft for `target` (another vocabulary, a hybrid model)."""
    ref = args.speculative_model
    if not ref:
        raise ValueError(
            "speculative_method 'draft_model' needs speculative_model: the id or path of a "
            "smaller model sharing this model's tokenizer"
        )
    with unsharded():  # the target's file and branch are not the draft's
        draft = dataclasses.replace(args, gguf_quant=None, revision=None).load(ref, device)
    if ModelRunner.state_bytes_per_slot(draft.model, torch.float32):
        raise ValueError(
            f"speculative_model {ref!r} is a hybrid (Gated DeltaNet) model: its recurrent "
            "state cannot rewind past rejected drafts; pick an attention-only draft model"
        )
    problem = vocabulary_mismatch(target, draft)
    if problem is not None:
        raise ValueError(
            f"speculative_model {ref!r} cannot draft for this model: {problem}; pick a draft "
            "model of the same family, sharing its tokenizer"
        )
    if (rows := narrower_than(target, draft)) is not None:
        log.info(
            "speculative_model %r has %d vocabulary rows, this model %d: it reads this "
            "model's ids past its rows as its last one, and drafts none of them",
            ref, rows, logits_width(target),
        )  # fmt: skip
    return draft


def narrower_than(target: LoadedModel, draft: LoadedModel) -> int | None:
    """The draft's vocabulary rows where they are fewer than the target's; else None."""
    rows = logits_width(draft)
    return rows if rows < logits_width(target) else None


def vocabulary_mismatch(target: LoadedModel, draft: LoadedModel) -> str | None:
    """Why `draft`'s token ids do not mean what `target`'s do (None: they do): the same
    tokenizer. Their tables may be padded to different widths (Qwen2.5-0.5B has 151936 rows,
    Qwen2.5-7B 152064, on one tokenizer): a wider draft's proposals are cut to the target's
    width, and a narrower one reads the target's ids past its rows as its last row (only
    padding ids, where the tokenizer fits in its rows; `narrower_than`)."""
    t, d = target.tokenizer, draft.tokenizer
    if t.vocab_size != d.vocab_size:
        return f"its tokenizer has {d.vocab_size} tokens, this model's {t.vocab_size}"
    for text in PROBES:
        a, b = t.encode(text), d.encode(text)
        if a != b:
            return f"it tokenizes {text!r} as {b}, this model as {a}"
    return None


def logits_width(loaded: LoadedModel) -> int:
    """The model's vocabulary rows (its logits' width)."""
    return loaded.config.vocab_size or loaded.tokenizer.vocab_size


@dataclass(slots=True, eq=False)
class _Row:
    """A sequence as one of the draft's forwards reads it (what ModelRunner.plan and the
    decode graphs read of a Sequence): its tokens with the drafts so far, the positions
    computed before this forward, its blocks. It samples (plan's logits rows) where
    `num_tokens` is the end of its chunk."""

    token_ids: list[int]
    num_computed_tokens: int
    num_tokens: int
    block_table: list[int]
    num_prompt_tokens: int
    draft: list[int] = field(default_factory=list)  # the draft model's rows check none
    mm: None = None  # text: a draft model takes no images
    position_offset: int = 0
    state_slot: int = -1
    # the request's logit bias: the target samples with it, so the draft proposes with it
    logit_bias: dict[int, float] | None = None


class DraftModel:
    """The draft model's runner over a KV cache the target's block tables address; `propose`
    fills a step's drafts before the target's forward (see the module's docstring)."""

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        device: torch.device,
        dtype: torch.dtype,
        kv_dtype: torch.dtype,
        num_blocks: int,
        block_size: int,
        vocab_size: int,
    ) -> None:
        self.loaded = loaded
        self.runner = ModelRunner(
            loaded.model,
            device=device,
            dtype=dtype,
            num_blocks=num_blocks,
            block_size=block_size,
            kv_dtype=kv_dtype,
        )
        self.vocab_size = vocab_size  # the target's logits' width: no proposal past it
        rows = logits_width(loaded)
        if rows < vocab_size:  # a narrower draft reads the target's ids it has no row for
            self.runner.id_limit = rows

    @property
    def model(self) -> torch.nn.Module:
        return self.runner.model

    @torch.inference_mode()
    def propose(self, batch: ScheduledBatch) -> None:
        """Run the draft model over the step and write each speculating row's draft (the
        scheduler's placeholders, one per token it reserved) into seq.draft."""
        runner = self.runner
        runner.copy_states(batch.restores)  # a hybrid target's restored blocks: here too
        rows: list[_Row] = []
        news: list[int] = []
        spec: list[int] = []  # batch indices of the rows that speculate
        for i, seq in enumerate(batch.seqs):
            start = seq.num_computed_tokens
            if seq.draft:  # its own tokens (the last one; a rolled-back hybrid row's few)
                spec.append(i)
                n = seq.num_tokens - start
                rows.append(_row(seq, seq.token_ids, start, n, samples=True))
                news.append(n)
                continue
            n = batch.num_new_tokens[i]
            # a decode row samples (its logits unread) so a decode step replays a graph
            decode = n == 1 and start > 0
            rows.append(_row(seq, seq.token_ids, start, n, samples=decode))
            news.append(n)
        first = self._forward(rows, news, [rows[i] for i in spec])
        runner.copy_states(batch.snapshots)  # a hybrid target's snapshot blocks: here too
        drafts = {i: [token] for i, token in zip(spec, first, strict=True)}
        ks = {i: len(batch.seqs[i].draft) for i in spec}
        # forward j: each row feeds its d_j, for d_(j+1) while it drafts, for d_j's KV alone
        # where j is its k
        for j in range(1, max(ks.values(), default=0) + 1):
            rows, wanted, growing = [], [], []
            for i in spec:
                if ks[i] < j:
                    continue
                seq = batch.seqs[i]
                row = _row(seq, [*seq.token_ids, *drafts[i]], seq.num_tokens - 1 + j)
                rows.append(row)
                if j < ks[i]:
                    wanted.append(row)
                    growing.append(i)
            tokens = self._forward(rows, [1] * len(rows), wanted)
            for i, token in zip(growing, tokens, strict=True):
                drafts[i].append(token)
        for i in spec:
            batch.seqs[i].draft = drafts[i]

    def _forward(self, rows: list[_Row], news: list[int], wanted: list[_Row]) -> list[int]:
        """One forward of the draft model over `rows` (`news` new tokens each); the argmax
        token at the end of each row in `wanted` (rows that sample), in order."""
        batch = ScheduledBatch(rows, news)  # type: ignore[arg-type] (rows read as Sequences)
        step = self.runner.forward_step(batch)
        if not wanted:
            return []
        at = {id(batch.seqs[i]): j for j, i in enumerate(step.seqs)}
        picks = [at[id(row)] for row in wanted]
        if step.rows is not None:  # where the model returned every row
            picks = [step.rows[j] for j in picks]
        hidden = step.hidden[picks]
        token = PREFILL_STEP.set(step.has_prompt)  # logits as the forward computed
        try:
            logits = self.runner.model.compute_logits(hidden, None)
        finally:
            PREFILL_STEP.reset(token)
        logits = logits[:, : self.vocab_size]
        for j, row in enumerate(wanted):
            if row.logit_bias:  # as the target's rows see them (spec/verify.py)
                ids = torch.tensor(list(row.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(list(row.logit_bias.values()), device=logits.device)
                logits[j, ids] += bias.to(logits.dtype)
        return logits.argmax(dim=-1).tolist()


def _row(
    seq: Sequence, token_ids: list[int], start: int, n: int = 1, *, samples: bool = True
) -> _Row:
    """`seq` as a draft forward reads it: `n` tokens of `token_ids` from `start`."""
    end = start + n if samples else start + n + 1
    bias = seq.params.logit_bias or None
    return _Row(token_ids, start, end, seq.block_table, seq.num_prompt_tokens, logit_bias=bias)
