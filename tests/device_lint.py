"""A static check that every tensor and module in the lessons says where it lives.

On GPUs the lessons use NCCL, which takes CUDA tensors only: a tensor or module left on the CPU
fails there ("No backend type associated with device type cpu", or a device mismatch in a
matmul), while on the CPU machines that run our suite the same code passes, because there
everything is on the CPU. This lint makes the mistake visible without a GPU. Its rules:

1. A tensor factory (torch.zeros, torch.randn, torch.tensor, ...) passes `device=`, or its
   result goes straight into `.to(...)` / `.cuda()` (through other method calls at most), or it
   stands inside `with torch.device(...)`. A tensor meant for the host says `device="cpu"`.
   `torch.from_numpy(...)` goes into `.to(...)`. Factories in an nn.Module's `__init__` are
   exempt (they become parameters or buffers and move with the module).
2. A factory with `generator=` does not pass a non-CPU `device=` (a CPU generator cannot
   drive a CUDA factory: generate on the host, then move).
3. A module with parameters (nn.Linear, ..., or a class of this repository that subclasses
   nn.Module), built outside a module class and not as an argument of another module, is
   placed: `device=`, `.to(...)` / `.to_empty(...)` on the result, inside
   `with torch.device(...)`, or assigned to a name that gets `.to(` / `.to_empty(` later in the
   same function.
4. `torch.load` passes `map_location=` and `weights_only=True`.

A call that is right for a reason the rules cannot see carries a comment `# device: why` on one of
its lines.

    python tests/device_lint.py [ROOT]      # prints file:line: message, exit 1 if any
"""

import ast
import sys
from pathlib import Path

FOLDERS = ("primitives", "ddp_basics", "fsdp_basics", "transformer_basics", "launch")
FACTORIES = {
    "tensor",
    "as_tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "linspace",
    "logspace",
    "eye",
    "rand",
    "randn",
    "randint",
    "randperm",
}
MOVES = {"to", "to_empty", "cuda"}
NN_WITH_PARAMETERS = {
    "Linear",
    "Bilinear",
    "Embedding",
    "EmbeddingBag",
    "LayerNorm",
    "RMSNorm",
    "GroupNorm",
    "Conv1d",
    "Conv2d",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchNorm3d",
    "SyncBatchNorm",
    "Sequential",
    "ModuleList",
    "ModuleDict",
    "ParameterList",
    "ParameterDict",
    "MultiheadAttention",
    "RNN",
    "LSTM",
    "GRU",
    "Transformer",
    "TransformerEncoder",
    "TransformerEncoderLayer",
    "TransformerDecoder",
    "TransformerDecoderLayer",
}


def lesson_files(root):
    return sorted(f for folder in FOLDERS for f in (Path(root) / folder).glob("*.py"))


def _dotted(node):
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _is_module_base(base, known):
    name = _dotted(base) or ""
    return name in ("nn.Module", "torch.nn.Module", "Module") or name.split(".")[-1] in known


def repo_module_classes(files):
    """Names of the classes in these files that subclass nn.Module (directly or through each
    other)."""
    classes = {}
    for f in files:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ClassDef):
                classes[node.name] = node.bases
    known, grew = set(), True
    while grew:
        grew = False
        for name, bases in classes.items():
            if name not in known and any(_is_module_base(b, known) for b in bases):
                known.add(name)
                grew = True
    return known


def _keyword(call, name):
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_cpu(node):
    if isinstance(node, ast.Constant):
        return node.value == "cpu"
    return (
        isinstance(node, ast.Call)
        and _dotted(node.func) == "torch.device"
        and bool(node.args)
        and _is_cpu(node.args[0])
    )


class _Checker(ast.NodeVisitor):
    def __init__(self, path, source, module_classes):
        self.path, self.lines, self.module_classes = path, source.splitlines(), module_classes
        self.parents, self.problems = [], []

    def visit(self, node):
        self.parents.append(node)
        super().visit(node)
        self.parents.pop()

    def flag(self, node, message):
        # the comment may sit on any line of the statement (the formatter moves it to its last line)
        stmt = next((n for n in reversed(self.parents) if isinstance(n, ast.stmt)), node)
        end = getattr(stmt, "end_lineno", None) or node.lineno
        if not any("# device:" in line for line in self.lines[node.lineno - 1 : end]):
            self.problems.append(f"{self.path}:{node.lineno}: {message}")

    def _ancestors(self):
        return reversed(self.parents[:-1])  # nearest first; the node itself is self.parents[-1]

    def _moved(self):
        """The call being visited flows, through method calls, into .to(...), .cuda() or
        .to_empty(...)."""
        chain = self.parents
        i = len(chain) - 1
        while (
            i >= 2
            and isinstance(chain[i - 1], ast.Attribute)
            and isinstance(chain[i - 2], ast.Call)
            and chain[i - 2].func is chain[i - 1]
        ):
            if chain[i - 1].attr in MOVES:
                return True
            i -= 2
        return False

    def _in_device_context(self):
        for node in self._ancestors():
            if isinstance(node, ast.With) and any(
                isinstance(item.context_expr, ast.Call)
                and _dotted(item.context_expr.func) == "torch.device"
                for item in node.items
            ):
                return True
        return False

    def _enclosing(self, kinds):
        return next((n for n in self._ancestors() if isinstance(n, kinds)), None)

    def _in_module_class(self, init_only=False):
        parents = list(self._ancestors())
        for i, node in enumerate(parents):
            if isinstance(node, ast.ClassDef) and any(
                _is_module_base(b, self.module_classes) for b in node.bases
            ):
                if not init_only:
                    return True
                inner = parents[:i]
                funcs = [n for n in inner if isinstance(n, ast.FunctionDef)]
                return bool(funcs) and funcs[-1].name == "__init__"
        return False

    def _is_module_call(self, call):
        name = _dotted(call.func) or ""
        last = name.split(".")[-1]
        if name.startswith(("nn.", "torch.nn.")) and last in NN_WITH_PARAMETERS:
            return True
        return last in self.module_classes and (name == last or name.count(".") == 1)

    def _nested_in_module_call(self):
        """An argument of another module's constructor, or an element of a list of layers (which
        can only become parameters through a container module)."""
        containers = (ast.List, ast.Tuple, ast.ListComp, ast.GeneratorExp, ast.Starred)
        return any(
            isinstance(n, containers) or isinstance(n, ast.Call) and self._is_module_call(n)
            for n in self._ancestors()
        )

    def _assigned_then_moved(self, call):
        assign = self.parents[-2] if len(self.parents) >= 2 else None
        if not isinstance(assign, (ast.Assign, ast.AnnAssign)) or assign.value is not call:
            return False
        targets = assign.targets if isinstance(assign, ast.Assign) else [assign.target]
        names = {_dotted(t) for t in targets} - {None}
        scope = (
            self._enclosing((ast.FunctionDef, ast.AsyncFunctionDef, ast.Module)) or self.parents[0]
        )
        return any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr in MOVES
            and _dotted(n.func.value) in names
            and n.lineno >= call.lineno
            for n in ast.walk(scope)
        )

    def visit_Call(self, call):
        name = _dotted(call.func) or ""
        device = _keyword(call, "device")
        if name in {f"torch.{f}" for f in FACTORIES}:
            placed = device is not None or self._moved() or self._in_device_context()
            if not placed and not self._in_module_class(init_only=True):
                self.flag(
                    call,
                    f"{name}(...) does not say where it lives: pass device= "
                    '(device="cpu" for a host tensor) or move it with .to(...)',
                )
            if (
                _keyword(call, "generator") is not None
                and device is not None
                and not _is_cpu(device)
            ):
                self.flag(
                    call,
                    f"{name}(..., generator=...) on a non-CPU device: a CPU generator cannot "
                    "drive it; generate on the CPU, then .to(device)",
                )
        elif name == "torch.from_numpy" and not self._moved():
            self.flag(call, "torch.from_numpy(...) lives on the CPU: move it with .to(...)")
        elif name == "torch.load":
            weights_only = _keyword(call, "weights_only")
            if _keyword(call, "map_location") is None:
                self.flag(
                    call,
                    "torch.load without map_location= puts tensors back on the device they were "
                    "saved from (cuda:0 for every rank)",
                )
            if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                self.flag(call, "torch.load without weights_only=True unpickles arbitrary objects")
        elif self._is_module_call(call):
            placed = (
                device is not None
                or self._moved()
                or self._in_device_context()
                or self._assigned_then_moved(call)
            )
            if not placed and not self._in_module_class() and not self._nested_in_module_call():
                self.flag(
                    call,
                    f"{name}(...) builds parameters on the CPU and never moves them: "
                    "pass device= or call .to(device) on it",
                )
        self.generic_visit(call)


def lint(root="."):
    files = lesson_files(root)
    module_classes = repo_module_classes(files)
    problems = []
    for f in files:
        source = f.read_text()
        checker = _Checker(f.relative_to(root), source, module_classes)
        checker.visit(ast.parse(source, str(f)))
        problems += checker.problems
    return problems


if __name__ == "__main__":
    found = lint(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1])
    print("\n".join(found) or "device lint: no problems")
    sys.exit(1 if found else 0)
