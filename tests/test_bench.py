"""The benchmark runs the product's functions end to end and prints its side-by-side table."""

import importlib.util
import os

from conftest import REPO_DIR


def load_bench():
    spec = importlib.util.spec_from_file_location("bench", os.path.join(REPO_DIR, "benchmarks", "bench.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_bench_prints_plain_ray_and_generation_rows(ray_session, capsys):
    load_bench().main(["--model", "tiny", "--variants", "frozen,cached", "--steps", "2", "--warmup", "2",
                       "--logging_steps", "1", "--plain_warmup", "1", "--gen_batches", "1",
                       "--inference_steps", "2"])
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| ") and not line.startswith(("| measure", "| ---"))]
    table = {cells[0]: float(cells[1]) for cells in rows}
    for variant in ("frozen", "cached"):
        assert table[f"plain loop, {variant}"] > 0 and table[f"Ray Train 1 worker, {variant}"] > 0
        overhead = 100 * (1 - table[f"Ray Train 1 worker, {variant}"] / table[f"plain loop, {variant}"])
        assert abs(table[f"Ray overhead, {variant}"] - overhead) < 2  # from figures rounded to three digits
    assert table["speed-up of caching latents + embeddings (plain, frozen TE)"] > 0
    assert table["generation batch 1 (2 steps, actor pool)"] > 0
    assert table["start-up: Ray start"] >= 0
