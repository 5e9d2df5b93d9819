"""Prefill/decode disaggregation of a small Llama-style model over datadist, with an ems
context-caching pool.

Three processes on this host, and a pool daemon of this run's own:

- the prompt engine (``LLMRole.PROMPT``, a link server on 127.0.0.1) takes each request,
  asks the pool for the longest run of its leading 16-token blocks (``exists``, then
  ``load`` in the hash form, keyed by :func:`tiny_llama.prefix_hashes`), prefills only the
  tokens after them, and pushes the request's KV into the decoder's blocks cache with one
  ``transfer_cache_async``: its ``LayerSynchronizer`` is released by the prefill loop as
  each layer finishes, so layer i travels while layer i + 1 computes.  Then it returns the
  first token.  At the end of a wave that another follows, it saves every full block of
  the wave's prompts into the pool (``save``, hash form);
- the decoder engine (``LLMRole.DECODER``) links to the prompt, allocates the blocks each
  request will fill, watches its cache for arrival notices, and for each request waits
  for the notices of its push (``wait_arrival``: the engine's own word that every layer
  landed, and how many bytes) before taking its first token; then it decodes the wave's
  batch greedily from the received KV;
- this process, the router: it starts the pool daemon (``ems-server`` in a temporary
  directory, stopped and removed at the end), hands the requests of two waves to the
  decoder and the prompt, measures time to first token, and runs the same model in one
  process with no transfer and no pool as the reference.

Wave 1 is a batch of prompts that open with one system prompt; the pool starts empty, so
they are prefilled whole.  Wave 2 shares prefixes with wave 1: its even requests follow up
on wave 1's (the same prompt and a new turn), its odd ones ask new questions after the
system prompt, so their leading blocks come from the pool.  The reference reuses those
blocks too, from memory (see :func:`tiny_llama.reference_generate` for why it must), so
every generated token, every byte of each prompt's KV and the number of blocks each
request got from the pool must match it.

Both caches are datadist blocks caches of ``2 * layers`` tensors (K0, V0, K1, V1, ...),
each ``[blocks, 16, kv_heads, head_dim]``, allocated with ``allocate_blocks_cache`` and
used by the model through ``get_cache_tensors``; the prompt registers the same tensors
with the pool (``register_kvcache``): the engine and the pool move the very memory the
model computes in.  Prints "tokens match" and exits 0, or prints the differences and
exits 1; a failing child process prints its traceback and the run exits 1.
"""
from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple, Type, TypeVar

import torch

from _launch import (SYNC_KV_TIMEOUT_MS, ChildFailed, ComputedLayers, Launcher, Peer, finish_task,
                     init_llm_datadist, link_clusters, positive_int as positive, private_pool, unlink_clusters)
from datadist import (BlocksCacheKey, Cache, CacheDesc, CacheManager, DataType, LLMRole, Placement,
                      TransferWithCacheKeyConfig)
from ems import CcConfig_v1, CcKvOption, ContextCaching, Ems, EmsConfig
from tiny_llama import (KV_DTYPE, BlockAllocator, Generation, ModelConfig, PagedKV, TinyLlama, block_slots, blocks_for,
                        generate, prefix_hashes, reference_generate, reusable_blocks)

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
    """Prompt -> router: the request's KV is in the decoder's cache; its first token, and
    what it took: blocks and seconds of the pool load, seconds of the prefill (the push of
    every layer but the last ran alongside), bytes pushed, seconds from the last layer
    computed to the whole push landed, and the bytes of that last layer."""

    req_id: int
    token: int
    pool_blocks: int
    load_s: float
    prefill_s: float
    kv_bytes: int
    push_tail_s: float
    last_layer_bytes: int


@dataclasses.dataclass
class KvReady:
    """Router -> decoder: the request's push is done; decoding continues from ``token``."""

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
class Save:
    """Router -> prompt: save the full blocks of this wave's prompts into the pool, then
    free their blocks."""


@dataclasses.dataclass
class Saved:
    """Prompt -> router: blocks saved (``new`` of them not in the pool before), bytes copied
    into it, and seconds."""

    blocks: int
    new: int
    nbytes: int
    seconds: float


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


class PrefixPool:
    """The prompt engine's side of the ems pool: its paged KV cache registered, each full
    block of a prompt stored under the prompt's prefix hash of that block."""

    def __init__(self, server: str, config: ModelConfig, seed: int, kv: PagedKV) -> None:
        # The model id namespaces the keys: KV of another model (or other weights) never matches.
        model_id = f"tiny-llama-{config.n_layers}x{config.hidden}-seed{seed}"
        Ems.init(EmsConfig(cc_config=CcConfig_v1(rank_id=0, device_id=0, model_id=model_id, kvcache_type="GQA"),
                           server=server))
        cc: Optional[ContextCaching] = Ems.get_cc()
        if cc is None:
            raise RuntimeError("Ems.init returned without a ContextCaching")
        cc.register_kvcache([[kv.tensors[2 * i], kv.tensors[2 * i + 1]] for i in range(config.n_layers)])
        self.cc = cc
        self.block_size = config.block_size
        self.block_bytes = config.num_kv_tensors * config.block_bytes
        self.option = CcKvOption(timeout=SYNC_KV_TIMEOUT_MS)
        self._saved: Set[int] = set()  # hashes this process saved: the pool holds them

    def load_prefix(self, tokens: Sequence[int], table: Sequence[int]) -> int:
        """Load the longest run of ``tokens``' leading full blocks the pool holds into the
        first blocks of ``table`` (keeping the last token to compute); how many it loaded."""
        hashes = prefix_hashes(tokens, self.block_size)[:reusable_blocks(len(tokens), self.block_size)]
        hits = self.cc.exists(hashes, self.option).success if hashes else 0
        if not hits:
            return 0
        loaded = self.cc.load(block_slots(table[:hits], self.block_size), hashes[:hits], [self.block_size] * hits,
                              self.option)
        return loaded.success

    def save(self, jobs: Sequence["PrefillJob"]) -> Saved:
        """Save every full block of each job's prompt, in order (a block the pool holds
        already is skipped: the first one saved stays)."""
        blocks = new = 0
        start = time.perf_counter()
        for job in jobs:
            hashes = prefix_hashes(job.tokens, self.block_size)
            if not hashes:
                continue
            result = self.cc.save(block_slots(job.src_blocks[:len(hashes)], self.block_size), hashes,
                                  [self.block_size] * len(hashes), self.option)
            if result.success != len(hashes):
                raise RuntimeError(f"request {job.req_id}: the pool stored {result.success} of {len(hashes)} blocks")
            blocks += len(hashes)
            new += len(set(hashes) - self._saved)
            self._saved.update(hashes)
        return Saved(blocks, new, new * self.block_bytes, time.perf_counter() - start)


@dataclasses.dataclass
class PrefillJob:
    """A request on the prompt engine: its blocks here and their destination blocks."""

    req_id: int
    tokens: List[int]
    src_blocks: List[int]
    dst_blocks: List[int]


def prefill_and_push(cache_manager: CacheManager, cache: Cache, model: TinyLlama, kv: PagedKV, pool: PrefixPool,
                     job: PrefillJob) -> FirstToken:
    """Load the job's cached prefix from the pool, prefill the rest and push every block of
    the prompt into the decoder's cache, each layer as soon as the prefill computed it."""
    config = model.config
    start = time.perf_counter()
    hits = pool.load_prefix(job.tokens, job.src_blocks)
    loaded = time.perf_counter()

    synchronizer = ComputedLayers(config.n_layers)
    layers = range(0, config.n_layers)
    task = cache_manager.transfer_cache_async(
        cache, synchronizer, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID), layers, layers)],
        job.src_blocks, job.dst_blocks[:len(job.src_blocks)])
    skip = hits * config.block_size
    try:
        logits = model.prefill(job.tokens[skip:], job.src_blocks, kv, start=skip, on_layer=synchronizer.computed)
    except BaseException:
        synchronizer.abandon()
        raise
    computed = time.perf_counter()
    finish_task(task, SYNC_KV_TIMEOUT_MS)
    layer_bytes = 2 * len(job.src_blocks) * config.block_bytes
    return FirstToken(job.req_id, int(logits.argmax()), hits, loaded - start, computed - loaded,
                      config.n_layers * layer_bytes, time.perf_counter() - computed, layer_bytes)


def prompt_process(peer: Peer, config: ModelConfig, seed: int, num_blocks: int, transport: str, server: str) -> None:
    """The prompt engine: prefill each request from what the pool holds, sending every layer
    as it finishes; save a wave's prompts into the pool when told."""
    _engine_setup()
    datadist = init_llm_datadist(LLMRole.PROMPT, PROMPT_CLUSTER_ID, transport, listen=True,
                                 pool_bytes=_pool_bytes(config, num_blocks))
    try:
        cache_manager = datadist.cache_manager
        cache, kv = _kv_cache(cache_manager, config, num_blocks, None)
        model = TinyLlama(config, seed)
        pool = PrefixPool(server, config, seed, kv)
        allocator = BlockAllocator(num_blocks)
        peer.send(Ready(datadist.listen_port))
        wave: List[PrefillJob] = []  # prefilled since the last save; their blocks stay until saved
        while not isinstance(message := peer.recv(), Stop):
            if isinstance(message, Save):
                peer.send(pool.save(wave))
                for job in wave:
                    allocator.free(job.src_blocks)
                wave.clear()
                continue
            request = _expect(message, Prefill)
            job = PrefillJob(request.req_id, request.tokens,
                             allocator.allocate(blocks_for(len(request.tokens), config.block_size)),
                             request.dst_blocks)
            peer.send(prefill_and_push(cache_manager, cache, model, kv, pool, job))
            wave.append(job)
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


# ------------------------------------------------------------------------ decoder side


def decoder_process(peer: Peer, config: ModelConfig, seed: int, num_blocks: int, steps: int, transport: str,
                    progress: bool) -> None:
    """The decoder engine, wave after wave: reserve blocks, wait for every request's KV,
    decode the batch, free the blocks."""
    _engine_setup()
    datadist = init_llm_datadist(LLMRole.DECODER, DECODER_CLUSTER_ID, transport,
                                 pool_bytes=_pool_bytes(config, num_blocks))
    try:
        cache_manager = datadist.cache_manager
        cache, kv = _kv_cache(cache_manager, config, num_blocks, BlocksCacheKey(DECODER_CLUSTER_ID, MODEL_ID))
        cache_manager.watch_arrivals(cache)  # before any push: every push into it leaves a notice
        model = TinyLlama(config, seed)
        allocator = BlockAllocator(num_blocks)
        peer.send(Ready(None))
        link_clusters(datadist, {PROMPT_CLUSTER_ID: _expect(peer.recv(), Link).port})
        peer.send(Linked(datadist.link_path(PROMPT_CLUSTER_ID)))

        while not isinstance(message := peer.recv(), Stop):
            lens = _expect(message, Admit).prompt_lens
            tables = {req: allocator.allocate(blocks_for(n + steps, config.block_size)) for req, n in lens.items()}
            peer.send(BlockTables(tables))
            first: Dict[int, int] = {}
            digests: Dict[int, str] = {}
            while len(first) < len(tables):
                ready = _expect(peer.recv(), KvReady)
                # The prompt pushes one request at a time, in the order the router forwards
                # them: the oldest unconsumed notices, one per layer, are this request's.
                notices = cache_manager.wait_arrival(cache, timeout_in_millis=SYNC_KV_TIMEOUT_MS,
                                                     src_cluster_id=PROMPT_CLUSTER_ID)
                landed = sum(notice.nbytes for notice in notices)
                want = blocks_for(lens[ready.req_id], config.block_size) * config.num_kv_tensors * config.block_bytes
                if landed != want:
                    raise RuntimeError(f"request {ready.req_id}: arrival notices report {landed} bytes, "
                                       f"its prompt's blocks hold {want}")
                first[ready.req_id] = ready.token
                digests[ready.req_id] = kv.digest(tables[ready.req_id], lens[ready.req_id])

            order = sorted(tables)
            start = time.perf_counter()
            tokens = generate(model, kv, [first[r] for r in order], [lens[r] for r in order],
                              [tables[r] for r in order], steps,
                              on_step=(lambda done: peer.send(Progress(done))) if progress else None)
            peer.send(Generated(dict(zip(order, tokens)), digests, time.perf_counter() - start))
            for table in tables.values():
                allocator.free(table)

        unlink_clusters(datadist, [PROMPT_CLUSTER_ID])
        cache_manager.deallocate_blocks_cache(cache)
    finally:
        datadist.finalize()


# ------------------------------------------------------------------------ router


class ProgressBar:
    """Progress on stderr when enabled: tqdm's bar where tqdm is installed (extra
    ``[progress]``), else one plain line per step."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self._bar = tqdm(total=total, file=sys.stderr, leave=False, dynamic_ncols=True)

    def advance(self, label: str, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.set_description_str(label, refresh=False)
            self._bar.update(n)
        elif self.enabled:
            print(f"{self.done}/{self.total} {label}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Take the bar off the screen, so that later output starts on a line of its own."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


@dataclasses.dataclass
class RequestStats:
    """What the router saw of one request."""

    prompt_len: int
    first: FirstToken
    ttft_s: float    # this request's own: from when the prompt engine could start on it
    since_wave_s: float  # from the wave's submission (includes waiting behind earlier requests)


@dataclasses.dataclass
class WaveResult:
    """Outcome of one wave: per request (by req id), and the pool save after it, if any."""

    stats: Dict[int, RequestStats]
    generated: Generated
    saved: Optional[Saved]


@dataclasses.dataclass
class RunResult:
    """Outcome of the disaggregated run."""

    path: str
    waves: List[WaveResult]


def make_waves(config: ModelConfig, requests: int, prompt_len: int, seed: int) -> List[List[List[int]]]:
    """Two waves of ``requests`` random prompts sharing prefixes.

    Every prompt of wave 1 is the system prompt (the whole blocks that fit in a quarter of
    ``prompt_len``, at least one) and a question, ``[prompt_len // 2 + 1, prompt_len]``
    tokens in all, so most block tables end in a partly filled block.  In wave 2, request i
    follows up on wave 1's request i (its prompt and a new turn of up to ``prompt_len // 2``
    tokens) when i is even, and is a new question after the system prompt when i is odd."""
    rng = random.Random(seed)

    def tokens(n: int) -> List[int]:
        return [rng.randrange(config.vocab_size) for _ in range(n)]

    bs = config.block_size
    system = tokens(max(bs, prompt_len // 4 // bs * bs))

    def question() -> List[int]:
        return system + tokens(rng.randint(prompt_len // 2 + 1, prompt_len) - len(system))

    first = [question() for _ in range(requests)]
    second = [first[i] + tokens(rng.randint(1, prompt_len // 2)) if i % 2 == 0 else question()
              for i in range(requests)]
    return [first, second]


def run_wave(procs: Launcher, first_id: int, prompts: Sequence[Sequence[int]], bar: ProgressBar) -> Tuple[
        Dict[int, RequestStats], Generated]:
    """Route one wave (req ids from ``first_id``): blocks from the decoder, prefill and push
    on the prompt, decode."""
    ids = range(first_id, first_id + len(prompts))
    submitted = time.perf_counter()
    procs.send("decoder", Admit({req: len(p) for req, p in zip(ids, prompts)}))
    tables = _expect(procs.recv("decoder"), BlockTables).tables
    for req, tokens in zip(ids, prompts):
        procs.send("prompt", Prefill(req, list(tokens), tables[req]))
    stats: Dict[int, RequestStats] = {}
    free_at = submitted  # the prompt engine serves one request at a time
    for _ in prompts:
        first = _expect(procs.recv("prompt"), FirstToken)
        now = time.perf_counter()
        stats[first.req_id] = RequestStats(len(prompts[first.req_id - first_id]), first, now - free_at,
                                           now - submitted)
        free_at = now
        procs.send("decoder", KvReady(first.req_id, first.token))
        bar.advance(f"prefilled request {first.req_id}")
    while isinstance(message := procs.recv("decoder"), Progress):
        bar.advance(f"decode step {message.steps}")
    return stats, _expect(message, Generated)


def disaggregate(procs: Launcher, waves: Sequence[Sequence[Sequence[int]]], bar: ProgressBar) -> RunResult:
    """Link the engines, then route each wave, saving it into the pool when another follows."""
    port = _expect(procs.recv("prompt"), Ready).listen_port
    _expect(procs.recv("decoder"), Ready)
    procs.send("decoder", Link(port))
    path = _expect(procs.recv("decoder"), Linked).path
    results: List[WaveResult] = []
    first_id = 0
    for index, prompts in enumerate(waves):
        stats, generated = run_wave(procs, first_id, prompts, bar)
        saved = None
        if index + 1 < len(waves):
            procs.send("prompt", Save())
            saved = _expect(procs.recv("prompt"), Saved)
        results.append(WaveResult(stats, generated, saved))
        first_id += len(prompts)
    bar.close()
    return RunResult(path, results)


def report(run: RunResult, block_size: int, reference_s: float) -> None:
    """Per-request timings, pool hits and transfer rates, wave by wave."""
    print(f"link prompt -> decoder: {run.path}")
    for index, wave in enumerate(run.waves):
        print(f"wave {index + 1}:")
        print(f"{'request':>7} {'prompt':>6} {'pool hits':>9} {'load ms':>7} {'computed':>8} {'prefill ms':>10} "
              f"{'KV bytes':>9} {'push ms':>7} {'GB/s':>6} {'TTFT ms':>8} {'+queue ms':>9}")
        for req, s in sorted(wave.stats.items()):
            f = s.first
            computed = s.prompt_len - f.pool_blocks * block_size
            rate = f.last_layer_bytes / f.push_tail_s / 1e9 if f.push_tail_s > 0 else float("inf")
            print(f"{req:>7} {s.prompt_len:>6} {f.pool_blocks:>9} {f.load_s * 1e3:>7.2f} {computed:>8} "
                  f"{f.prefill_s * 1e3:>10.1f} {f.kv_bytes:>9} {f.push_tail_s * 1e3:>7.2f} {rate:>6.3f} "
                  f"{s.ttft_s * 1e3:>8.1f} {s.since_wave_s * 1e3:>9.1f}")
        steps = len(next(iter(wave.generated.tokens.values()))) - 1
        print(f"decode: {steps} steps x {len(wave.stats)} requests in {wave.generated.decode_s * 1e3:.1f} ms")
        if wave.saved is not None:
            saved = wave.saved
            print(f"pool: saved {saved.blocks} full blocks of wave {index + 1} ({saved.new} new, "
                  f"{saved.nbytes} bytes copied) in {saved.seconds * 1e3:.1f} ms")
    print("push ms: from the prefill's last layer to the whole push landed (earlier layers went while later ones "
          "computed); GB/s: that last layer's bytes over it")
    print(f"reference (one process, no transfer, no pool): {reference_s:.2f} s")


def compare(reference: Sequence[Generation], run: RunResult) -> bool:
    """Print every difference from the reference; whether there was none."""
    ok = True
    req = 0
    for want_wave, wave in zip(reference, run.waves):
        for want_tokens, want_digest, want_reused in zip(want_wave.tokens, want_wave.kv_digests,
                                                         want_wave.reused_blocks):
            stats = wave.stats.get(req)
            got_reused = stats.first.pool_blocks if stats else None
            if got_reused != want_reused:
                ok = False
                print(f"request {req}: {got_reused} leading blocks came from the pool, the reference reused "
                      f"{want_reused}")
            got_digest = wave.generated.kv_digests.get(req)
            if got_digest != want_digest:
                ok = False
                print(f"request {req}: received prompt KV differs from the reference prefill "
                      f"(sha256 {got_digest} != {want_digest})")
            got_tokens = wave.generated.tokens.get(req)
            if got_tokens != want_tokens:
                ok = False
                at = next((i for i, (a, b) in enumerate(zip(got_tokens or [], want_tokens)) if a != b),
                          min(len(got_tokens or []), len(want_tokens)))
                print(f"request {req}: tokens differ from position {at}\n"
                      f"  reference: {want_tokens}\n  decoder:   {got_tokens}")
            req += 1
    return ok


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=positive, default=8, help="decoder layers (default 8)")
    parser.add_argument("--hidden", type=positive, default=512,
                        help="hidden size, a multiple of 16: 8 heads sharing 2 KV heads (default 512)")
    parser.add_argument("--requests", type=positive, default=4, help="requests in each of the two waves (default 4)")
    parser.add_argument("--prompt-len", type=positive, default=128,
                        help="longest wave-1 prompt, at least 32; the system prompt every request opens with is "
                             "a quarter of it in whole blocks, at least one (default 128)")
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
    if args.prompt_len < 2 * args.config.block_size:
        parser.error(f"--prompt-len must be at least {2 * args.config.block_size}: every prompt is the system "
                     "prompt, a block or more, and a question")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    config: ModelConfig = args.config
    bs = config.block_size
    waves = make_waves(config, args.requests, args.prompt_len, args.seed)
    prompt_blocks = max(sum(blocks_for(len(p), bs) for p in wave) for wave in waves)
    decoder_blocks = max(sum(blocks_for(len(p) + args.gen_tokens, bs) for p in wave) for wave in waves)
    block_bytes = config.num_kv_tensors * config.block_bytes
    # Room for every full block of every wave twice over: nothing saved is evicted before it is loaded.
    pool_capacity = max(64 << 20, 2 * block_bytes * sum(len(p) // bs for wave in waves for p in wave))
    print(f"model: {config.n_layers} layers, hidden {config.hidden}, {config.n_heads} heads / {config.n_kv_heads} "
          f"KV heads of {config.head_dim}, {config.num_params / 1e6:.1f} M parameters; KV {config.num_kv_tensors} "
          f"tensors, blocks of {bs} tokens ({block_bytes} bytes per block, all layers)")
    for index, wave in enumerate(waves):
        print(f"wave {index + 1}: {len(wave)} prompts of {', '.join(str(len(p)) for p in wave)} tokens, "
              f"{args.gen_tokens} tokens to generate after the first")
    bar = ProgressBar(sum(len(wave) + args.gen_tokens for wave in waves), args.progress)
    try:
        with private_pool(pool_capacity, args.timeout) as server:
            print(f"pool: ems-server in {server}, {pool_capacity >> 20} MiB, keys: prefix hashes of {bs}-token blocks")
            with Launcher(args.timeout) as procs:
                procs.start("prompt", prompt_process, config, args.seed, prompt_blocks, args.transport, server)
                procs.start("decoder", decoder_process, config, args.seed, decoder_blocks, args.gen_tokens,
                            args.transport, args.progress)
                _engine_setup()
                start = time.perf_counter()  # the reference runs while the engine processes start
                reference = reference_generate(config, args.seed, waves, args.gen_tokens)
                reference_s = time.perf_counter() - start
                run = disaggregate(procs, waves, bar)
                for name in ("decoder", "prompt"):
                    procs.send(name, Stop())
                    procs.result(name)
    except ChildFailed as exc:
        bar.close()
        print(f"FAILED: {exc}", file=sys.stderr)
        return 1
    report(run, bs, reference_s)
    if not compare(reference, run):
        print("tokens differ")
        return 1
    hits = sum(s.first.pool_blocks for s in run.waves[-1].stats.values())
    blocks = sum(blocks_for(len(p), bs) for p in waves[-1])
    print(f"tokens match: {len(waves)} waves x {args.requests} requests x {args.gen_tokens + 1} tokens identical to "
          f"the reference, prompt KV identical byte for byte; wave {len(waves)} loaded {hits} of its {blocks} prompt "
          "blocks from the pool")
    return 0


if __name__ == "__main__":
    sys.exit(main())
