"""A decoder-only GPT in one file: the model every lesson of this folder trains.

Token + position embeddings, pre-LayerNorm blocks of causal self-attention and a 4x GELU
MLP, a final LayerNorm, and a language-model head that shares its weight with the token
embedding (weight tying). GPT-2 initialisation. The module names are the ones the
parallelism plans address:

    wte, wpe                     embeddings         (pipeline stage 0 only)
    blocks["0"] .. blocks["L-1"] ln_1, attn.{q,k,v,proj}, ln_2, mlp.{fc,proj}
    ln_f, lm_head                final norm, head   (last pipeline stage only)

blocks is a ModuleDict keyed by the layer number, so that a pipeline stage can delete the
layers it does not own and keep the names (and so the checkpoint keys) of the rest.
Attention reshapes with view(B, T, -1, head_dim): under tensor parallelism each rank holds
n_head / tp heads, and the same code runs unchanged.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 256  # bytes (data.py)
    block_size: int = 64  # context length
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg.n_embd % cfg.n_head == 0, "n_embd must be a multiple of n_head"
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # three projections, not one
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # fused qkv: column-wise TP
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)  # shards each one by heads
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = cfg.dropout

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = (
            lin(x).view(B, T, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x):
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg, activation_checkpointing=False):
        super().__init__()
        self.cfg = cfg
        # not a weight: not in the checkpoints
        self.activation_checkpointing = activation_checkpointing
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # weight tying: one matrix reads and writes tokens
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: scale residual projections by depth
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """idx: (B, T) token ids -> logits (B, T, vocab); with targets (B, T), the mean
        cross-entropy instead, computed here so that torch.compile fuses it with the head (as
        nanoGPT's model(idx, targets)). A pipeline stage without wte takes hidden states (B, T, C)
        instead, and one without lm_head returns them."""
        if self.wte is not None:
            pos = torch.arange(idx.shape[1], device=idx.device)
            x = self.drop(self.wte(idx) + self.wpe(pos))
        else:
            x = idx
        for block in self.blocks.values():
            if self.activation_checkpointing and torch.is_grad_enabled():
                # Keep only the block's input; backward runs the block again for its activations.
                # The RNG state is saved and restored, so dropout draws the same masks
                # (use_reentrant=False: the form the docs recommend, which works with DDP and FSDP2;
                # torch/utils/checkpoint.py, 2.13)
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        # float32 for the softmax, also under bf16 autocast
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def num_params(self, non_embedding=True):
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self):
        """Training FLOPs per token: 6N for the matmuls (forward 2N, backward 4N) plus
        attention scores and values, 6 * 2 * n_layer * T * n_embd (PaLM appendix B)."""
        c = self.cfg
        return 6 * self.num_params() + 12 * c.n_layer * c.block_size * c.n_embd

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=1.0, top_k=None):
        """Sample max_new_tokens after idx (B, T), one token at a time. temperature 0 is greedy
        decoding: always the most likely token (the limit of sampling as temperature -> 0)."""
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size :])[:, -1, :]
            if temperature == 0:
                next_token = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_token = torch.multinomial(F.softmax(logits, dim=-1), 1)
            idx = torch.cat([idx, next_token], dim=1)
        return idx


def config_from_args(args, vocab_size=256):
    """The configuration from anything with these attributes (a lesson's parsed flags)."""
    return GPTConfig(
        vocab_size=vocab_size,
        block_size=args.block_size,
        n_layer=args.n_layer,
        n_head=args.n_head,
        n_embd=args.n_embd,
        dropout=args.dropout,
    )
