"""Ray Train's torch.distributed set-up for our runs, with torch imported only where it runs: on the workers.

Ray's TorchTrainer carries a TorchConfig, whose module imports torch at its top; the driver that builds the trainer
and the Train controller that unpickles its config each paid torch's import for it (1.6 s of CPU a process, both on
the way to every run's first step, though neither runs a tensor). This config keeps in the controller only what has to
happen there (the backend's choice, rank 0's address, one call per rank) and calls Ray's own worker-side functions of
that module (the environment torch.distributed reads, the process group's set-up and teardown, each worker's CUDA
device) in the workers, which import torch anyway. What TorchTrainer adds to DataParallelTrainer is this config alone
(and a local mode without workers, which no run uses)."""

import dataclasses
import logging
from typing import Optional

from ray.train.backend import Backend
from ray.train.backend import BackendConfig

logger = logging.getLogger(__name__)


def on_worker(name, *args, **kwargs):
    """Ray Train's function name of ray.train.torch.config, called in this worker process (its module imports torch:
    here, not in the controller)."""
    from ray.train.torch import config

    return getattr(config, name)(*args, **kwargs)


class DeviceContext:
    """TorchConfig's context around train_fn (each worker's CUDA device made the current one), entered in the worker."""

    def __enter__(self):
        from ray.train.torch.config import TorchConfigContextManager

        self.inner = TorchConfigContextManager()
        return self.inner.__enter__()

    def __exit__(self, *exc_info):
        return self.inner.__exit__(*exc_info)


def backend_name(configured, resources_per_worker):
    """torch.distributed's backend: the configured one, else NCCL for workers with GPUs and gloo for CPU workers (as
    TorchTrainer chooses)."""
    return configured or ("nccl" if resources_per_worker.get("GPU", 0) > 0 else "gloo")


@dataclasses.dataclass
class ProcessGroupConfig(BackendConfig):
    """TorchConfig's settings that our runs use: backend None is NCCL with GPUs, else gloo; the rendezvous env://."""

    backend: Optional[str] = None
    timeout_s: int = 1800

    @property
    def backend_cls(self):
        return ProcessGroupBackend

    @property
    def train_func_context(self):
        return DeviceContext

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH  # (what Ray's state export records of the run)

    def to_dict(self):
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


class ProcessGroupBackend(Backend):
    """TorchConfig's backend, run by the Train controller at each start of the worker group (a restart too)."""

    share_cuda_visible_devices = True  # (as TorchTrainer's: a node's workers see each other's GPUs, for NCCL)

    def on_start(self, worker_group, backend_config):
        import ray
        from ray.train._internal.utils import get_address_and_port
        from ray.train._internal.utils import update_env_vars

        backend = backend_name(backend_config.backend, worker_group.get_resources_per_worker())
        addr, port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(update_env_vars, {"MASTER_ADDR": addr, "MASTER_PORT": port})  # (env:// rendezvous)
        worker_group.execute(on_worker, "_set_torch_distributed_env_vars")  # (RANK, LOCAL_RANK, WORLD_SIZE, ...)
        ray.get([worker_group.execute_single_async(rank, on_worker, "_setup_torch_process_group", backend=backend,
                                                   world_rank=rank, world_size=len(worker_group), init_method="env://",
                                                   timeout_s=backend_config.timeout_s)
                 for rank in range(len(worker_group))])

    def on_shutdown(self, worker_group, backend_config):
        import ray
        from ray._private import ray_constants
        from ray.train import constants

        futures = worker_group.execute_async(on_worker, "_shutdown_torch", destroy_process_group=len(worker_group) > 1)
        timeout_s = ray_constants.env_integer(constants.TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
                                              constants.DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S)
        try:
            ray.get(futures, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            logger.warning("the workers' process group did not shut down within %s s", timeout_s)
