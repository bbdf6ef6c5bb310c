"""Shared by the CacheGen benchmarks: long Austen contexts, their exact KV, and quality through a decoded cache."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvstrata.cachegen.codec import decode_tensor, encode_tensor
from kvstrata.cachegen.levels import CodecSettings
from kvstrata.cachegen.token_importance import observed_importance, token_codes
from kvstrata.data import EMMA
from kvstrata.engine.direct_forward import compute_kv
from kvstrata.eval.cache_scorer import CacheScorer
from kvstrata.kv.preloaded import PreloadedKV
from kvstrata.kv.store.forms import StoredForm

DATA = Path(__file__).parent / "data"
PERSUASION = DATA / "persuasion.txt"
TEXTS = {"emma": EMMA, "persuasion": PERSUASION}
# Beyond Austen (the level bins were first chosen on Emma and Persuasion). Steps from sensitivity were chosen
# looking at the tuning texts (argparse: Python's own source, CPython 3.11, the PSF license of
# python_docs.LICENSE); the held-out ones were first evaluated for the figures in docs/BENCHMARKS.md.
TUNING_TEXTS = {**TEXTS, "kjv-acts": DATA / "kjv_acts.txt", "python-logging": DATA / "python_logging_cookbook.txt",
                "python-argparse": DATA / "python_argparse.txt"}
HELD_OUT_TEXTS = {"kjv-1samuel": DATA / "kjv_1samuel.txt", "python-tutorial": DATA / "python_tutorial.txt"}
ALL_TEXTS = {**TUNING_TEXTS, **HELD_OUT_TEXTS}
CONTEXT_TOKENS = 3072  # two chunks of 1,536
SCORED_TOKENS = 512


class Window:
    """A context of CONTEXT_TOKENS tokens and the SCORED_TOKENS that follow it."""

    def __init__(self, engine, name: str, offset_chars: int = 50_000):
        text = ALL_TEXTS[name].read_text(encoding="utf-8")[offset_chars : offset_chars + 40_000]
        self.name, self.offset_chars = name, offset_chars
        self.token_ids = engine.tokenize(text)[: CONTEXT_TOKENS + SCORED_TOKENS]
        self.k, self.v = compute_kv(engine, self.token_ids[:CONTEXT_TOKENS])
        self.scorer = CacheScorer(engine)
        self._reference = None  # the uncompressed cache's logits, computed on first use
        self.importance = observed_importance(engine, self.token_ids[:CONTEXT_TOKENS], self.k, self.v)

    def logits(self, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.scorer.next_token_logits(self.token_ids, CONTEXT_TOKENS, tokens_per_step=64,
                                             preloaded=[PreloadedKV(0, k, v)])

    def reference(self) -> torch.Tensor:
        if self._reference is None:
            self._reference = self.logits(self.k, self.v)
        return self._reference

    def quality(self, k: torch.Tensor, v: torch.Tensor) -> dict:
        """Perplexity of the scored tokens, greedy agreement with the uncompressed cache's predictions, and the
        mean KL divergence of the next-token distributions from the uncompressed cache's (nats: less noisy than
        one window's perplexity)."""
        logits = self.logits(k, v).log_softmax(-1)
        reference = self.reference().log_softmax(-1)
        targets = torch.tensor(self.token_ids[CONTEXT_TOKENS:])
        return {
            "perplexity": torch.nn.functional.nll_loss(logits, targets).exp().item(),
            "agreement": (logits.argmax(-1) == reference.argmax(-1)).float().mean().item(),
            "kl": (reference.exp() * (reference - logits)).sum(-1).mean().item(),
        }


def round_trip(x: torch.Tensor, settings: CodecSettings, kind: str, chunk_tokens: int = 1536, profile=None,
               importance: torch.Tensor | None = None):
    """Encode K or V (`kind`) [L, T, H, D] in independent chunks; the decoded tensor and the bytes used.
    `profile`: the model's TensorProfile of `kind` (profiled models, sensitivity steps); `importance`: the
    tokens' [L, T] (token_importance.py), for settings with steps per token."""
    layers, tokens = x.shape[:2]
    codes = token_codes(importance, kind) if settings.token_steps else None
    pieces, size = [], 0
    for start in range(0, tokens, chunk_tokens):
        chunk = x[:, start : start + chunk_tokens].reshape(layers, -1, x.shape[2] * x.shape[3])
        sections = encode_tensor(chunk, settings, kind, profile,
                                 token_codes=None if codes is None else codes[:, start : start + chunk_tokens],
                                 first_position=start)
        size += sum(len(data) for data in sections.values())
        pieces.append(decode_tensor(sections, settings, tuple(chunk.shape), kind, profile, first_position=start))
    return torch.cat(pieces, dim=1).reshape(x.shape), size


@dataclass(frozen=True)
class StoreObjects:
    """K or V coded as the KV store writes it: one object per (256-token chunk, layer), its coder models fitted, by a
    store form (kvstrata/kv/store/forms.py); `positioned`: each chunk's position known (coded over components where
    the form has them), else as a chunk whose tokens are not in order (over channels)."""

    form: StoredForm
    positioned: bool
    chunk_tokens: int = 256

    def round_trip(self, x: torch.Tensor, kind: str) -> tuple[torch.Tensor, int]:
        """x [L, T, H, D] decoded, and the objects' payload bytes (each object's header, about 200 bytes, apart)."""
        num_layers, tokens = x.shape[:2]
        decoded, size = torch.empty_like(x), 0
        for start in range(0, tokens, self.chunk_tokens):
            position = start if self.positioned else None
            form = self.form.at(position)
            for layer in range(num_layers):
                piece = x[layer, start : start + self.chunk_tokens]
                payload = form.encode(piece, kind, layer, num_layers, position)
                size += len(payload)
                decoded[layer, start : start + self.chunk_tokens] = form.decode(
                    payload, tuple(piece.shape), kind, layer, num_layers, position)
        return decoded, size
