"""`python -m h2o_cache.bench.gpu` on a machine without CUDA: a clear message, no traceback."""

import subprocess
import sys

import pytest
import torch

from h2o_cache.bench import gpu
from h2o_cache.bench.common import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the command runs for real")
def test_without_cuda_the_command_says_so_and_exits_with_status_2():
    run = subprocess.run([sys.executable, "-m", "h2o_cache.bench.gpu", "--skip-server"], cwd=REPO_ROOT,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.strip() == gpu.NO_CUDA and "Traceback" not in run.stderr
    assert not run.stdout
