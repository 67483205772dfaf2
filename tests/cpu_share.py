"""Where the suite's time goes on this machine: each test's wall time and the machine's busy CPU-seconds meanwhile
(from /proc/stat: the runs beside the tests count too), summed over setup, call and teardown. The summary at the end
names the tests that kept the cores busiest (fewer runs or processes is what makes them shorter) and those that left
the most core-seconds idle (waits: room for a run beside them)."""

import os
import time

_started = {}  # nodeid: (wall clock, busy ticks) when its setup began
measured = {}  # nodeid: (wall seconds, busy CPU-seconds, idle core-seconds)


def _busy_ticks():
    """The machine's busy clock ticks since boot; None where there is no /proc/stat."""
    try:
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return sum(values) - values[3] - values[4]  # (idle and iowait are not busy)


def start(nodeid):
    ticks = _busy_ticks()
    if ticks is not None:
        _started[nodeid] = (time.monotonic(), ticks)


def finish(nodeid):
    if nodeid not in _started or (ticks := _busy_ticks()) is None:
        return
    t0, busy0 = _started.pop(nodeid)
    wall, hz, cores = time.monotonic() - t0, os.sysconf("SC_CLK_TCK"), os.cpu_count() or 1
    busy = (ticks - busy0) / hz
    measured[nodeid] = (wall, busy, max(0.0, wall * cores - busy))


def write(path):
    """Every test's figures as tab-separated lines (nodeid, wall s, busy CPU-s, idle core-s), for a fuller look than
    the summary's: DREAMBOOTH_TESTS_CPU_FILE=path names the file (conftest)."""
    with open(path, "w") as f:
        for nodeid, (wall, busy, idle) in sorted(measured.items(), key=lambda item: -item[1][1]):
            f.write(f"{nodeid}\t{wall:.1f}\t{busy:.1f}\t{idle:.1f}\n")


def summary(count=12):
    """Lines for the terminal: the tests with the most busy CPU-seconds, then those with the most idle core-seconds."""
    if not measured:
        return []
    total = sum(busy for _, busy, _ in measured.values())
    lines = [f"{total:.0f} busy CPU-seconds in the tests (runs beside included); the most:"]
    by_busy = sorted(measured.items(), key=lambda item: -item[1][1])[:count]
    lines += [f"{busy:8.1f} CPU-s {wall:7.1f} s  {nodeid}" for nodeid, (wall, busy, _) in by_busy]
    lines.append("the most idle core-seconds (waits):")
    by_idle = sorted(measured.items(), key=lambda item: -item[1][2])[:count]
    lines += [f"{idle:8.1f} idle  {wall:7.1f} s  {nodeid}" for nodeid, (wall, _, idle) in by_idle]
    return lines
