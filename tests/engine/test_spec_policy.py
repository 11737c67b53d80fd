"""The draft policy (spec/policy.py): which drafted tokens a step checks, from measured step
costs and each row's acceptance. Synthetic costs stand for the two regimes a machine shows:
steps bound by reading weights (more rows cost next to nothing) and steps bound by
arithmetic (each row costs its share)."""

from __future__ import annotations

import pytest

from helexa.engine.spec.policy import PRIOR_ACCEPTANCE, STALE_STEPS, DraftPolicy, StepCosts
from tests.shared_fixtures import needs_shared


def _measured(cost, rows) -> DraftPolicy:
    policy = DraftPolicy()
    for r in rows:
        policy.observe(r, cost(r))
    return policy


def test_costs_interpolate_between_measured_row_counts_and_forget_stale_ones():
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(9, 0.050)
    assert costs.estimate(5) == pytest.approx(0.030)
    assert costs.estimate(10) is None and costs.estimate(0) is None
    costs.observe(9, 0.090)  # a running mean, not the newest alone
    assert 0.050 < costs.estimate(9) < 0.090
    for _ in range(STALE_STEPS + 1):
        costs.observe(3, 0.02)
    assert costs.estimate(1) is None and costs.estimate(3) == pytest.approx(0.02)


def test_where_rows_cost_next_to_nothing_every_likely_draft_is_checked():
    policy = _measured(lambda r: 0.010 + 0.0002 * r, range(1, 90))  # weights-bound
    assert policy.choose(1, [(0.6, 4)]) == [4]
    assert policy.choose(1, [(0.2, 4)]) == [2]  # 0.2^3 of a token is not worth a row's 2%


def test_where_rows_cost_much_only_the_likeliest_drafts_are_checked():
    policy = _measured(lambda r: 0.020 + 0.003 * r, range(1, 90))  # arithmetic-bound
    assert policy.choose(16, [(0.2, 4)] * 16) == [0] * 16  # a chat's drafts: none pay
    keep = policy.choose(16, [(0.95, 4)] * 2 + [(0.1, 4)] * 14)  # two rows copying code
    assert keep[:2] == [4, 4] and keep[2:] == [0] * 14


def test_where_rows_cost_their_whole_share_no_draft_pays():
    policy = _measured(lambda r: 0.004 * r, range(1, 90))
    assert policy.choose(8, [(0.95, 4)] * 8) == [0] * 8


def test_a_rows_first_tokens_are_checked_before_its_last():
    policy = _measured(lambda r: 0.010 + 0.004 * r, range(1, 12))
    (keep,) = policy.choose(1, [(0.7, 4)])
    assert 0 < keep < 4


def test_unmeasured_costs_are_measured_first_with_every_draft_then_without():
    policy = DraftPolicy()
    assert policy.choose(4, [(None, 3), (0.1, 2)]) == [3, 2]  # t(9) unknown: measure it
    policy.observe(9, 0.08)
    assert policy.choose(4, [(None, 3), (0.1, 2)]) == [0, 0]  # t(4) unknown: measure it
    policy.observe(4, 0.04)
    assert policy.choose(4, [(None, 3), (0.1, 2)]) == [0, 0]  # none pays its rows' time
    cheap = _measured(lambda r: 0.04 + 0.0002 * r, [4, 9])
    assert cheap.choose(4, [(None, 3), (0.1, 2)]) == [3, 1]
    assert policy.choose(4, []) == []


def test_a_rows_acceptance_is_per_token_and_follows_its_recent_drafts():
    a = DraftPolicy.acceptance(None, 4, 4)
    assert a > PRIOR_ACCEPTANCE
    assert DraftPolicy.acceptance(0.5, 4, 3) > DraftPolicy.acceptance(0.5, 4, 2) > 0.5
    for _ in range(10):
        a = DraftPolicy.acceptance(a, 4, 0)
    assert a < 0.05


@needs_shared
def test_the_engine_checks_what_the_policy_chooses_from_its_step_costs(tmp_path, monkeypatch):
    """Through the engine: every decode step's cost reaches the policy (here put on a
    synthetic scale for each regime, the measured time recorded beside it), the drafts it
    does not choose are not checked, and greedy tokens are the same whatever it chooses."""
    from helexa.engine import LLM, SamplingParams
    from helexa.engine.scheduler import Scheduler
    from tests.engine.test_speculative import EXACT, SPEC, _oracle, _repetitive
    from tests.engine.tiny import make_tiny_model

    model_dir = str(make_tiny_model("smollm2", tmp_path)[0])
    prompts = [_repetitive(512, s) for s in range(4)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(model_dir, **EXACT) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, expected)  # a draft at every step
    real = Scheduler.observe_step
    checked = {}
    for regime, cost in (
        ("weights", lambda r: 0.01 + 0.0001 * r),
        ("arithmetic", lambda r: 0.004 * r),
    ):
        seen: list[float] = []

        def observe(self, batch, seconds, cost=cost, seen=seen):
            seen.append(seconds)
            real(self, batch, cost(batch.num_tokens))

        monkeypatch.setattr(Scheduler, "observe_step", observe)
        with LLM(model_dir, **EXACT, **SPEC) as spec:
            assert [o.token_ids for o in spec.generate(prompts, params)] == expected
            sched = spec.engine.scheduler
        assert seen and all(s > 0 for s in seen) and sched.policy.costs.times
        checked[regime] = sched.num_draft_tokens
    # rows that cost next to nothing: every draft; rows that cost their share: only the
    # steps that measured what checking them costs
    assert checked["weights"] > 3 * checked["arithmetic"]


@needs_shared
def test_a_seeded_sampled_rows_draft_is_never_cut(tmp_path, monkeypatch):
    """Whatever the costs say, a seeded sampled row checks its whole draft: its tokens
    repeat run to run (a greedy row beside it is cut)."""
    from helexa.engine import LLM, SamplingParams
    from helexa.engine.scheduler import Scheduler
    from tests.engine.test_speculative import EXACT, SPEC, _oracle, _repetitive
    from tests.engine.tiny import make_tiny_model

    model_dir = str(make_tiny_model("smollm2", tmp_path)[0])
    prompts = [_repetitive(512, s) for s in range(2)]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=7, max_tokens=16, ignore_eos=True),
    ]
    with LLM(model_dir, **EXACT) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, params)]
    _oracle(monkeypatch, prompts, expected)
    real = Scheduler.observe_step
    monkeypatch.setattr(  # rows cost their whole share: no draft pays
        Scheduler, "observe_step", lambda self, b, s: real(self, b, 0.004 * b.num_tokens)
    )
    checked = []
    real_keep = Scheduler._keep

    def keep(self, seq, tokens, n):
        checked.append((seq.params.seed, len(seq.draft)))
        real_keep(self, seq, tokens, n)

    monkeypatch.setattr(Scheduler, "_keep", keep)
    runs = []
    for _ in range(2):
        with LLM(model_dir, **EXACT, **SPEC) as spec:
            runs.append([o.token_ids for o in spec.generate(prompts, params)])
    assert runs[0] == runs[1] and runs[0][0] == expected[0]
    seeded = [k for seed, k in checked if seed == 7]
    greedy = [k for seed, k in checked if seed is None]
    assert len(seeded) > 4 and len(greedy) < len(seeded)
