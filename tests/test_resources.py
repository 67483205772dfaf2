"""resources.py: the workers of a run and what each reserves, against the cluster's CPUs and GPUs."""

import pytest

from dreambooth import resources


def test_worker_resources_leave_a_cpu_for_ray_data_and_refuse_impossible():
    class Args:
        use_gpu = None
        num_workers = 2
        gpus_per_worker = 1
        model_dir = "/models--dreambooth-ray--tiny-stable-diffusion/snapshots/x"  # random weights: no GPU warning

    assert resources.worker_resources(Args, cpus=2, gpus=0) == (False, 2, 0.5)
    assert resources.worker_resources(Args, cpus=16, gpus=2) == (True, 2, 1.0)
    with pytest.raises(Exception, match="needs 2 GPUs"):
        resources.worker_resources(Args, cpus=16, gpus=1)
    Args.gpus_per_worker = 2
    with pytest.raises(Exception, match="--gpus_per_worker 2 needs 4 GPUs; the Ray cluster has 2"):
        resources.worker_resources(Args, cpus=16, gpus=2)
    Args.num_workers = 1
    assert resources.worker_resources(Args, cpus=16, gpus=2) == (True, 1, 1.0)
    Args.gpus_per_worker, Args.num_workers = 1, 2
    with pytest.raises(Exception, match="needs 2 GPUs"):
        Args.use_gpu = True
        resources.worker_resources(Args, cpus=16, gpus=0)
    Args.use_gpu, Args.num_workers = None, 1
    with pytest.raises(Exception, match="one for the data pipeline"):
        resources.worker_resources(Args, cpus=1, gpus=0)
    Args.num_workers = 3
    with pytest.raises(Exception, match="more than the Ray cluster's 2 CPUs"):
        resources.worker_resources(Args, cpus=2, gpus=0)


def test_without_num_workers_a_run_takes_every_gpu_or_one_cpu_worker(capsys):
    class Args:
        use_gpu = None
        num_workers = None
        gpus_per_worker = 1
        model_dir = "/data/models--CompVis--stable-diffusion-v1-4/snapshots/b95be7d6"  # a real model

    assert resources.worker_resources(Args, cpus=16, gpus=1) == (True, 1, 1.0)  # one GPU: no NUM_WORKERS needed
    assert resources.worker_resources(Args, cpus=16, gpus=8) == (True, 8, 1.0)
    Args.gpus_per_worker = 2
    assert resources.worker_resources(Args, cpus=16, gpus=5) == (True, 2, 1.0)
    assert capsys.readouterr().err == ""
    assert resources.worker_resources(Args, cpus=4, gpus=0) == (False, 1, 1.0)
    assert "the Ray cluster has no GPU" in capsys.readouterr().err  # a real model on CPUs: said before it starts
