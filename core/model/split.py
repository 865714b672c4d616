"""Pipeline stages: which layers each rank runs, and mlx-lm model classes that run only those.

As in mlx-lm's `PipelineMixin.pipeline()`, rank 0 runs the *last* layers, and rank size-1 the first. Rank 0 is the
app: it holds the final norm and the output head, samples every token and tells the workers each step's input ids
(core/distributed/leader.py). So a worker holds only its layers (and the embeddings, on the first stage), and one
forward pass moves each stage's hidden state to the next with one point-to-point send over the ring.

The classes reuse mlx-lm's llama (mistral maps to it) and qwen2 modules unchanged; only the inner model's call is
the stage's: embed or receive, run the local layers, then send on (a worker) or normalise (rank 0).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, qwen2
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.pipeline import PipelineMixin


@dataclass(frozen=True)
class _Group:
    """A stand-in for the ring group: `PipelineMixin.pipeline` reads only its rank and size, and a stage is cut
    from the plan's numbers (tests cut stages without joining a ring)."""

    r: int
    n: int

    def rank(self) -> int:
        return self.r

    def size(self) -> int:
        return self.n


def split_layers(num_layers: int, weights: list[float]) -> list[int]:
    """Layers per rank, proportional to `weights` (each rank's free memory), at least one each; the largest
    remainders get the leftover layers, as in a fair rounding."""
    size = len(weights)
    if num_layers < size:
        raise ValueError(f"the model has {num_layers} layers, fewer than the {size} ranks of the group")
    total = sum(weights)
    shares = [num_layers * w / total if total > 0 else num_layers / size for w in weights]
    counts = [max(1, int(s)) for s in shares]
    while sum(counts) > num_layers:  # the at-least-one rule took layers from a big rank
        counts[max((r for r in range(size) if counts[r] > 1), key=lambda r: counts[r] - shares[r])] -= 1
    for r in sorted(range(size), key=lambda r: counts[r] - shares[r])[:num_layers - sum(counts)]:
        counts[r] += 1
    return counts


@dataclass(frozen=True)
class Stage:
    """Rank `rank` of the group runs `split[rank]` layers, after those of the ranks above it (mlx-lm's order)."""

    rank: int
    split: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.split)

    @property
    def num_layers(self) -> int:
        return sum(self.split)

    @property
    def start(self) -> int:
        return sum(self.split[self.rank + 1:])

    @property
    def end(self) -> int:
        return self.start + self.split[self.rank]

    @property
    def embeds(self) -> bool:
        """The first stage turns ids into vectors; the others receive vectors."""
        return self.start == 0

    @property
    def heads(self) -> bool:
        """Rank 0 runs the last layers, the final norm and the output head."""
        return self.rank == 0

    def describe(self) -> str:
        return f"rank {self.rank}: layers {self.start}-{self.end - 1} of {self.num_layers}"

    def keeps(self, name: str, tied: bool) -> bool:
        """Whether this rank loads the weight `name` (mlx-lm's names)."""
        if (m := re.search(r"(?:^|\.)layers\.(\d+)\.", name)) is not None:
            return self.start <= int(m.group(1)) < self.end
        if name.startswith("model.embed_tokens."):
            return self.embeds or (self.heads and tied)  # a tied head is the embedding matrix
        if name.startswith(("model.norm.", "lm_head.")):
            return self.heads
        return True

    def apply(self, model: nn.Module) -> None:
        """Cut `model` (one of this module's classes) to this stage: the other ranks' layers become None, and the
        modules this rank never runs are removed, so their weights are neither loaded nor allocated."""
        inner = model.model
        inner.pipeline(_Group(self.rank, self.size), list(self.split))
        tied = model.args.tie_word_embeddings
        if not (self.embeds or (self.heads and tied)):
            del inner["embed_tokens"]
        if not self.heads:
            del inner["norm"]
            if "lm_head" in model:
                del model["lm_head"]


def _stage_forward(m: Any, inputs: mx.array, cache: list | None) -> mx.array:
    """One stage of the forward pass: embed (first stage) or receive the previous stage's hidden state, run the local
    layers, then send the result on (a worker: the returned array is the send, evaluate it) or normalise (rank 0)."""
    layers = m.pipeline_layers
    cache = cache if cache is not None else [None] * len(layers)
    wire = layers[0].input_layernorm.weight.dtype  # the hidden state's dtype, the same on every rank
    if m.pipeline_rank == m.pipeline_size - 1:
        h = m.embed_tokens(inputs)
    else:
        # Received before the rest of the pass is queued: a pass blocked on a lost peer then leaves one task
        # pending, not a whole graph (MLX waits process-wide while too many tasks are in flight, which would block
        # every stream, including that of the model reloaded on this machine after the failure).
        h = mx.distributed.recv((*inputs.shape, m.args.hidden_size), wire, m.pipeline_rank + 1)
        mx.eval(h)
    masks: dict[bool, Any] = {}
    for layer, c in zip(layers, cache):
        sliding = bool(getattr(layer, "use_sliding", False))
        if sliding not in masks:
            masks[sliding] = create_attention_mask(h, c, window_size=m.args.sliding_window if sliding else None)
        h = layer(h, masks[sliding], c)
    if m.pipeline_rank == 0:
        return m.norm(h)
    return mx.distributed.send(h.astype(wire), m.pipeline_rank - 1)


class _LlamaStage(llama.LlamaModel, PipelineMixin):
    def __call__(self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None
                 ) -> mx.array:
        return _stage_forward(self, inputs, cache)


class _Qwen2Stage(qwen2.Qwen2Model):
    def __call__(self, inputs: mx.array, cache: list | None = None, input_embeddings: mx.array | None = None
                 ) -> mx.array:
        return _stage_forward(self, inputs, cache)


class _StageMixin:
    """What both model classes add: the local layers as `layers` (for caches), and a worker's forward."""

    model: Any

    @property
    def layers(self) -> list:
        return self.model.pipeline_layers

    def forward_stage(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        """A worker's part of one forward pass: the send of its output (evaluate it, with the cache state)."""
        return self.model(inputs, cache)


class PipelineLlama(_StageMixin, llama.Model):
    args_class = llama.ModelArgs

    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        self.model = _LlamaStage(args)


class PipelineQwen2(_StageMixin, qwen2.Model):
    args_class = qwen2.ModelArgs

    def __init__(self, args: qwen2.ModelArgs) -> None:
        super().__init__(args)
        self.model = _Qwen2Stage(args)


# mlx-lm's model_type (after its own remapping: mistral -> llama) -> the stage class.
STAGE_CLASSES: dict[str, type[nn.Module]] = {"llama": PipelineLlama, "mistral": PipelineLlama, "qwen2": PipelineQwen2}


# --- tensor parallel (an option): every rank runs every layer on its slice of the heads --------------------------

def check_tensor_parallel(heads: int, kv_heads: int, size: int) -> None:
    """mlx-lm's `shard()` splits the attention heads evenly and does not check that it can (issue 16: 9 heads over
    2 ranks failed inside MLX): refuse in one line first."""
    if heads % size or kv_heads % size:
        raise ValueError(f"--parallel tensor needs the attention heads to divide by the {size} ranks, but the model "
                         f"has {heads} query and {kv_heads} key/value heads; use the default --parallel pipeline")


def tensor_forward(model: nn.Module, inputs: mx.array, cache: list) -> mx.array:
    """The sharded model's hidden state, tied into the last layer's cache: every rank then runs the same
    collectives whether it evaluates the logits (rank 0, decoding) or only the cache (a prefill, or a worker)."""
    h = model.model(inputs, cache)
    keys = cache[-1].keys
    cache[-1].keys = tuple(mx.depends(list(keys), h)) if isinstance(keys, tuple) else mx.depends(keys, h)
    return h


def tensor_logits(model: nn.Module, inputs: mx.array, cache: list) -> mx.array:
    """Rank 0's forward pass of a sharded model (mlx-lm's `Model.__call__`, with the tie above)."""
    h = tensor_forward(model, inputs, cache)
    return model.model.embed_tokens.as_linear(h) if model.args.tie_word_embeddings else model.lm_head(h)
