"""The CPU kernels' autotune: plans chosen from measured times, a throughput that never
falls with more rows, and plans kept per machine in the cache directory."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from helexa.engine.layers import autotune
from helexa.engine.layers.autotune import (
    BUCKETS,
    DENSE,
    WHOLE,
    Autotuner,
    choose,
    exact_rows,
    plan_for_rows,
    shape_key,
)
from tests.engine.test_linear import make_linears


def cost(plan: tuple[bool, int], i: int, kernel_s: list[float], dense_s) -> float:
    dense, chunk = plan
    times = dense_s if dense else kernel_s
    j = BUCKETS.index(chunk) if chunk else i
    return BUCKETS[i] / BUCKETS[j] * times[j]


def test_a_bucket_where_the_kernel_falls_off_a_cliff_runs_in_smaller_chunks():
    # 16 rows cost as much as 64 would: two calls of 8 are cheaper
    kernel = [1.0, 1.1, 1.2, 1.5, 8.0, 9.0, 10.0, 20.0, 40.0, 80.0]
    plans = choose(kernel, [1e9] * len(BUCKETS))
    assert plans[:4] == [WHOLE] * 4
    assert plans[4] == (False, 8) and plans[5] == (False, 8)  # 16 and 32 rows: calls of 8
    assert plans[6] == WHOLE and plans[7] == (False, 64)  # 10 for 64 rows beats 8 x 1.5
    dense = [5.0] * len(BUCKETS)
    assert choose(kernel, dense)[7] == DENSE  # 5 beats 2 x 10 for 128 rows
    assert choose(kernel, dense)[9] == DENSE


@pytest.mark.parametrize("seed", range(20))
def test_whatever_the_times_throughput_never_falls_as_rows_grow(seed):
    rng = random.Random(seed)
    kernel = [rng.uniform(0.5, 50.0) * b ** rng.uniform(0, 1) for b in BUCKETS]
    dense = [rng.uniform(1.0, 80.0) * b ** rng.uniform(0, 1) for b in BUCKETS]
    plans = choose(kernel, dense)
    rows_per_s = [
        b / cost(p, i, kernel, dense) for i, (b, p) in enumerate(zip(BUCKETS, plans, strict=True))
    ]
    assert all(a <= b * (1 + 1e-12) for a, b in itertools.pairwise(rows_per_s))


def test_plans_spread_over_row_counts_take_the_smallest_bucket_that_holds_them():
    four, eight = (False, 4), (True, 8)
    plans = [WHOLE, WHOLE, WHOLE, four, four, eight, eight, eight, eight, DENSE]
    by_rows = plan_for_rows(plans)
    assert by_rows[1] == by_rows[4] == WHOLE
    assert by_rows[5] == by_rows[8] == four and by_rows[9] == four and by_rows[16] == four
    assert by_rows[17] == eight and by_rows[256] == eight and by_rows[257] == DENSE
    assert len(by_rows) == BUCKETS[-1] + 1 == 513


def test_plans_are_measured_once_per_shape_then_read_from_the_machines_cache(tmp_path):
    lins = make_linears("Q4_1", [192, 192, 576], with_bias=False)  # two shapes
    first = Autotuner(tmp_path, torch.get_num_threads())
    first.tune(lins)
    held = "blocks-Q4_1x8" if lins[0].format == "blocks" else "int4"  # native kernels, or torch's
    assert sorted(first.measured) == [f"{held}:192x576", f"{held}:576x576"]
    assert all(len(lin.plans) == BUCKETS[-1] + 1 for lin in lins)
    (cached,) = tmp_path.glob("*.json")
    body = json.loads(cached.read_text())
    assert body["version"] == autotune.CACHE_VERSION and len(body["plans"]) == 2
    if held.startswith("blocks"):  # where prompt steps leave the exact kernel, measured too
        assert set(body["exact_rows"]) == set(body["plans"])
        assert all(lin.exact_rows == body["exact_rows"][shape_key(lin)] for lin in lins)
    again = Autotuner(tmp_path, torch.get_num_threads())
    fresh = make_linears("Q4_1", [192], with_bias=False)
    again.tune(fresh)
    assert again.measured == [] and fresh[0].plans == lins[0].plans
    assert fresh[0].exact_rows == lins[0].exact_rows
    # another thread count is another machine as far as plans go
    assert Autotuner(tmp_path, torch.get_num_threads() + 1).plans == {}
    # and so is another version of the native kernels' source
    changed = tmp_path / "blocks.c"
    changed.write_bytes(autotune.NATIVE_SOURCE.read_bytes() + b"\n/* changed */\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune, "NATIVE_SOURCE", changed)
        assert Autotuner(tmp_path, torch.get_num_threads()).plans == {}
    assert Autotuner(tmp_path, torch.get_num_threads()).plans != {}
    cached.write_text("{not json")
    damaged = Autotuner(tmp_path, torch.get_num_threads())
    damaged.tune(fresh)
    assert damaged.measured == [f"{held}:192x576"]  # measured again, and the file written anew
    assert json.loads(cached.read_text())["plans"][f"{held}:192x576"]


def test_float_weights_have_nothing_to_tune(tmp_path):
    lins = make_linears(None, [64], with_bias=False)
    tuner = Autotuner(tmp_path, 1)
    tuner.tune(lins)
    assert tuner.measured == [] and lins[0].plans is None and not list(tmp_path.iterdir())


def test_without_a_cache_directory_a_process_measures_each_shape_once():
    first = make_linears("Q4_1", [64], with_bias=False)
    Autotuner(None, 7).tune(first)  # 7 threads: a machine key no other test uses
    again = Autotuner(None, 7)
    later = make_linears("Q4_1", [64], with_bias=False)
    again.tune(later)
    assert again.measured == [] and later[0].plans == first[0].plans


def test_prompt_steps_keep_the_exact_kernel_up_to_the_last_bucket_where_it_is_quicker():
    dense = [5.0] * 8  # 1 ... 128 rows
    assert exact_rows([1, 1, 1, 1, 2, 4, 8, 16], dense) == 32
    assert exact_rows([1] * 8, dense) == 128
    assert exact_rows([6, 1, 1, 1, 1, 1, 1, 1], dense) == 0  # the GEMM from one row up
    assert exact_rows([1, 9, 1, 1, 1, 1, 1, 1], dense) == 1  # a cliff ends it for good
