"""Sample text from a trained GPT, in one process, from the full state dict a training run exported.

train.py and train_2d.py end by gathering the unsharded weights (whatever the parallelism:
none, DDP, FSDP, FSDP x TP) into OUT/model.pt, with the model's configuration. Loading it
needs no process group and no GPU, and torch.load(weights_only=True) runs no pickled code.

    torchrun --nproc_per_node=2 transformer_basics/train.py && python transformer_basics/generate.py
    python transformer_basics/generate.py --checkpoint runs/gpt_2d/model.pt --prompt "seven plus"
    python transformer_basics/generate.py --temperature 0     # greedy: the most likely byte

Docs: https://pytorch.org/docs/stable/distributed.checkpoint.html
      (torch.distributed.checkpoint.state_dict.get_model_state_dict)
"""

import argparse
import math
import sys
import zipfile
from pathlib import Path

import torch
import torch.nn.functional as F

import data
from launch.dist_setup import float_in, int_in
from model import GPT, GPTConfig


def load_model(path, device):
    """The GPT that a training run exported (its configuration and full state dict), to infer."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model.to(device).eval()


def sample(model, prompt, tokens, temperature=0.8, top_k=10):
    """The prompt and `tokens` bytes sampled after it, as text (temperature 0: greedy)."""
    idx = data.encode(prompt)[None].to(model.lm_head.weight.device)
    return data.decode(model.generate(idx, tokens, temperature, top_k)[0].tolist())


def main(args):
    model = load_model(args.checkpoint, args.device)
    print(f"model: {model.num_params() / 1e6:.2f}M parameters, {model.cfg}")
    loss = check_trained(model, args)
    torch.manual_seed(args.seed)
    text = sample(model, args.prompt, args.tokens, args.temperature, args.top_k)
    print("sample:\n  " + text.replace("\n", "\n  "))
    print(
        f"OK: sampled {args.tokens} tokens in one process from {args.checkpoint} (held-out loss "
        f"{loss:.3f})"
    )


# ---- The lesson ends here. What follows is how it checks itself. ----


def check_trained(model, args):
    """These are trained weights: the loss on held-out text (the validation split, which the
    training run never trained on) is well below log(256), that of uniform guessing."""
    try:
        _, val_tokens = data.split(data.encode(data.load_text(args.data)))
    except ValueError as error:
        sys.exit(f"error: {error}")
    windows = data.ShardedWindows(val_tokens, model.cfg.block_size, 0, 1)
    x, y = (t.to(args.device) for t in windows.batch(0, 0, 8))
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    print(f"loss on held-out text: {loss:.3f} (uniform guessing: {math.log(256):.3f})")
    if loss >= math.log(256) - 1:
        sys.exit(f"error: loss {loss:.3f} is close to uniform guessing: is it a trained model?")
    return loss


def check_model_file(path):
    """One line and exit 1 (not a traceback) for a missing file or one that is not a model.pt of
    train.py: its tensors are read memory-mapped, nothing is loaded yet."""
    if not Path(path).is_file():
        sys.exit(
            f"error: no checkpoint at {path}: train first (python transformer_basics/train.py "
            f"--out {Path(path).parent})"
        )
    try:
        if not zipfile.is_zipfile(path):
            raise ValueError("not a zip archive, as torch.save writes")
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        with torch.device("meta"):  # shapes only: no memory, no initialisation
            expected = GPT(GPTConfig(**saved["config"])).state_dict()
        shapes = {k: tuple(t.shape) for k, t in saved["model"].items()}
        if shapes != {k: tuple(t.shape) for k, t in expected.items()}:
            raise ValueError("its weights do not match its configuration")
    except Exception as error:  # whatever the file holds, the reader gets one line
        reason = (str(error).splitlines() or [type(error).__name__])[0][:200]
        sys.exit(f"error: {path} is not a model.pt written by train.py or train_2d.py ({reason})")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint", default="runs/gpt/model.pt", help="a model.pt of train.py / train_2d.py"
    )
    parser.add_argument("--prompt", default="the ", help="the text to go on from (not empty)")
    parser.add_argument("--tokens", type=int_in(1, 100_000), default=200, help="bytes to sample")
    parser.add_argument(
        "--temperature",
        type=float_in(0, 100),
        default=0.8,
        help="divides the logits; 0: greedy decoding, always the most likely byte (no sampling)",
    )
    parser.add_argument("--top-k", type=int_in(1, 256), default=10, help="sample from the k best")
    parser.add_argument("--seed", type=int_in(0, 2**32 - 1), default=0)
    parser.add_argument("--data", help="the text the model trained on (default: data.py's)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    if not args.prompt:
        parser.error("--prompt: give at least one character to go on from")
    check_model_file(args.checkpoint)
    main(args)
