"""resources.py: the workers of a run and what each reserves, against the cluster's CPUs and GPUs."""

import dataclasses

import pytest

from dreambooth import errors
from dreambooth.planning import resources


def test_worker_resources_leave_a_cpu_for_ray_data_and_refuse_impossible():
    # a model with random weights: no warning without a GPU
    flags = resources.WorkerFlags(num_workers=2, gpus_per_worker=1,
                                  model_dir="/models--dreambooth-ray--tiny-stable-diffusion/snapshots/x")

    assert resources.worker_resources(flags, cpus=2, gpus=0) == (False, 2, 0.5)
    assert resources.worker_resources(flags, cpus=16, gpus=2) == (True, 2, 1.0)
    with pytest.raises(Exception, match="needs 2 GPUs"):
        resources.worker_resources(flags, cpus=16, gpus=1)
    flags = dataclasses.replace(flags, gpus_per_worker=2)
    with pytest.raises(Exception, match="--gpus_per_worker 2 needs 4 GPUs; the Ray cluster has 2"):
        resources.worker_resources(flags, cpus=16, gpus=2)
    flags = dataclasses.replace(flags, num_workers=1)
    assert resources.worker_resources(flags, cpus=16, gpus=2) == (True, 1, 1.0)
    flags = dataclasses.replace(flags, gpus_per_worker=1, num_workers=2)
    with pytest.raises(Exception, match="needs 2 GPUs"):
        flags = dataclasses.replace(flags, use_gpu=True)
        resources.worker_resources(flags, cpus=16, gpus=0)
    flags = dataclasses.replace(flags, use_gpu=None, num_workers=1)
    with pytest.raises(Exception, match="one for the data pipeline"):
        resources.worker_resources(flags, cpus=1, gpus=0)
    flags = dataclasses.replace(flags, num_workers=3)
    with pytest.raises(Exception, match="more than the Ray cluster's 2 CPUs"):
        resources.worker_resources(flags, cpus=2, gpus=0)


def test_the_workers_fit_on_any_one_node_less_a_cpu_so_a_lost_node_leaves_the_data_stream_one():
    """Two CPU-only nodes of 2 CPUs: 2 workers of 1 CPU each would fill the head (Ray packs them there), and once the
    other node, where the data stream's tasks ran, is lost, no CPU is left for them; at half a CPU each, the head
    keeps one whichever node they land on."""
    flags = resources.WorkerFlags(num_workers=2, gpus_per_worker=1, min_workers=1, model_dir="/tiny")
    assert resources.worker_resources(flags, cpus=4, gpus=0, warn_no_gpu=False) == (False, 2, 1.0)  # (nodes unknown)
    assert resources.worker_resources(flags, cpus=4, gpus=0, warn_no_gpu=False, node_cpus=[2, 2]) == (False, 2, 0.5)
    # a node of one CPU never keeps one beside a worker: the others decide
    assert resources.worker_resources(flags, cpus=3, gpus=0, warn_no_gpu=False, node_cpus=[2, 1]) == (False, 2, 0.5)
    assert resources.worker_resources(flags, cpus=17, gpus=0, warn_no_gpu=False, node_cpus=[16, 1]) == (False, 2, 1.0)
    # GPU nodes: their workers' CPU shares are far from any node's CPUs
    assert resources.worker_resources(flags, cpus=64, gpus=4, warn_no_gpu=False, node_cpus=[32, 32]) == (True, 2, 1.0)


def test_an_elastic_run_needs_its_least_workers_at_the_start_and_says_it_grows(capsys):
    flags = resources.WorkerFlags(num_workers=4, gpus_per_worker=1, min_workers=2, model_dir="/tiny")
    assert resources.worker_resources(flags, cpus=16, gpus=2, warn_no_gpu=False) == (True, 4, 1.0)
    assert "holds 2 of the 4 workers now: the run starts on those (at least 2) and grows to 4" in capsys.readouterr().err
    assert resources.worker_resources(flags, cpus=16, gpus=4, warn_no_gpu=False) == (True, 4, 1.0)
    assert capsys.readouterr().err == ""  # (all there: nothing to say)
    with pytest.raises(errors.UserError, match="--min_workers 2 x --gpus_per_worker 1 needs 2 GPUs; the Ray cluster has 1$"):
        resources.worker_resources(flags, cpus=16, gpus=1, warn_no_gpu=False)
    with pytest.raises(errors.UserError, match="--min_workers 5: more than --num_workers 4"):
        resources.worker_resources(dataclasses.replace(flags, min_workers=5), cpus=16, gpus=8, warn_no_gpu=False)
    # on CPUs (the tests' 2-node cluster): the workers share the CPUs; they must hold the least at the start
    assert resources.worker_resources(dataclasses.replace(flags, num_workers=2, min_workers=1), cpus=2, gpus=0,
                                      warn_no_gpu=False) == (False, 2, 0.5)
    with pytest.raises(errors.UserError, match="--min_workers 3: more than the Ray cluster's 2 CPUs"):
        resources.worker_resources(dataclasses.replace(flags, min_workers=3), cpus=2, gpus=0, warn_no_gpu=False)
    from dreambooth.planning import planning

    # train.py's flags of an elastic run, each checked with the others before anything starts
    base = ["--model_dir", "/m", "--output_dir", "/o", "--instance_data_dir", "/i", "--instance_prompt", "p"]
    for extra, said in ((["--num_workers", "2", "--min_workers", "3"], "--min_workers 3 is more than --num_workers 2"),
                        (["--elastic_resize_interval", "5"], "--elastic_resize_interval says how often an elastic "
                                                             "run looks for nodes: add --min_workers")):
        with pytest.raises(SystemExit):
            planning.parse_args(base + extra)
        assert said in capsys.readouterr().err
    assert planning.parse_args(base + ["--min_workers", "1", "--elastic_resize_interval", "5"]).min_workers == 1


def test_without_num_workers_a_run_takes_every_gpu_or_one_cpu_worker(capsys):
    flags = resources.WorkerFlags(num_workers=None, gpus_per_worker=1,
                                  model_dir="/data/models--CompVis--stable-diffusion-v1-4/snapshots/b95be7d6")  # a real one

    assert resources.worker_resources(flags, cpus=16, gpus=1) == (True, 1, 1.0)  # one GPU: no NUM_WORKERS needed
    assert resources.worker_resources(flags, cpus=16, gpus=8) == (True, 8, 1.0)
    flags = dataclasses.replace(flags, gpus_per_worker=2)
    assert resources.worker_resources(flags, cpus=16, gpus=5) == (True, 2, 1.0)
    assert capsys.readouterr().err == ""
    assert resources.worker_resources(flags, cpus=4, gpus=0) == (False, 1, 1.0)
    assert "the Ray cluster has no GPU" in capsys.readouterr().err  # a real model on CPUs: said before it starts


def test_plan_steps_never_exceeds_max_steps_or_starves_a_worker():
    # steps from the epochs (no --max_train_steps), then an explicit step count
    flags = resources.StepFlags(num_workers=2, train_batch_size=2, gradient_accumulation_steps=1, num_train_epochs=4)

    assert resources.plan_steps(200, flags) == (50, 200)
    assert resources.plan_steps(5, flags) == (1, 4)
    flags = dataclasses.replace(flags, max_train_steps=3)
    assert resources.plan_steps(200, flags) == (50, 3)
    with pytest.raises(errors.UserError, match="cannot feed"):
        resources.plan_steps(1, flags)


def test_plan_steps_with_gradient_accumulation():
    flags = resources.StepFlags(num_workers=2, train_batch_size=1, gradient_accumulation_steps=3, num_train_epochs=4)

    assert resources.plan_steps(200, flags) == (33, 132)
    flags = dataclasses.replace(flags, gradient_accumulation_steps=4)
    with pytest.raises(errors.UserError, match="gradient_accumulation_steps"):
        resources.plan_steps(6, flags)


def test_explicit_max_train_steps_wins_and_epochs_count_only_without_it(capsys):
    flags = resources.StepFlags(num_workers=2, train_batch_size=1, gradient_accumulation_steps=1, max_train_steps=60)

    # 5 instance + 8 class images: 8 rows, 4 steps an epoch per worker.
    assert resources.plan_steps(8, flags) == (4, 60)
    assert "stopping" not in capsys.readouterr().err
    flags = dataclasses.replace(flags, max_train_steps=None)
    assert resources.plan_steps(8, flags) == (4, resources.DEFAULT_MAX_TRAIN_STEPS)
    flags = dataclasses.replace(flags, num_train_epochs=3)
    assert resources.plan_steps(8, flags) == (4, 12)
    assert "wins" not in capsys.readouterr().err
    flags = dataclasses.replace(flags, max_train_steps=60)  # both: the steps win, as in diffusers, and a line says so
    assert resources.plan_steps(8, flags) == (4, 60)
    assert "--max_train_steps 60 wins over --num_train_epochs 3 (12 steps): 15 epoch(s) of 4 steps" in \
        capsys.readouterr().err
    # The seeds' command: --num_epochs=4 --max_train_steps=200, 200 class images, 2 workers, batch 2.
    flags = dataclasses.replace(flags, train_batch_size=2, num_train_epochs=4, max_train_steps=200)
    assert resources.plan_steps(200, flags) == (50, 200)


def test_the_stream_holds_enough_rows_for_every_step():
    flags = resources.StepFlags(num_workers=2, train_batch_size=2, gradient_accumulation_steps=3)

    epochs = resources.stream_epochs(13, 40, flags)
    rows_per_worker = epochs * 13 // 2
    assert rows_per_worker >= 40 * 2 * 3
