"""Bytes in, windows out: the tokenizer, the corpus and the per-rank batches of this folder.

Tokenizer: the UTF-8 bytes of the text (vocab 256), so any file works and nothing is
downloaded. Corpus: by default a text generated here, from a fixed seed: short sentences
about a small world with facts that repeat ("the red fox lives in the forest"), sums
("seven plus two is nine") and counting, so a small model can learn spelling, grammar and
some facts in a minute, and a falling loss means it did. `--data PATH` reads any UTF-8 file.

Batches: the token stream is cut into windows of block_size + 1 tokens. Each epoch visits
them in an order shuffled from (seed, epoch). Every step takes the next
batch_size * accum * world_size windows of that order; rank r reads its own disjoint slice
(like DistributedSampler). The batch of a step is a function of (seed, step) alone, so a
resumed run reads exactly what the uninterrupted one read.
"""

import random
from pathlib import Path

import torch

NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen".split()
)
ANIMALS = "fox owl bear cat dog hen goat wolf frog duck mole crow".split()
COLOURS = "red brown grey black white green".split()
PLACES = "forest river barn hill lake field cave garden".split()
FOODS = "berries fish seeds grass worms apples corn mice".split()


def generate_corpus(n_sentences=12000, seed=1234):
    """Deterministic text, about 400 KB by default; nothing is stored in the repository."""
    rng = random.Random(seed)
    # The facts of this world: each animal has one colour, home and food, drawn once.
    world = {a: (rng.choice(COLOURS), rng.choice(PLACES), rng.choice(FOODS)) for a in ANIMALS}
    lines = []
    for _ in range(n_sentences):
        animal = rng.choice(ANIMALS)
        colour, place, food = world[animal]
        kind = rng.randrange(5)
        if kind == 0:
            lines.append(f"the {colour} {animal} lives in the {place}.")
        elif kind == 1:
            lines.append(f"the {animal} eats {food} in the {place}.")
        elif kind == 2:
            a, b = rng.randrange(10), rng.randrange(9)
            lines.append(f"{NUMBERS[a]} plus {NUMBERS[b]} is {NUMBERS[a + b]}.")
        elif kind == 3:
            start = rng.randrange(len(NUMBERS) - 4)
            lines.append("count: " + " ".join(NUMBERS[start : start + 4]) + ".")
        else:
            other = rng.choice([x for x in ANIMALS if x != animal])
            lines.append(f"the {animal} and the {other} meet at the {world[other][1]}.")
    return "\n".join(lines) + "\n"


def encode(text):
    # on the CPU: each batch moves to the device (to_device below)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long, device="cpu")


def decode(tokens):
    # An id above 255 (a model with a larger vocabulary, train.py --vocab-size) is no byte: 0xFF
    # is never valid UTF-8, so it shows as U+FFFD.
    return bytes(min(int(t), 0xFF) for t in tokens).decode("utf-8", errors="replace")


def load_text(path):
    """The text at path, or the generated corpus when path is None. Raises ValueError with a
    one-line reason for a file that is missing, unreadable or not UTF-8."""
    if path is None:
        return generate_corpus()
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"--data {path}: no such file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(
            f"--data {path}: not UTF-8 text ({error.reason} at byte {error.start})"
        ) from None


def check_tokens(tokens, block_size, path):
    """A one-line reason why tokens cannot train a model with this context, or None."""
    name = f"--data {path}" if path else "the generated corpus"
    if len(tokens) == 0:
        return f"{name} is empty"
    # Both splits need at least one window of block_size + 1 tokens.
    need = 10 * (block_size + 1)
    if len(tokens) < need:
        return (
            f"{name} has {len(tokens)} tokens, shorter than the {need} needed for a training "
            f"and a validation window of --block-size {block_size} + 1: use a longer text or a "
            "smaller --block-size"
        )
    return None


def load_tokens(path, block_size, ctx):
    """The text's bytes (path None: the generated corpus), split 90% / 10% into training and
    validation; on every rank, one line and exit 2 for a text that cannot train this context."""
    try:
        tokens = encode(load_text(path))
    except ValueError as error:
        ctx.require(False, str(error))
    problem = check_tokens(tokens, block_size, path)
    ctx.require(problem is None, problem)
    return split(tokens)


def split(tokens, val_fraction=0.1):
    """The first 90% trains, the last 10% validates (contiguous, so no window straddles both)."""
    n_val = max(int(len(tokens) * val_fraction), 1)
    return tokens[:-n_val], tokens[-n_val:]


class ShardedWindows:
    """Fixed-length windows of a token stream, each rank reading its own share of a step."""

    def __init__(self, tokens, block_size, rank, world_size, seed=0):
        self.tokens, self.block_size = tokens, block_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.n_windows = (len(tokens) - 1) // block_size
        assert self.n_windows >= 1, "check_tokens() first"
        self._order = (None, None)

    def order(self, epoch):
        if self._order[0] != epoch:  # one permutation per epoch, the same on every rank
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._order = (epoch, torch.randperm(self.n_windows, generator=g, device="cpu"))
        return self._order[1]

    def indices(self, step, micro_step, batch_size, accum):
        """Window numbers for (step, micro_step) on this rank: positions in the global stream."""
        per_step = batch_size * accum * self.world_size
        first = step * per_step + (micro_step * self.world_size + self.rank) * batch_size
        out = []
        for i in range(first, first + batch_size):
            epoch, pos = divmod(i, self.n_windows)
            out.append(int(self.order(epoch)[pos]))
        return out

    def batch(self, step, micro_step, batch_size, accum=1, device=None):
        """(x, y): y is x shifted by one token; on the CPU, or sent to device (to_device)."""
        with torch.profiler.record_function("data.batch"):  # train.py --profile: the data time
            starts = (
                torch.tensor(self.indices(step, micro_step, batch_size, accum), device="cpu")
                * self.block_size
            )
            rows = self.tokens[starts[:, None] + torch.arange(self.block_size + 1, device="cpu")]
            x, y = rows[:, :-1], rows[:, 1:]
            if device is None:
                return x, y
            return to_device(x, device), to_device(y, device)


def to_device(x, device):
    """Pinned memory and a non-blocking copy on a GPU; a no-op on the CPU."""
    if device.type == "cpu":
        return x
    return x.pin_memory().to(device, non_blocking=True)
