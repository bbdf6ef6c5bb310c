"""What an embedding request asks of its vector (vLLM's PoolingParams; `LLM.embed`, the server's /v1/embeddings).

A request that pools runs its prompt and generates nothing: its embedding is the final hidden state (after the
model's last norm) of its last token, which is how decoder embedding models are read (last-token pooling:
Qwen3-Embedding, e5-mistral, gte-Qwen2), and how vLLM embeds with a generative model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvstrata.errors import ParameterError


@dataclass(frozen=True)
class PoolingParams:
    normalize: bool = True  # to unit length, so that a dot product of two embeddings is their cosine similarity
    dimensions: int | None = None  # Matryoshka embeddings: only the first n values are kept (then normalized)

    def __post_init__(self) -> None:
        if not isinstance(self.normalize, bool):
            raise ParameterError("normalize", f"normalize must be true or false, got {self.normalize!r:.200}")
        dimensions = self.dimensions
        if dimensions is not None and (isinstance(dimensions, bool) or not isinstance(dimensions, int)
                                       or dimensions < 1):
            raise ParameterError("dimensions", f"dimensions must be an integer >= 1, got {dimensions!r:.200}")

    def embedding(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The float32 embedding (on the CPU) of a last token's final hidden state; None where it is not finite."""
        vector = hidden.float()[: self.dimensions]
        if not torch.isfinite(vector).all():
            return None
        # a copy: a view would keep the step's hidden states alive
        return (F.normalize(vector, dim=0) if self.normalize else vector).to("cpu", copy=True)
