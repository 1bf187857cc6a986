"""The guard against lessons that only work because everything is on the CPU (tests/device_lint.py).

On a GPU node the lessons use NCCL, which rejects CPU tensors; on the CPU machines that run this
suite everything is on the CPU, so a tensor or module left there passes unseen. The lint reads
every lesson and demands that each tensor factory and each module says where it lives.
"""

import textwrap

import pytest

from device_lint import lint
from harness import ROOT


def test_every_lesson_says_where_its_tensors_and_modules_live():
    problems = lint(ROOT)
    assert not problems, (
        "tensors or modules that would stay on the CPU on a GPU run:\n" + "\n".join(problems)
    )


def lint_snippet(tmp_path, code):
    (tmp_path / "primitives").mkdir()
    (tmp_path / "primitives" / "lesson.py").write_text(textwrap.dedent(code))
    return lint(tmp_path)


BAD = {
    "factory without a device": (
        "t = torch.zeros(4)\ndist.all_reduce(t)",
        "torch.zeros(...) does not say",
    ),
    "from_numpy left on the host": ("t = torch.from_numpy(a)", "torch.from_numpy"),
    "CPU generator on the device": (
        "t = torch.randn(4, generator=g, device=ctx.device)",
        "generator=...) on a non-CPU",
    ),
    "module never moved": (
        "model = nn.Linear(2, 2)\nDDP(model)",
        "nn.Linear(...) builds parameters",
    ),
    "repo module never moved": (
        "class Net(nn.Module):\n    pass\ndef f():\n    ref = Net()\n    ref(x)",
        "Net(...) builds parameters",
    ),
    "load without map_location": (
        "sd = torch.load(path, weights_only=True)",
        "without map_location",
    ),
    "load that unpickles": (
        "sd = torch.load(path, map_location='cpu')",
        "without weights_only=True",
    ),
    "factory in forward": (
        "class Net(nn.Module):\n    def forward(self, x):\n        return x + torch.arange(3)",
        "torch.arange(...) does not say",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_the_lint_flags(tmp_path, case):
    code, message = BAD[case]
    problems = lint_snippet(tmp_path, code)
    assert len(problems) == 1 and message in problems[0], problems


def test_the_lint_accepts_placed_code(tmp_path):
    code = """
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("mask", torch.ones(2, 2))
    def main(ctx):
        t = torch.zeros(4, device=ctx.device)
        host = torch.arange(4, device="cpu")
        x = torch.randn(4, generator=g).to(ctx.device)
        y = torch.arange(4).float().view(2, 2).to(ctx.device)
        z = torch.from_numpy(a).to(ctx.device)
        ref = Net()
        ref.to(ctx.device)
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU()).to(ctx.device)
        layers = [nn.Linear(2, 2) for _ in range(3)]
        other = nn.Linear(2, 2, device=ctx.device)
        with torch.device("meta"):
            big = Net()
        odd = torch.ones(3)  # device: a stand-in for a test of this exemption
        sd = torch.load(path, map_location=ctx.device, weights_only=True)
    """
    assert lint_snippet(tmp_path, code) == []
