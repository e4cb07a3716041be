"""bench/gpu_check.py, the command a user runs on a GPU machine: what it lists, and what it says
on a machine without CUDA. (Its checks themselves need GPUs.)"""

import importlib.util
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_lists_every_check_by_its_function(gpu_check, capsys):
    assert gpu_check.main(["--dry-run"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    names = [line.split(":")[0] for line in lines]
    assert names == [n for n, _ in gpu_check.CHECKS] and len(names) == 11
    for name, fn in gpu_check.CHECKS:
        assert fn.__name__ == f"check_{name}" and fn.__doc__  # the listed line is the function's
    for needed in ("pipeline_matches_plain", "embeddings_really_pipelined", "replica_digests_equal",
                   "fp16_untouched_rows_unchanged", "startup_peak_memory", "device_matches_ray",
                   "eval_bf16_vs_fp32", "training_qps", "torchft_collectives_on_gpu", "batches_pinned",
                   "snapshot_to_host_memory"):
        assert needed in names
    assert gpu_check.main(["--dry-run", "--only", "training_qps"]) == 0
    assert capsys.readouterr().out.startswith("training_qps: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the checks would run")
def test_without_cuda_it_says_so_in_one_sentence_and_exits_2(gpu_check, capsys, tmp_path):
    out = tmp_path / "r.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and not out.exists()
    said = captured.err.strip()
    assert len(said.splitlines()) == 1 and said.count(". ") == 0 and said.endswith(".") and "CUDA" in said
