"""A run stopped at the step it is on, not at its last periodic checkpoint: SIGTERM or Ctrl-C to the driver
(`ray job stop`, a deleted pod, a spot instance's notice reaching the head, a person) asks every worker to
checkpoint its current step and end; `--resume_from_checkpoint latest|auto` continues from there. A second
signal aborts at once, as Ray Train's own Ctrl-C handler does.

The request travels in a Ray actor (StopFlag) that each worker polls without waiting; the workers agree on
the step to stop at with one all-reduce of a flag per step on a CPU (gloo) group, so no GPU stream waits
for it."""

import signal
import sys
import time


class StopFlag:
    """The driver's stop request (a Ray actor with no CPU of its own)."""

    def __init__(self):
        self.reason = None

    def request(self, reason):
        self.reason = self.reason or reason

    def requested(self):
        return self.reason


def make_flag():
    """A StopFlag actor on the cluster."""
    import ray

    return ray.remote(num_cpus=0)(StopFlag).remote()


def trainer_class():
    """TorchTrainer whose SIGINT and SIGTERM handlers (installed where Ray Train installs its SIGINT one, while
    fit() runs on the main thread) first ask the workers to checkpoint and stop; a second signal is Ray Train's
    abort. train_loop_config["stop_flag"] is the run's StopFlag."""
    from ray.train.torch import TorchTrainer

    class StoppableTrainer(TorchTrainer):
        def _register_sigint_handler(self, controller):
            super()._register_sigint_handler(controller)
            install_handlers(self.train_loop_config["stop_flag"], signal.getsignal(signal.SIGINT))

    return StoppableTrainer


def install_handlers(flag, abort):
    """SIGINT and SIGTERM: the first asks flag for a stop at the current step, a later one calls abort."""
    asked = []

    def handler(signum, frame):
        if asked:
            print("stopping now, without a checkpoint of the current step", file=sys.stderr, flush=True)
            return abort(signal.SIGINT, frame)
        asked.append(time.time())
        name = signal.Signals(signum).name
        flag.request.remote(name)
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

    def __init__(self, flag, world, rank):
        self.flag, self.rank, self.pending, self.seen, self.group = flag, rank, None, None, None
        self.last_drain_check, self.drain_seen, self.drained = time.monotonic(), False, None
        if world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # (every rank creates it, once)

    def reason(self):
        """The driver's request this rank has seen so far, without waiting."""
        import ray

        if self.seen is None and self.flag is not None:
            if self.pending is None:
                self.pending = self.flag.requested.remote()
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready:
                self.seen, self.pending = ray.get(self.pending), None
        return self.seen

    def await_reason(self):
        """The driver's request once another rank saw it first (this rank's poll was not answered yet): asked
        again and waited for, so rank 0 names the signal (up to 10 s; else the reason stays unknown)."""
        import ray

        try:
            while self.seen is None and self.flag is not None:  # (a poll sent before the request answers None)
                self.seen, self.pending = ray.get(self.pending or self.flag.requested.remote(), timeout=10), None
        except ray.exceptions.RayError:  # (a lost flag actor leaves the reason unknown; the stop goes on)
            pass

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
