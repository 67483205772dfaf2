"""What the suite spends, counted rather than timed: Ray clusters started, Ray Train runs with workers, Ray Data actor
pools, Ray Tune trials, Ray worker processes and script subprocesses. A count does not change with the machine's
speed; pyproject.toml's [tool.dreambooth.test_budget] caps each, and the session fails when one passes its cap.

How each is seen, without touching the code under test:
- Ray: every Ray process of the run puts its session folder under one temp folder (RAY_TMPDIR, set by conftest for
  the whole run and inherited by every script and node). A session folder is a cluster (a second node joins with the
  head's session name); each worker process writes a log file whose first lines name the actor it became
  (":actor_name:TrainController" is a Train run with workers, "ImplicitFunc" a Tune trial, "MapWorker(...)" an actor
  of a Ray Data pool). Clusters remove their folders when they stop, so a thread of this process looks at the
  folders twice a second while the session runs.
- Script subprocesses: Python's audit hook sees each process this one starts; one that runs a script of the
  repository (a root *.py or *.sh, benchmarks/, a dreambooth-* command, python -m dreambooth...) counts.
"""

import glob
import os
import sys
import threading

import tomllib

KINDS = {  # key in pyproject.toml: what the summary calls it
    "ray_clusters": "Ray clusters started",
    "ray_train_runs": "Ray Train runs with workers",
    "ray_data_pools": "Ray Data actor pools",
    "ray_tune_trials": "Ray Tune trials",
    "ray_worker_processes": "Ray worker processes",
    "script_runs": "script subprocesses",
}
_ACTOR = ":actor_name:"


class Counter:
    """The counts of one session: call scan() now and then (the thread does), script() for a subprocess."""

    def __init__(self, roots, repo_dir):
        self.roots, self.repo_dir = roots, repo_dir
        self.sessions, self.workers = set(), {}  # workers: log path: [bytes read, actor name or None, test]
        self.pools, self.scripts = set(), []
        self.processes = []  # the command of every process this one started (the unit tier allows none)
        self.test = None  # the test running now (each count is charged to it)
        self.lock = threading.Lock()

    def scan(self):
        with self.lock:
            for root in self.roots:
                for depth in ("", "*/", "*/*/"):
                    for session in glob.glob(os.path.join(root, depth + "session_2*")):
                        self.sessions.add(os.path.basename(session))
                        self._scan_logs(session)

    def _scan_logs(self, session):
        try:
            names = os.listdir(os.path.join(session, "logs"))
        except OSError:
            return
        for name in names:
            if not (name.startswith("worker-") and name.endswith(".out")):
                continue
            path = os.path.join(session, "logs", name)
            seen = self.workers.setdefault(path, [0, None, self.test])
            if seen[1] is not None:
                continue
            try:
                with open(path, "rb") as f:
                    f.seek(seen[0])
                    text = f.read(65536).decode(errors="replace")
                    seen[0] = f.tell()
            except OSError:
                continue
            if _ACTOR in text:
                seen[1] = text.split(_ACTOR, 1)[1].split("\n", 1)[0].strip()
                if seen[1].startswith("MapWorker("):  # a pool: its job (the name's third field) and operator
                    self.pools.add((os.path.basename(session), name.split("-")[2], seen[1]))

    def script(self, argv):
        """Count argv if it runs a script of the repository."""
        words = [str(w) for w in argv] if isinstance(argv, (list, tuple)) else str(argv).split()
        # (a shell's command line, `bash -c "<block>"`: the words of the block too)
        words += [part for word in words if " " in word for part in word.split()]
        for word in words:
            if word.startswith("-"):  # (an option's value may name anything)
                continue
            if os.path.basename(word).startswith("dreambooth-") or word.startswith("dreambooth."):
                break
            path = os.path.abspath(os.path.join(self.repo_dir, word))
            if path.startswith(self.repo_dir + os.sep) and os.path.isfile(path) and \
                    path.endswith((".py", ".sh")) and os.sep + "tests" + os.sep not in path:
                break
        else:
            return
        self.scripts.append((self.test, " ".join(words)[:160]))

    def counts(self):
        """{kind: count} as KINDS names them."""
        actors = [a for _, a, _ in self.workers.values()]
        return {"ray_clusters": len(self.sessions), "ray_train_runs": actors.count("TrainController"),
                "ray_data_pools": len(self.pools), "ray_tune_trials": actors.count("ImplicitFunc"),
                "ray_worker_processes": len(self.workers), "script_runs": len(self.scripts)}

    def by_actor(self):
        """{what a worker process became: how many}: an actor's class ("MapWorker" for every Ray Data pool's), or
        "(a task worker)" for one that ran tasks only or nothing."""
        table = {}
        for _, actor, _ in self.workers.values():
            kind = "(a task worker)" if actor is None else actor.split("(", 1)[0]
            table[kind] = table.get(kind, 0) + 1
        return table

    def by_test(self):
        """{test: {kind: count}} of the Train runs, worker processes and scripts each test started."""
        table = {}
        for _, actor, test in self.workers.values():
            row = table.setdefault(test, dict.fromkeys(("ray_train_runs", "ray_worker_processes", "script_runs"), 0))
            row["ray_worker_processes"] += 1
            row["ray_train_runs"] += actor == "TrainController"
        for test, _ in self.scripts:
            table.setdefault(test, dict.fromkeys(("ray_train_runs", "ray_worker_processes", "script_runs"), 0))
            table[test]["script_runs"] += 1
        return table


def budgets(rootdir):
    """pyproject.toml's [tool.dreambooth.test_budget]: {kind: cap}."""
    path = os.path.join(str(rootdir), "pyproject.toml")
    with open(path, "rb") as f:
        table = tomllib.load(f).get("tool", {}).get("dreambooth", {}).get("test_budget", {})
    unknown = set(table) - set(KINDS)
    if unknown:
        raise ValueError(f"{path}: [tool.dreambooth.test_budget] has no such count: {', '.join(sorted(unknown))}")
    return table


_counter = None
_stop = threading.Event()


def start(roots, repo_dir):
    """Start counting for this process's session (once)."""
    global _counter
    if _counter is not None:
        return _counter
    _counter = Counter(roots, repo_dir)

    def audit(event, args):
        if event == "subprocess.Popen":
            _counter.processes.append(" ".join(map(str, args[1]))[:200] if isinstance(args[1], (list, tuple))
                                      else str(args[1])[:200])
            _counter.script(args[1])

    sys.addaudithook(audit)

    def look():
        while not _stop.wait(0.5):
            _counter.scan()

    threading.Thread(target=look, name="counts", daemon=True).start()
    return _counter


def current():
    """The Counter of this session (start() made it)."""
    return _counter


def pytest_runtest_logstart(nodeid, location):
    if _counter is not None:
        _counter.scan()  # (what the last test started is charged to it)
        _counter.test = nodeid


def pytest_sessionfinish(session):
    if _counter is None:
        return
    _counter.scan()
    _stop.set()
    over = over_budget(session.config)
    if over:
        session.exitstatus = 1


def over_budget(config):
    caps = budgets(config.rootpath)
    counts = _counter.counts()
    return {kind: (counts[kind], cap) for kind, cap in caps.items() if counts[kind] > cap}


def pytest_terminal_summary(terminalreporter, config):
    if _counter is None:
        return
    caps, counts = budgets(config.rootpath), _counter.counts()
    terminalreporter.write_sep("=", "what the suite spent (tests/counts.py; caps in pyproject.toml)")
    for kind, label in KINDS.items():
        cap = caps.get(kind)
        over = cap is not None and counts[kind] > cap
        line = f"{counts[kind]:6d}  {label}" + (f" (budget {cap})" if cap is not None else "")
        terminalreporter.write_line(line + ("  OVER BUDGET" if over else ""), red=over)
    kinds = sorted(_counter.by_actor().items(), key=lambda item: (-item[1], item[0]))
    if kinds:
        terminalreporter.write_line("the worker processes, by what each became: " +
                                    ", ".join(f"{kind} {n}" for kind, n in kinds))
    table = _counter.by_test()
    costly = sorted(table.items(), key=lambda item: (-item[1]["ray_train_runs"], -item[1]["ray_worker_processes"]))
    if costly:
        terminalreporter.write_line("the tests that started the most (Train runs, worker processes, scripts):")
        for test, row in costly[:15]:
            terminalreporter.write_line(f"  {row['ray_train_runs']:3d} {row['ray_worker_processes']:4d} "
                                        f"{row['script_runs']:3d}  {test}")
    if os.environ.get("DREAMBOOTH_TESTS_COUNTS_FILE"):
        with open(os.environ["DREAMBOOTH_TESTS_COUNTS_FILE"], "w") as f:
            for kind in KINDS:
                f.write(f"total\t{kind}\t{counts[kind]}\n")
            for test, row in sorted(table.items(), key=lambda item: str(item[0])):
                for kind, value in row.items():
                    f.write(f"{test}\t{kind}\t{value}\n")
