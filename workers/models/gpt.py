"""A small decoder-only transformer, laid out for model parallelism.

Names follow what the strategies split: `layers` is a ModuleDict keyed "0".."n-1" so a
pipeline stage that drops the layers it does not own keeps the full model's parameter
names (its checkpoint shards then merge and reshard by name); attention's q/k/v/o and
the MLP's fc1/fc2 are the linears tensor parallelism splits by column, then by row.
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.o = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds only its share of them.
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(width), Attention(width, heads)
        self.ln2, self.mlp = nn.LayerNorm(width), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, *, layers: int, width: int, heads: int, context: int):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(context, width)
        self.layers = nn.ModuleDict({str(i): Block(width, heads) for i in range(layers)})
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        for name, p in self.named_parameters():  # GPT-2's init: small normal weights, zero biases
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.dim() > 1:
                nn.init.normal_(p, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A pipeline stage without the embeddings gets hidden states, not token ids;
        # one without the head returns them.
        if self.tok is not None:
            x = self.tok(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None:
            x = self.head(self.norm(x))
        return x


    def tensor_parallel_plan(self) -> dict:
        """Column-split q/k/v and fc1 (each rank computes its heads and its part of the
        hidden layer), row-split o and fc2 (partial sums, all-reduced): two all-reduces a
        block. Embeddings, norms and the head stay whole on every rank."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = {}
        for i in self.layers:
            for name in ("attn.q", "attn.k", "attn.v", "mlp.fc1"):
                plan[f"layers.{i}.{name}"] = ColwiseParallel()
            for name in ("attn.o", "mlp.fc2"):
                plan[f"layers.{i}.{name}"] = RowwiseParallel()
        return plan

    def stage(self, stage: int, stages: int) -> GPT:
        """Pipeline stage `stage` of `stages`: a GPT that shares this one's modules but
        runs only its contiguous share of the layers, with the embeddings if first and
        the norm and head if last. Its parameter names are the whole model's."""
        names = list(self.layers)
        per, extra = divmod(len(names), stages)
        lo = stage * per + min(stage, extra)
        hi = lo + per + (1 if stage < extra else 0)
        part = copy.copy(self)  # nn.Module keeps its children in dicts: copy those, not the modules
        part._parameters, part._buffers, part._modules = dict(self._parameters), dict(self._buffers), dict(self._modules)
        part.layers = nn.ModuleDict({name: self.layers[name] for name in names[lo:hi]})
        if stage > 0:
            part.tok = part.pos = None
        if stage < stages - 1:
            part.norm = part.head = None
        return part


def gpt(*, num_classes: int, layers: int = 4, width: int = 128, heads: int = 4, context: int = 64, **_) -> GPT:
    """num_classes is the vocabulary: the model predicts the next token among them."""
    return GPT(num_classes, layers=layers, width=width, heads=heads, context=context)
