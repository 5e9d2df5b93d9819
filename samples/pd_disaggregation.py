"""Prefill/decode disaggregation of a small Llama-style model over datadist.

Three processes on this host:

- the prompt engine (``LLMRole.PROMPT``, a link server on 127.0.0.1) prefills each request
  and, as soon as a layer's K and V are in its paged cache, pushes that layer's blocks into
  the decoder's blocks cache (``push_blocks`` with a one-layer range); then it returns the
  request's first token;
- the decoder engine (``LLMRole.DECODER``) links to the prompt, allocates the blocks each
  request will fill, and once every request's KV has arrived decodes the batch greedily
  from the received KV;
- this process, the router: it hands requests to the decoder and the prompt, measures
  time to first token, and runs the same model in one process with no transfer as the
  reference.  Every generated token (and every byte of the prompts' KV) must match it.

Both caches are datadist blocks caches of ``2 * layers`` tensors (K0, V0, K1, V1, ...),
each ``[blocks, 16, kv_heads, head_dim]``, allocated with ``allocate_blocks_cache`` and
used by the model through ``get_cache_tensors``: the engine moves the very memory the
model computes in.  Prints "tokens match" and exits 0, or prints the differences and
exits 1; a failing child process prints its traceback and the run exits 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple, Type, TypeVar

import torch

from _launch import (ChildFailed, Launcher, Peer, init_llm_datadist, link_clusters,
                     unlink_clusters)
from datadist import BlocksCacheKey, Cache, CacheDesc, CacheManager, DataType, LLMRole, Placement
from tiny_llama import (KV_DTYPE, BlockAllocator, Generation, ModelConfig, PagedKV, TinyLlama,
                        blocks_for, generate, reference_generate)

PROMPT_CLUSTER_ID = 1
DECODER_CLUSTER_ID = 2
MODEL_ID = 0


# ------------------------------------------------------------------------ messages


@dataclasses.dataclass
class Ready:
    """An engine process is up; the prompt tells its listen port."""

    listen_port: Optional[int]


@dataclasses.dataclass
class Link:
    """Router -> decoder: link to the prompt engine listening on ``port``."""

    port: int


@dataclasses.dataclass
class Linked:
    """Decoder -> router: linked; ``path`` is the transport the link uses."""

    path: str


@dataclasses.dataclass
class Admit:
    """Router -> decoder: reserve KV blocks for these requests (req id -> prompt length)."""

    prompt_lens: Dict[int, int]


@dataclasses.dataclass
class BlockTables:
    """Decoder -> router: the blocks reserved for each request."""

    tables: Dict[int, List[int]]


@dataclasses.dataclass
class Prefill:
    """Router -> prompt: prefill ``tokens`` and push their KV into the decoder's ``dst_blocks``."""

    req_id: int
    tokens: List[int]
    dst_blocks: List[int]


@dataclasses.dataclass
class FirstToken:
    """Prompt -> router: the request's KV is in the decoder's cache; its first token."""

    req_id: int
    token: int
    prefill_s: float
    kv_bytes: int
    transfer_s: float
    path: str


@dataclasses.dataclass
class KvReady:
    """Router -> decoder: the request's KV has arrived; decoding continues from ``token``."""

    req_id: int
    token: int


@dataclasses.dataclass
class Progress:
    """Decoder -> router: decode steps done so far."""

    steps: int


@dataclasses.dataclass
class Generated:
    """Decoder -> router: the batch's tokens and received-KV digests, by req id."""

    tokens: Dict[int, List[int]]
    kv_digests: Dict[int, str]
    decode_s: float


@dataclasses.dataclass
class Stop:
    """Router -> engine: unlink, free and finalize."""


_Message = TypeVar("_Message")


def _expect(message: object, kind: Type[_Message]) -> _Message:
    """``message``, which must be a ``kind``."""
    if not isinstance(message, kind):
        raise RuntimeError(f"expected a {kind.__name__} message, got {message!r}")
    return message


# ------------------------------------------------------------------------ both engines


def _kv_cache(cache_manager: CacheManager, config: ModelConfig, num_blocks: int,
              key: Optional[BlocksCacheKey]) -> Tuple[Cache, PagedKV]:
    """Allocate the paged KV cache as a datadist blocks cache; returns it and the model's view."""
    desc = CacheDesc(config.num_kv_tensors, config.kv_shape(num_blocks), DataType.from_torch(KV_DTYPE),
                     Placement.DEVICE)
    cache = cache_manager.allocate_blocks_cache(desc, key)
    kv = PagedKV(cache_manager.get_cache_tensors(cache), config.block_size)
    kv.zero_()
    return cache, kv


def _pool_bytes(config: ModelConfig, num_blocks: int) -> int:
    """A pool that holds the cache, with a MiB spare for page rounding."""
    mib = 1 << 20
    need = config.num_kv_tensors * num_blocks * config.block_bytes + mib
    return -(-need // mib) * mib


def _engine_setup() -> None:
    # One thread per process: the reference and the engines then run the same kernels
    # (and get the same bits), and two engines do not fight over a small machine's cores.
    torch.set_num_threads(1)


# ------------------------------------------------------------------------ prompt side


@dataclasses.dataclass
class PrefillJob:
    """A request on the prompt engine: its blocks here and their destination blocks."""

    req_id: int
    tokens: List[int]
    src_blocks: List[int]
    dst_blocks: List[int]
    kv_bytes: int = 0
    transfer_s: float = 0.0


def send_layer(cache_manager: CacheManager, cache: Cache, job: PrefillJob, layer: int) -> None:
    """Push layer ``layer`` (its K and V tensors) of the job's prompt blocks into the
    decoder's blocks cache, into the blocks the decoder reserved."""
    blocks = len(job.src_blocks)
    start = time.perf_counter()
    cache_manager.push_blocks(BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID), cache,
                              src_blocks=job.src_blocks, dst_blocks=job.dst_blocks[:blocks],
                              src_layer_range=range(layer, layer + 1), dst_layer_range=range(layer, layer + 1),
                              tensor_num_per_layer=2)
    job.transfer_s += time.perf_counter() - start
    job.kv_bytes += 2 * blocks * (cache.cache_desc.size // cache.cache_desc.batch_size)


def prompt_process(peer: Peer, config: ModelConfig, seed: int, num_blocks: int, transport: str) -> None:
    """The prompt engine: prefill each request, sending every layer as it finishes."""
    _engine_setup()
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True,
                                 pool_bytes=_pool_bytes(config, num_blocks))
    try:
        cache_manager = datadist.cache_manager
        cache, kv = _kv_cache(cache_manager, config, num_blocks, None)
        model = TinyLlama(config, seed)
        allocator = BlockAllocator(num_blocks)
        peer.send(Ready(datadist.listen_port))
        while not isinstance(message := peer.recv(), Stop):
            request = _expect(message, Prefill)
            job = PrefillJob(request.req_id, request.tokens,
                             allocator.allocate(blocks_for(len(request.tokens), config.block_size)),
                             request.dst_blocks)
            start = time.perf_counter()
            logits = model.prefill(job.tokens, job.src_blocks, kv,
                                   on_layer=lambda layer: send_layer(cache_manager, cache, job, layer))
            prefill_s = time.perf_counter() - start - job.transfer_s
            allocator.free(job.src_blocks)  # pushed: the decoder holds this KV now
            peer.send(FirstToken(job.req_id, int(logits.argmax()), prefill_s, job.kv_bytes, job.transfer_s,
                                 datadist.link_path(DECODER_CLUSTER_ID)))
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


# ------------------------------------------------------------------------ decoder side


def decoder_process(peer: Peer, config: ModelConfig, seed: int, num_blocks: int, steps: int, transport: str,
                    progress: bool) -> None:
    """The decoder engine: reserve blocks, wait for every request's KV, decode the batch."""
    _engine_setup()
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, transport,
                                 pool_bytes=_pool_bytes(config, num_blocks))
    try:
        cache_manager = datadist.cache_manager
        cache, kv = _kv_cache(cache_manager, config, num_blocks, BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID))
        model = TinyLlama(config, seed)
        allocator = BlockAllocator(num_blocks)
        peer.send(Ready(None))
        link_clusters(datadist, {PROMPT_CLUSTER_ID: _expect(peer.recv(), Link).port})
        peer.send(Linked(datadist.link_path(PROMPT_CLUSTER_ID)))

        lens = _expect(peer.recv(), Admit).prompt_lens
        tables = {req: allocator.allocate(blocks_for(n + steps, config.block_size)) for req, n in lens.items()}
        peer.send(BlockTables(tables))
        first: Dict[int, int] = {}
        digests: Dict[int, str] = {}
        while len(first) < len(tables):
            ready = _expect(peer.recv(), KvReady)
            first[ready.req_id] = ready.token
            digests[ready.req_id] = kv.digest(tables[ready.req_id], lens[ready.req_id])

        order = sorted(tables)
        start = time.perf_counter()
        tokens = generate(model, kv, [first[r] for r in order], [lens[r] for r in order], [tables[r] for r in order],
                          steps, on_step=(lambda done: peer.send(Progress(done))) if progress else None)
        peer.send(Generated(dict(zip(order, tokens)), digests, time.perf_counter() - start))

        _expect(peer.recv(), Stop)
        unlink_clusters(datadist, [PROMPT_CLUSTER_ID])
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


# ------------------------------------------------------------------------ router


class ProgressBar:
    """A one-line text bar on stderr, redrawn in place; silent when disabled."""

    def __init__(self, total: int, enabled: bool, width: int = 32) -> None:
        self.total, self.enabled, self.width, self.done = total, enabled, width, 0
        self._drawn = False

    def advance(self, label: str, n: int = 1) -> None:
        self.done += n
        if self.enabled:
            filled = self.width * self.done // max(self.total, 1)
            sys.stderr.write(f"\r[{'#' * filled}{'.' * (self.width - filled)}] {self.done}/{self.total} {label:<24}")
            sys.stderr.flush()
            self._drawn = True

    def close(self) -> None:
        """End the bar's line (once), so that later output starts on a line of its own."""
        if self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
            self._drawn = False


@dataclasses.dataclass
class RequestStats:
    """What the router saw of one request."""

    prompt_len: int
    first: FirstToken
    ttft_s: float


@dataclasses.dataclass
class RunResult:
    """Outcome of the disaggregated run."""

    path: str
    stats: Dict[int, RequestStats]
    generated: Generated


def make_prompts(config: ModelConfig, requests: int, prompt_len: int, seed: int) -> List[List[int]]:
    """Random prompts of random lengths in ``[prompt_len // 2, prompt_len]``, so most block
    tables end in a partly filled block."""
    rng = random.Random(seed)
    return [[rng.randrange(config.vocab_size) for _ in range(rng.randint(max(1, prompt_len // 2), prompt_len))]
            for _ in range(requests)]


def disaggregate(procs: Launcher, prompts: Sequence[Sequence[int]], bar: ProgressBar) -> RunResult:
    """Route the batch: blocks from the decoder, prefill and push on the prompt, decode."""
    port = _expect(procs.recv("prompt"), Ready).listen_port
    _expect(procs.recv("decoder"), Ready)
    procs.send("decoder", Link(port))
    _expect(procs.recv("decoder"), Linked)

    submitted = time.perf_counter()
    procs.send("decoder", Admit({req: len(p) for req, p in enumerate(prompts)}))
    tables = _expect(procs.recv("decoder"), BlockTables).tables
    for req, tokens in enumerate(prompts):
        procs.send("prompt", Prefill(req, list(tokens), tables[req]))
    stats: Dict[int, RequestStats] = {}
    for _ in prompts:
        first = _expect(procs.recv("prompt"), FirstToken)
        stats[first.req_id] = RequestStats(len(prompts[first.req_id]), first, time.perf_counter() - submitted)
        procs.send("decoder", KvReady(first.req_id, first.token))
        bar.advance(f"prefilled request {first.req_id}")
    while isinstance(message := procs.recv("decoder"), Progress):
        bar.advance(f"decode step {message.steps}")
    bar.close()
    return RunResult(first.path, stats, _expect(message, Generated))


def report(config: ModelConfig, run: RunResult, reference_s: float) -> None:
    """Per-request timings and transfer rates."""
    print(f"link prompt -> decoder: {run.path}")
    print(f"{'request':>7} {'prompt':>6} {'prefill ms':>10} {'KV bytes':>10} {'push ms':>8} {'GB/s':>7} {'TTFT ms':>8}")
    for req, s in sorted(run.stats.items()):
        rate = s.first.kv_bytes / s.first.transfer_s / 1e9 if s.first.transfer_s > 0 else float("inf")
        print(f"{req:>7} {s.prompt_len:>6} {s.first.prefill_s * 1e3:>10.1f} {s.first.kv_bytes:>10} "
              f"{s.first.transfer_s * 1e3:>8.2f} {rate:>7.2f} {s.ttft_s * 1e3:>8.1f}")
    steps = len(next(iter(run.generated.tokens.values()))) - 1
    print(f"decode: {steps} steps x {len(run.stats)} requests in {run.generated.decode_s * 1e3:.1f} ms; "
          f"reference (one process, no transfer) {reference_s:.2f} s")


def compare(reference: Generation, run: RunResult) -> bool:
    """Print every difference from the reference; whether there was none."""
    ok = True
    for req, (want_tokens, want_digest) in enumerate(zip(reference.tokens, reference.kv_digests)):
        got_digest = run.generated.kv_digests.get(req)
        if got_digest != want_digest:
            ok = False
            print(f"request {req}: received prompt KV differs from the reference prefill "
                  f"(sha256 {got_digest} != {want_digest})")
        got_tokens = run.generated.tokens.get(req)
        if got_tokens != want_tokens:
            ok = False
            at = next((i for i, (a, b) in enumerate(zip(got_tokens or [], want_tokens)) if a != b),
                      min(len(got_tokens or []), len(want_tokens)))
            print(f"request {req}: tokens differ from position {at}\n"
                  f"  reference: {want_tokens}\n  decoder:   {got_tokens}")
    return ok


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def positive(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
        return value

    parser.add_argument("--layers", type=positive, default=8, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=positive, default=512,
                        help="hidden size, a multiple of 16: 8 heads sharing 2 KV heads (default 512)")
    parser.add_argument("--requests", type=positive, default=4, help="requests in the batch (default 4)")
    parser.add_argument("--prompt-len", type=positive, default=128,
                        help="longest prompt; lengths are drawn from [half of it, all of it] (default 128)")
    parser.add_argument("--gen-tokens", type=positive, default=16,
                        help="tokens the decoder generates after the first one (default 16)")
    parser.add_argument("--transport", choices=("auto", "shm", "tcp"), default="auto",
                        help="transfer_backend of both engines (default auto: shm on one host)")
    parser.add_argument("--progress", action="store_true", help="draw a progress bar on stderr")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and prompts (default 0)")
    parser.add_argument("--timeout", type=positive, default=120,
                        help="deadline in seconds of every wait on a process (default 120)")
    args = parser.parse_args(argv)
    try:
        args.config = ModelConfig(n_layers=args.layers, hidden=args.hidden)
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    config: ModelConfig = args.config
    prompts = make_prompts(config, args.requests, args.prompt_len, args.seed)
    prompt_blocks = sum(blocks_for(len(p), config.block_size) for p in prompts)
    decoder_blocks = sum(blocks_for(len(p) + args.gen_tokens, config.block_size) for p in prompts)
    print(f"model: {config.n_layers} layers, hidden {config.hidden}, {config.n_heads} heads / {config.n_kv_heads} "
          f"KV heads of {config.head_dim}, {config.num_params / 1e6:.1f} M parameters; KV {config.num_kv_tensors} "
          f"tensors, blocks of {config.block_size} tokens ({config.num_kv_tensors * config.block_bytes} bytes per "
          "block, all layers)")
    print(f"batch: {len(prompts)} prompts of {', '.join(str(len(p)) for p in prompts)} tokens, "
          f"{args.gen_tokens} tokens to generate after the first")
    bar = ProgressBar(len(prompts) + args.gen_tokens, args.progress)
    try:
        with Launcher(args.timeout) as procs:
            procs.start("prompt", prompt_process, config, args.seed, prompt_blocks, args.transport)
            procs.start("decoder", decoder_process, config, args.seed, decoder_blocks, args.gen_tokens,
                        args.transport, args.progress)
            _engine_setup()
            start = time.perf_counter()  # the reference runs while the engine processes start
            reference = reference_generate(config, args.seed, prompts, args.gen_tokens)
            reference_s = time.perf_counter() - start
            run = disaggregate(procs, prompts, bar)
            for name in ("decoder", "prompt"):
                procs.send(name, Stop())
                procs.result(name)
    except ChildFailed as exc:
        bar.close()
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    report(config, run, reference_s)
    if not compare(reference, run):
        print("tokens differ")
        return 1
    print(f"tokens match: {len(prompts)} requests x {args.gen_tokens + 1} tokens identical to the reference, "
          "prompt KV identical byte for byte")
    return 0


if __name__ == "__main__":
    sys.exit(main())
