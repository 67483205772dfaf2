"""A run stopped at the step it is on, not at its last periodic checkpoint: SIGTERM or Ctrl-C to the driver
(`ray job stop`, a deleted pod, a spot instance's notice reaching the head, a person) asks every worker to
checkpoint its current step and end; `--resume_from_checkpoint latest|auto` continues from there. A second
signal aborts at once, as Ray Train's own Ctrl-C handler does.

The request travels as a key in the cluster's key-value store (Ray's GCS, which every worker reaches), one key
per run, read by each worker once a step; the workers agree on the step to stop at with one all-reduce of a flag
per step on a CPU (gloo) group, so no GPU stream waits for it. (It was an actor: a process of its own, about a
second of CPU at every run's start.)"""

import signal
import sys
import time
import uuid

from dreambooth import errors

NAMESPACE = "dreambooth-stop"


def make_flag():
    """A new run's stop flag: the name of its key (not set until a stop is asked)."""
    return f"run-{uuid.uuid4().hex}"


def request(flag, reason):
    """Ask the run of flag to stop at its current step (reason: the signal's name); the first reason stays."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(flag, reason, overwrite=False, namespace=NAMESPACE)


def requested(flag):
    """The reason a stop was asked for the run of flag, or None."""
    from ray.experimental import internal_kv

    value = internal_kv._internal_kv_get(flag, namespace=NAMESPACE)
    return value.decode() if value else None


def mark_begun(flag):
    """Say that the workers of flag's run have begun their steps (rank 0, once its model and data are ready): until
    then a stop has no step to checkpoint, and the driver ends the run at once."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(f"{flag}:begun", "1", namespace=NAMESPACE)


def begun(flag):
    """Whether the workers of flag's run have begun their steps."""
    from ray.experimental import internal_kv

    return internal_kv._internal_kv_exists(f"{flag}:begun", namespace=NAMESPACE)


def forget(flag):
    """Remove flag's keys (the run has ended; a sweep runs many in one driver)."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_del(flag, namespace=NAMESPACE)
    internal_kv._internal_kv_del(f"{flag}:begun", namespace=NAMESPACE)


def trainer_class():
    """Ray Train's data-parallel trainer over torch.distributed (process_group: TorchTrainer's set-up without torch in
    the driver and the controller) whose SIGINT and SIGTERM handlers (installed where Ray Train installs its SIGINT
    one, while fit() runs on the main thread) first ask the workers to checkpoint and stop; a second signal is Ray
    Train's abort. train_loop_config["stop_flag"] is the run's StopFlag."""
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    from dreambooth.training import process_group

    class StoppableTrainer(DataParallelTrainer):
        def __init__(self, train_loop_per_worker, trained=None, **kwargs):
            super().__init__(train_loop_per_worker, backend_config=process_group.ProcessGroupConfig(), **kwargs)
            self.trained = trained

        def _register_sigint_handler(self, controller):
            super()._register_sigint_handler(controller)
            install_handlers(self.train_loop_config["stop_flag"], signal.getsignal(signal.SIGINT), self.trained)

    return StoppableTrainer


def install_handlers(flag, abort, trained=None):
    """SIGINT and SIGTERM: the first asks flag for a stop at the current step, a later one calls abort. Before the
    workers have begun their steps (nothing to checkpoint: they are starting, loading the model) and once trained()
    (the workers have ended and saved the model; the run waits for its steps' scoring), the first calls abort."""
    asked = []

    def handler(signum, frame):
        if asked:
            print("stopping now, without a checkpoint of the current step", file=sys.stderr, flush=True)
            return abort(signal.SIGINT, frame)
        asked.append(time.time())
        errors.note_stop_signal(signum)
        name = signal.Signals(signum).name
        if trained is not None and trained():
            print(f"{name}: the training has ended and its model is saved: its steps' scoring is cut short now (the "
                  "steps left unscored are named)", file=sys.stderr, flush=True)
            return abort(signal.SIGINT, frame)
        if not begun(flag):
            print(f"{name}: the workers had not begun training (nothing to checkpoint): the run stops now, once Ray "
                  "Train has ended them (seconds)",
                  file=sys.stderr, flush=True)
            return abort(signal.SIGINT, frame)
        request(flag, name)
        print(f"{name}: every worker checkpoints the step it is on, then the run stops (again to stop at once, "
              f"losing that step)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


class StopPoll:
    """A worker's view of a stop request and of Ray Train's preemption watcher (a node of the run being drained:
    a spot reclaim notice, `ray drain-node`). check() is called by every rank at every step and says the same on
    every rank: one all-reduce of two flags on a gloo group when world > 1 (this rank saw the driver's request;
    rank 0's clock says it is time to ask Ray Train about drained nodes, every DRAIN_CHECK_S)."""

    DRAIN_CHECK_S = 2.0  # (Ray Train's watcher itself polls every 5 s)
    READ_EVERY_S = 0.2  # (a stop is seen within this, and a step)

    def __init__(self, flag, world, rank):
        self.flag, self.rank, self.seen, self.group = flag, rank, None, None
        self.last_drain_check, self.drain_seen, self.drained = time.monotonic(), False, None
        self.last_read = -self.READ_EVERY_S
        if world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # (every rank creates it, once)
        if rank == 0 and flag is not None:  # (every rank is here: the models loaded, the steps begin)
            mark_begun(flag)

    def reason(self):
        """The driver's request as this rank has seen it (the key read at most every READ_EVERY_S until it is set: a
        read is a call to Ray's GCS, a millisecond, which every step paid)."""
        now = time.monotonic()
        if self.seen is None and self.flag is not None and now - self.last_read >= self.READ_EVERY_S:
            self.seen, self.last_read = requested(self.flag), now
        return self.seen

    def await_reason(self):
        """The driver's request once another rank saw it first (this rank read the key just before it was set):
        read again, up to 10 s, so rank 0 names the signal (else the reason stays unknown; the stop goes on)."""
        deadline = time.monotonic() + 10
        while self.reason() is None and self.flag is not None and time.monotonic() < deadline:
            time.sleep(0.05)

    def check(self):
        """"stop" (checkpoint this step and end), "drained" (checkpoint this step and go on: the first time a
        node of the run is being drained) or None."""
        import ray.train

        flags = [1 if self.reason() else 0,
                 int(self.rank == 0 and time.monotonic() - self.last_drain_check >= self.DRAIN_CHECK_S)]
        if self.group is not None:
            import torch
            import torch.distributed as dist

            agreed = torch.tensor(flags, dtype=torch.int32)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group)
            flags = agreed.tolist()
        if flags[0]:
            self.await_reason()
            return "stop"
        if flags[1]:
            self.last_drain_check = time.monotonic()
            self.drained = ray.train.get_preemption_info()  # (every rank together: a barrier)
            if self.drained is not None and not self.drain_seen:
                self.drain_seen = True
                return "drained"
        return None

    def describe_drain(self):
        """'node 1a2b… (ranks 0, 1) is being drained, deadline in 58 s'."""
        info = self.drained
        nodes = ", ".join(f"{node[:8]}… (ranks {', '.join(map(str, ranks))})"
                          for node, ranks in sorted(info.preempted_node_to_ranks.items()))
        deadline = f", deadline in {info.deadline_ms / 1000 - time.time():.0f} s" if info.deadline_ms else ""
        return f"node(s) {nodes} being drained{deadline}"
