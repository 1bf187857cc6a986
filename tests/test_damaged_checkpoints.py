"""A resume from a damaged checkpoint file (empty, or cut short as by a full disk or a copy that
stopped) is refused in one line that names the file, on every rank, without a traceback, and
leaves the file as it was.

The lessons that resume from a file of their own: launch/elastic.py (elastic.pt, read at every
start) and transformer_basics/generate.py (model.pt) here; ddp_basics/ddp_checkpoint.py and
fsdp_basics/zero_redundancy_optimizer.py (`require_checkpoint_fits`), train.py / train_2d.py and
fsdp_checkpoint.py (DCP shards) in their own tests. The damage is made in this process; one real
launch shows the refusal on every rank; a mutation of elastic.py (a reader who catches only the
errors they thought of) shows the check failing.
"""

import importlib.util
from dataclasses import asdict
import re

import pytest
import torch

from harness import ROOT, assert_fails, mutant, run_lesson

ELASTIC = "launch/elastic.py"


def damaged(path, how):
    """Write a real checkpoint of elastic.py at path, then damage it: empty, or cut in half."""
    from launch.elastic import save_atomically

    save_atomically({"step": 3, "w": 12345, "world_sizes": [[0, 2]]}, str(path))
    data = path.read_bytes()
    path.write_bytes(b"" if how == "empty" else data[: len(data) // 2])
    return path.read_bytes()


def elastic_module(path):
    spec = importlib.util.spec_from_file_location("elastic_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refusal(module, path):
    """What load_checkpoint does with the file: the UsageError's line, or the other exception."""
    from launch.dist_setup import UsageError

    try:
        module.load_checkpoint(str(path), 20)
    except UsageError as error:
        return f"refused: {error}"
    except Exception as error:  # what would reach the reader as a traceback
        return f"traceback: {type(error).__name__}"
    return "loaded"


@pytest.mark.quick
@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_elastic_refuses_a_damaged_checkpoint_in_one_line(tmp_path, how):
    path = tmp_path / "elastic.pt"
    damaged(path, how)
    said = refusal(elastic_module(ROOT / ELASTIC), path)
    assert said.startswith(f"refused: {path}: not elastic.py's checkpoint ("), said


def test_elastic_damaged_checkpoint_every_rank_one_line(tmp_path):
    """A real start at 2 ranks (plain python: torchrun-like launchers share the agent's store,
    which elastic.py refuses first): each rank prints the line, no traceback, nothing written."""
    path = tmp_path / "elastic.pt"
    before = damaged(path, "truncated")
    args = ["--ckpt-dir", tmp_path, "--steps", "3", "--step-time", "0"]
    result = run_lesson(ELASTIC, *args, nproc=2, launcher="python", timeout=120)
    message = f"error: {path}: not elastic.py's checkpoint ("
    assert_fails(result, message, within=2)
    assert sum(message in line for line in result.stderr.splitlines()) == 2, result
    assert "Traceback" not in result.output, result
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_the_check_fails_when_elastic_catches_too_little(tmp_path):
    """A reader who catches only the KeyError of a wrong file: the damaged file escapes as a
    traceback, and the check above says so."""
    copy = mutant(tmp_path, ELASTIC, ("except Exception as error:", "except KeyError as error:"))
    path = tmp_path / "elastic.pt"
    damaged(path, "truncated")
    said = refusal(elastic_module(copy), path)
    assert said.startswith("traceback: "), said
    assert not said.startswith(f"refused: {path}"), said


@pytest.mark.parametrize("how", ["empty", "truncated"])
def test_generate_refuses_a_damaged_model_file_in_one_line(tmp_path, how):
    """generate.py reads train.py's model.pt: a damaged one is one line (sys.exit), no traceback."""
    import sys

    sys.path.insert(0, str(ROOT / "transformer_basics"))
    try:
        import generate
        from model import GPT, GPTConfig

        cfg = GPTConfig(vocab_size=256, block_size=8, n_layer=1, n_head=1, n_embd=8)
        path = tmp_path / "model.pt"
        torch.save({"config": asdict(cfg), "model": GPT(cfg).state_dict()}, path)
        generate.check_model_file(path)  # the undamaged file passes
        data = path.read_bytes()
        path.write_bytes(b"" if how == "empty" else data[: len(data) // 2])
        with pytest.raises(SystemExit) as stop:
            generate.check_model_file(path)
    finally:
        sys.path.remove(str(ROOT / "transformer_basics"))
    line = str(stop.value.code)
    assert re.fullmatch(rf"error: {re.escape(str(path))} is not a model\.pt written by .*", line)
