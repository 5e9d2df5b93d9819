"""A small Llama-style decoder-only transformer that keeps its KV cache in paged blocks.

RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, with
random weights drawn from a seed: two processes that build the model from the same
config and seed hold bit-identical weights.

The KV cache is ``2 * n_layers`` tensors laid out K0, V0, K1, V1, ... ("KV..KV"), each
``[num_blocks, block_size, n_kv_heads, head_dim]``: what a datadist blocks cache with
``tensor_num_per_layer=2`` moves layer by layer.  A sequence addresses it through a block
table: its tokens ``[i * block_size, (i + 1) * block_size)`` live in physical block
``table[i]``.

Attention gathers exactly the blocks that hold a sequence's context and masks the
positions past it, so the kernels and shapes of a computation depend only on the
sequences, never on which physical blocks they occupy: a sequence prefilled in one process
and decoded in another yields the same bits as one process doing both, provided both run
with the same number of threads.

Prefix caching keys a full block by :func:`prefix_hashes`: the hash of block i stands for
all the tokens up to the end of that block, so prompts that open alike share their first
hashes, and a prompt may reuse the KV of those blocks instead of computing them.
"""
from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

__all__ = ["KV_DTYPE", "ModelConfig", "blocks_for", "block_slots", "prefix_hashes", "reusable_blocks",
           "BlockAllocator", "PagedKV", "TinyLlama", "Generation", "generate", "reference_generate"]

#: Element type of the weights, activations and KV cache.
KV_DTYPE = torch.float32


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shape of the model and of its paged KV cache."""

    n_layers: int = 8
    hidden: int = 512
    n_heads: int = 8
    n_kv_heads: int = 2
    vocab_size: int = 1024
    block_size: int = 16
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5

    def __post_init__(self) -> None:
        if min(self.n_layers, self.hidden, self.n_heads, self.n_kv_heads, self.vocab_size, self.block_size) < 1:
            raise ValueError(f"every size must be >= 1: {self}")
        if self.hidden % self.n_heads or (self.hidden // self.n_heads) % 2:
            raise ValueError(f"hidden = {self.hidden} must split into {self.n_heads} heads of an even size")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.n_heads} heads do not share {self.n_kv_heads} KV heads evenly")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.n_heads

    @property
    def intermediate(self) -> int:
        """SwiGLU width: 8/3 of ``hidden``, rounded up to a multiple of 32 as in Llama."""
        return 32 * math.ceil(8 * self.hidden / 3 / 32)

    @property
    def num_kv_tensors(self) -> int:
        """Tensors of the KV cache: K and V of every layer."""
        return 2 * self.n_layers

    def kv_shape(self, num_blocks: int) -> List[int]:
        """Shape of one KV cache tensor of ``num_blocks`` blocks."""
        return [num_blocks, self.block_size, self.n_kv_heads, self.head_dim]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one KV tensor."""
        return self.block_size * self.n_kv_heads * self.head_dim * KV_DTYPE.itemsize

    @property
    def num_params(self) -> int:
        per_layer = (2 * self.hidden * self.hidden + 2 * self.hidden * self.n_kv_heads * self.head_dim
                     + 3 * self.hidden * self.intermediate + 2 * self.hidden)
        return self.n_layers * per_layer + 2 * self.vocab_size * self.hidden + self.hidden


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks that hold ``tokens`` tokens."""
    return -(-tokens // block_size)


def block_slots(blocks: Sequence[int], block_size: int) -> List[int]:
    """The token slots of whole blocks, in order: slot ``b * block_size + i`` is position i
    of physical block b (the slot mapping a context-caching pool takes)."""
    return [b * block_size + i for b in blocks for i in range(block_size)]


def prefix_hashes(tokens: Sequence[int], block_size: int) -> List[int]:
    """Chained hashes of the full blocks of ``tokens``: hash i covers tokens
    ``[0, (i + 1) * block_size)`` (BLAKE2b-64 of hash i - 1 and block i's tokens), so two
    prompts share hash i exactly when they share that prefix, in any process on any host.
    A trailing partial block gets no hash."""
    hashes: List[int] = []
    previous = b""
    for start in range(0, len(tokens) - block_size + 1, block_size):
        block = b"".join(int(t).to_bytes(8, "little") for t in tokens[start:start + block_size])
        previous = hashlib.blake2b(previous + block, digest_size=8).digest()
        hashes.append(int.from_bytes(previous, "big"))
    return hashes


def reusable_blocks(prompt_len: int, block_size: int) -> int:
    """How many leading full blocks of a prompt may come from a cache: all but the token
    that must still be computed, since its logits give the first generated token."""
    return (prompt_len - 1) // block_size


class BlockAllocator:
    """Hands out the physical blocks of a paged cache, lowest free index first."""

    def __init__(self, num_blocks: int) -> None:
        self._free = list(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> List[int]:
        """``n`` free blocks; ``RuntimeError`` if fewer are free."""
        if n > len(self._free):
            raise RuntimeError(f"out of KV blocks: {n} wanted, {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: Sequence[int]) -> None:
        """Give ``blocks`` back."""
        for block in blocks:
            heapq.heappush(self._free, block)


class PagedKV:
    """The paged K and V tensors of every layer: ``tensors[2*i]`` is layer i's K,
    ``tensors[2*i + 1]`` its V."""

    def __init__(self, tensors: Sequence[torch.Tensor], block_size: int) -> None:
        self.tensors = list(tensors)
        self.block_size = block_size

    @classmethod
    def local(cls, config: ModelConfig, num_blocks: int) -> "PagedKV":
        """A cache in ordinary process memory (no transfer engine involved)."""
        return cls([torch.zeros(config.kv_shape(num_blocks), dtype=KV_DTYPE) for _ in range(config.num_kv_tensors)],
                   config.block_size)

    def zero_(self) -> None:
        """Clear every block: padding positions must hold finite values, as masked attention
        multiplies them by zero (and 0 * NaN is NaN)."""
        for tensor in self.tensors:
            tensor.zero_()

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        """Store ``k``/``v`` (``[tokens, n_kv_heads, head_dim]``) at the flat token slots
        ``slots`` (``block * block_size + offset``)."""
        for tensor, value in ((self.tensors[2 * layer], k), (self.tensors[2 * layer + 1], v)):
            tensor.view(-1, *tensor.shape[2:]).index_copy_(0, slots, value)

    def read_block(self, block: int) -> List[torch.Tensor]:
        """A copy of physical block ``block`` of every tensor."""
        return [tensor[block].clone() for tensor in self.tensors]

    def write_block(self, block: int, parts: Sequence[torch.Tensor]) -> None:
        """Overwrite physical block ``block`` of every tensor (``parts`` as :meth:`read_block` gives)."""
        for tensor, part in zip(self.tensors, parts):
            tensor[block].copy_(part)

    def gather(self, layer: int, tables: torch.Tensor) -> List[torch.Tensor]:
        """K and V of the blocks in ``tables`` (``[batch, blocks]``), in sequence order:
        two ``[batch, blocks * block_size, n_kv_heads, head_dim]`` tensors."""
        out = []
        for tensor in (self.tensors[2 * layer], self.tensors[2 * layer + 1]):
            picked = tensor[tables]
            out.append(picked.reshape(tables.shape[0], -1, *tensor.shape[2:]))
        return out

    def digest(self, table: Sequence[int], length: int) -> str:
        """SHA-256 of the first ``length`` tokens' K and V in every layer, in sequence order
        (independent of which physical blocks hold them)."""
        sha = hashlib.sha256()
        index = torch.tensor([list(table)[:blocks_for(length, self.block_size)]])
        for layer in range(len(self.tensors) // 2):
            for part in self.gather(layer, index):
                sha.update(part[0, :length].contiguous().view(torch.uint8).numpy().tobytes())
        return sha.hexdigest()


class _Layer(torch.nn.Module):
    """One decoder layer: pre-norm GQA attention over the paged cache, pre-norm SwiGLU MLP."""

    def __init__(self, config: ModelConfig, draw: Callable[[int, int], torch.nn.Parameter]) -> None:
        super().__init__()
        c = config
        kv_width = c.n_kv_heads * c.head_dim
        self.config = c
        self.attn_norm = torch.nn.Parameter(torch.ones(c.hidden), requires_grad=False)
        self.wq, self.wk, self.wv = draw(c.hidden, c.hidden), draw(kv_width, c.hidden), draw(kv_width, c.hidden)
        self.wo = draw(c.hidden, c.hidden)
        self.mlp_norm = torch.nn.Parameter(torch.ones(c.hidden), requires_grad=False)
        self.w_gate, self.w_up = draw(c.intermediate, c.hidden), draw(c.intermediate, c.hidden)
        self.w_down = draw(c.hidden, c.intermediate)

    def forward(self, h: torch.Tensor, rope: List[torch.Tensor], slots: torch.Tensor, tables: torch.Tensor,
                mask: torch.Tensor, kv: PagedKV, index: int) -> torch.Tensor:
        c = self.config
        b, t, _ = h.shape
        x = _rms_norm(h, self.attn_norm, c.norm_eps)
        q = _rotate(F.linear(x, self.wq).view(b, t, c.n_heads, c.head_dim), rope)
        k = _rotate(F.linear(x, self.wk).view(b, t, c.n_kv_heads, c.head_dim), rope)
        v = F.linear(x, self.wv).view(b, t, c.n_kv_heads, c.head_dim)
        kv.write(index, k.reshape(b * t, c.n_kv_heads, c.head_dim), v.reshape(b * t, c.n_kv_heads, c.head_dim), slots)
        keys, values = kv.gather(index, tables)
        group = c.n_heads // c.n_kv_heads
        keys, values = keys.repeat_interleave(group, dim=2), values.repeat_interleave(group, dim=2)
        scores = torch.einsum("bthd,blhd->bhtl", q, keys) / math.sqrt(c.head_dim)
        weights = torch.softmax(scores.masked_fill(~mask.unsqueeze(1), float("-inf")), dim=-1)
        attn = torch.einsum("bhtl,blhd->bthd", weights, values).reshape(b, t, c.hidden)
        h = h + F.linear(attn, self.wo)
        x = _rms_norm(h, self.mlp_norm, c.norm_eps)
        return h + F.linear(F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_up), self.w_down)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, rope: List[torch.Tensor]) -> torch.Tensor:
    """Rotary embedding (the rotate-half form), ``x``: ``[batch, tokens, heads, head_dim]``."""
    cos, sin = rope
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TinyLlama(torch.nn.Module):
    """The model; :meth:`prefill` and :meth:`decode` read and write a :class:`PagedKV`."""

    def __init__(self, config: ModelConfig, seed: int) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)

        def draw(fan_out: int, fan_in: int) -> torch.nn.Parameter:
            # 1/sqrt(fan_in) keeps activations of a random model in a sane range at any depth
            weight = torch.randn(fan_out, fan_in, generator=gen, dtype=KV_DTYPE) / math.sqrt(fan_in)
            return torch.nn.Parameter(weight, requires_grad=False)

        self.config = config
        self.embed = draw(config.vocab_size, config.hidden)
        self.layers = torch.nn.ModuleList(_Layer(config, draw) for _ in range(config.n_layers))
        self.norm = torch.nn.Parameter(torch.ones(config.hidden), requires_grad=False)
        self.lm_head = draw(config.vocab_size, config.hidden)
        half = config.head_dim // 2
        self.inv_freq = 1.0 / config.rope_theta ** (torch.arange(half, dtype=torch.float64) / half)

    @torch.no_grad()
    def prefill(self, tokens: Sequence[int], table: Sequence[int], kv: PagedKV, start: int = 0,
                on_layer: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """Run ``tokens`` at positions ``start, start + 1, ...`` of one sequence whose first
        ``start`` positions are already in the cache; returns the logits after the last token.

        ``table`` is the sequence's block table (it may hold more blocks than needed yet).
        ``on_layer(i)`` is called as soon as layer i's K and V are in the cache, before layer
        i + 1 runs: the hook that sends a layer while the next one computes.
        """
        stop = start + len(tokens)
        tables = torch.tensor([list(table)[:blocks_for(stop, self.config.block_size)]])
        positions = torch.arange(start, stop).unsqueeze(0)
        return self._forward(torch.tensor([list(tokens)]), positions, tables, kv, on_layer)[0]

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, kv: PagedKV) -> torch.Tensor:
        """One step for a batch: token ``tokens[b]`` at position ``positions[b]`` of sequence
        b, whose block table is row b of ``tables``; returns ``[batch, vocab]`` logits."""
        return self._forward(tokens.unsqueeze(1), positions.unsqueeze(1), tables, kv, None)

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, tables: torch.Tensor, kv: PagedKV,
                 on_layer: Optional[Callable[[int], None]]) -> torch.Tensor:
        bs = self.config.block_size
        slots = (tables.gather(1, positions // bs) * bs + positions % bs).reshape(-1)
        key_positions = torch.arange(tables.shape[1] * bs)
        mask = key_positions.view(1, 1, -1) <= positions.unsqueeze(-1)
        angles = positions.to(torch.float64).unsqueeze(-1) * self.inv_freq
        angles = torch.cat((angles, angles), dim=-1).unsqueeze(2)
        rope = [angles.cos().to(KV_DTYPE), angles.sin().to(KV_DTYPE)]
        h = F.embedding(tokens, self.embed)
        for index, layer in enumerate(self.layers):
            h = layer(h, rope, slots, tables, mask, kv, index)
            if on_layer is not None:
                on_layer(index)
        return F.linear(_rms_norm(h[:, -1], self.norm, self.config.norm_eps), self.lm_head)


@dataclasses.dataclass
class Generation:
    """Greedy output of a batch: per request, the first token (from prefill) and then every
    decoded token; the digest of its prompt's KV (see :meth:`PagedKV.digest`); and how many
    leading blocks of its prompt came from the prefix cache rather than the prefill."""

    tokens: List[List[int]]
    kv_digests: List[str]
    reused_blocks: List[int]


def generate(model: TinyLlama, kv: PagedKV, first_tokens: Sequence[int], prompt_lens: Sequence[int],
             tables: Sequence[Sequence[int]], steps: int,
             on_step: Optional[Callable[[int], None]] = None) -> List[List[int]]:
    """Greedy decoding of a batch whose prompts are in the cache: request b continues from
    ``first_tokens[b]`` at position ``prompt_lens[b]`` for ``steps`` tokens.

    Returns each request's first token followed by the ``steps`` new ones.
    """
    bs = model.config.block_size
    for lens, table in zip(prompt_lens, tables):
        if blocks_for(lens + steps, bs) > len(table):
            raise ValueError(f"a block table of {len(table)} blocks cannot hold {lens} + {steps} tokens")
    width = max(len(t) for t in tables)
    padded = torch.tensor([list(t) + [0] * (width - len(t)) for t in tables])  # padding is masked out
    current = torch.tensor(list(first_tokens))
    positions = torch.tensor(list(prompt_lens))
    out = [[token] for token in first_tokens]
    for step in range(steps):
        current = model.decode(current, positions, padded, kv).argmax(-1)
        positions = positions + 1
        for seq, token in zip(out, current.tolist()):
            seq.append(token)
        if on_step is not None:
            on_step(step + 1)
    return out


def reference_generate(config: ModelConfig, seed: int, waves: Sequence[Sequence[Sequence[int]]],
                       steps: int) -> List[Generation]:
    """One process does it all, in ordinary memory, wave after wave: each prompt in order
    reuses the longest run of leading full blocks that an earlier wave computed (a copy in
    memory; of equal blocks, the first computed is kept; see :func:`reusable_blocks`) and
    prefills the rest, then the wave's batch decodes for ``steps`` tokens, and every full
    block of the wave's prompts becomes reusable.

    Reusing rather than recomputing matters for the bits: a prefill that starts after a
    reused prefix multiplies matrices of other shapes than one over the whole prompt, and
    BLAS may round those differently.  Returns one :class:`Generation` per wave.
    """
    model = TinyLlama(config, seed)
    bs = config.block_size
    cached: Dict[int, List[torch.Tensor]] = {}  # prefix hash -> that block of every KV tensor
    out = []
    for prompts in waves:
        needed = [blocks_for(len(p) + steps, bs) for p in prompts]
        kv = PagedKV.local(config, sum(needed))
        allocator = BlockAllocator(sum(needed))
        tables = [allocator.allocate(n) for n in needed]
        first, reused = [], []
        for prompt, table in zip(prompts, tables):
            hits = 0
            for hashed in prefix_hashes(prompt, bs)[:reusable_blocks(len(prompt), bs)]:
                if hashed not in cached:
                    break
                kv.write_block(table[hits], cached[hashed])
                hits += 1
            first.append(int(model.prefill(prompt[hits * bs:], table, kv, start=hits * bs).argmax()))
            reused.append(hits)
        digests = [kv.digest(t, len(p)) for p, t in zip(prompts, tables)]
        tokens = generate(model, kv, first, [len(p) for p in prompts], tables, steps)
        for prompt, table in zip(prompts, tables):
            for block, hashed in zip(table, prefix_hashes(prompt, bs)):  # decoding wrote past these blocks only
                cached.setdefault(hashed, kv.read_block(block))
        out.append(Generation(tokens, digests, reused))
    return out
