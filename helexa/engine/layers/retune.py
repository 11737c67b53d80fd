"""Plans measured on a busy machine, measured again once it is quiet, while the engine idles.

The re-measure runs on the engine's own thread, in the gaps between steps, never on a thread
of its own:
- the timings must be the engine's: torch and the native kernels split each call over an
  OpenMP team that belongs to the calling thread, and a model stepped from another thread
  decodes at half the speed (async_engine.AsyncLLM.build), so another thread would time
  another machine;
- it is never concurrent with a step: new plans are swapped in between two steps (every
  Linear of a shape at once, then `on_swap`, which drops what was built from the old plans),
  so a step runs on one set of plans from its first layer to its last;
- it takes no CPU from serving: it starts only after the engine has idled IDLE_S with the
  rest of the machine quiet meanwhile (cpu_meter), runs a slice at a time (one bucket's turns
  of one shape: milliseconds, a tenth of a second for the widest) and stops at the first
  request, which so waits at most one slice. A job resumes where it stopped at the next idle
  spell; one that saw the machine busy is thrown away, and the wait before the next try
  doubles up to MAX_WAIT_S.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator

from helexa.engine.layers.autotune import Measured
from helexa.engine.layers.cpu_meter import Window
from helexa.engine.layers.tuner import Autotuner

log = logging.getLogger(__name__)

IDLE_S = 2.0  # the engine idle, and the machine quiet, this long before a re-measure starts
MAX_WAIT_S = 60.0  # the longest wait between two looks at a busy machine
MIN_JUDGED_S = 0.5  # slices' time after which a job that sees a busy machine gives up


class Retuner:
    """Drives `Autotuner.remeasuring` in the engine's idle time (see the module's docstring)."""

    def __init__(
        self, tuner: Autotuner, on_swap: Callable[[], None], idle_s: float = IDLE_S
    ) -> None:
        self.tuner = tuner
        self.on_swap = on_swap
        self.idle_s = idle_s
        self._wait_s = idle_s
        self._job: Generator[None, None, dict[str, Measured]] | None = None
        self._window: Window | None = None

    @property
    def pending(self) -> bool:
        return bool(self.tuner.pending)

    def idle(self, wake: threading.Event) -> bool:
        """Wait until `wake` is set, re-measuring the pending plans meanwhile. True: they were
        swapped in before `wake` came (report the new state, then call again)."""
        meter = self.tuner.meter
        while self.tuner.pending:
            start = meter.read()
            if wake.wait(self._wait_s):
                return False
            probe = self.tuner.window()
            probe.add(start, meter.read())
            if not probe.is_quiet:
                self._back_off(probe)
            elif self._work(wake):
                return True
        wake.wait()
        return False

    def _work(self, wake: threading.Event) -> bool:
        """Slices until `wake`, the job's end (True: swapped in) or a busy reading."""
        if self._job is None:
            self._job, self._window = self.tuner.remeasuring(), self.tuner.window()
        job, window, meter = self._job, self._window, self.tuner.meter
        assert window is not None
        while not wake.is_set():
            start = meter.read()
            try:
                next(job)
            except StopIteration as done:
                window.add(start, meter.read())
                self._job = self._window = None
                if not window.is_quiet:
                    self._back_off(window)
                    return False
                self.tuner.adopt(done.value, window)
                self.on_swap()
                self._wait_s = self.idle_s
                log.info(
                    "autotune: %d shapes measured again on the quiet machine (the rest of it "
                    "took %.2f CPUs) and kept: plans fresh",
                    len(done.value),
                    window.others_cpus,
                )
                return True
            window.add(start, meter.read())
            if window.wall_s >= MIN_JUDGED_S and not window.is_quiet:
                self._job = self._window = None
                self._back_off(window)
                return False
        return False

    def _back_off(self, window: Window) -> None:
        self._wait_s = min(self._wait_s * 2, MAX_WAIT_S)
        log.debug(
            "autotune: the rest of the machine took %.2f CPUs; next look in %.0fs",
            window.others_cpus,
            self._wait_s,
        )
