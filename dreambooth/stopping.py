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
    """A worker's view of the StopFlag: requested() is called by every rank at every step and is True on all
    ranks at the same step once any rank has seen the request (an all-reduce on a gloo group when world > 1)."""

    def __init__(self, flag, world):
        self.flag, self.pending, self.seen, self.group = flag, None, None, None
        if world > 1:
            import torch.distributed as dist

            self.group = dist.new_group(backend="gloo")  # (every rank creates it, once)

    def reason(self):
        """The request this rank has seen so far, without waiting."""
        import ray

        if self.seen is None and self.flag is not None:
            if self.pending is None:
                self.pending = self.flag.requested.remote()
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready:
                self.seen, self.pending = ray.get(self.pending), None
        return self.seen

    def requested(self):
        seen = 1 if self.reason() else 0
        if self.group is not None:
            import torch
            import torch.distributed as dist

            flag = torch.tensor([seen], dtype=torch.int32)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            seen = int(flag.item())
        return bool(seen)
