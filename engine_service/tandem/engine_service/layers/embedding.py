"""Token embedding table whose parameter is allocated, not initialised (weights are loaded)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class VocabEmbedding(nn.Module):
    """Maps token ids to rows of `weight [vocab_size, hidden_size]`.

    The table is left uninitialised: every parameter is later filled from a checkpoint or by
    the dummy initialiser, so paying for a random init here would only slow large models down.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.vocab_size}, {self.hidden_size}"
