"""Sample text from a trained GPT, in one process, from the full state dict a training run exported.

train.py and train_2d.py end by gathering the unsharded weights (whatever the parallelism:
none, DDP, FSDP, FSDP x TP) into OUT/model.pt, with the model's configuration. Loading it
needs no process group and no GPU, and torch.load(weights_only=True) runs no pickled code.

    python transformer_basics/train.py && python transformer_basics/generate.py
    python transformer_basics/generate.py --checkpoint runs/gpt_2d/model.pt --prompt "seven plus" --tokens 300

Docs: https://pytorch.org/docs/stable/distributed.checkpoint.html#torch.distributed.checkpoint.state_dict.get_model_state_dict
"""

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import data
from model import GPT, GPTConfig


def load_model(path, device):
    """The GPT that a training run exported (its configuration and its full state dict), for inference."""
    saved = torch.load(path, map_location="cpu", weights_only=True)
    model = GPT(GPTConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    return model.to(device).eval()


def sample(model, prompt, tokens, temperature=0.8, top_k=10):
    """The prompt and `tokens` bytes sampled after it, as text."""
    idx = data.encode(prompt)[None].to(model.lm_head.weight.device)
    return data.decode(model.generate(idx, tokens, temperature, top_k)[0].tolist())


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--checkpoint",
        default="runs/gpt/model.pt",
        help="a model.pt written by train.py / train_2d.py",
    )
    parser.add_argument("--prompt", default="the ")
    parser.add_argument("--tokens", type=int, default=200, help="bytes to sample")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--data", help="the text the model trained on (default: the generated corpus)"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    path = Path(args.checkpoint)
    if not path.is_file():
        sys.exit(
            f"error: no checkpoint at {path}: train first (python transformer_basics/train.py --out {path.parent})"
        )
    model = load_model(path, args.device)
    cfg = model.cfg

    # A check that these are trained weights: the loss on held-out text (the validation split the
    # training run never trained on) must be well below log(256), that of uniform guessing.
    try:
        _, val_tokens = data.split(data.encode(data.load_text(args.data)))
    except ValueError as error:
        sys.exit(f"error: {error}")
    windows = data.ShardedWindows(val_tokens, cfg.block_size, 0, 1)
    x, y = (t.to(args.device) for t in windows.batch(0, 0, 8))
    with torch.no_grad():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    print(f"model: {model.num_params() / 1e6:.2f}M parameters, {cfg}")
    print(f"loss on held-out text: {loss:.3f} (uniform guessing: {math.log(256):.3f})")

    torch.manual_seed(args.seed)
    text = sample(model, args.prompt, args.tokens, args.temperature, args.top_k)
    print("sample:\n  " + text.replace("\n", "\n  "))
    if loss >= math.log(256) - 1:
        raise SystemExit(
            f"error: loss {loss:.3f} is close to uniform guessing: is {path} a trained model?"
        )
    print(f"OK: sampled {args.tokens} tokens in one process from {path} (held-out loss {loss:.3f})")


if __name__ == "__main__":
    main()
