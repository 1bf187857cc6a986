import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))  # so tests can `import harness`


def pytest_sessionstart(session):
    # The lessons import launch.dist_setup from the editable install of this repository.
    try:
        import launch.dist_setup as module
    except ImportError:
        pytest.exit("launch.dist_setup is not importable: run `pip install -r requirements.txt` first", 2)
    if Path(module.__file__).resolve().parents[1] != ROOT:
        pytest.exit(f"`launch` is imported from {module.__file__}, not this checkout: "
                    "run `pip install -r requirements.txt` here", 2)


def pytest_addoption(parser):
    parser.addoption("--gpu", action="store_true",
                     help="GPU mode: also run every lesson on this machine's GPUs with NCCL at each world size "
                          "from 1 to the number of GPUs, and with Gloo on CUDA tensors at 2 ranks (tests/test_gpu.py)")
