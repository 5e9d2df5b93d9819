"""Layer-wise asynchronous pushes: ``CacheManager.transfer_cache_async`` (SPEC section 5, "Async.").

A prefill loop computes its layers one after another; a task sends each layer as soon as the
caller's :class:`LayerSynchronizer` reports it computed, so sending layer i overlaps computing
layer i+1.  A layer is 2 consecutive tensors (K, V), as in CANN, where this call has no
``tensor_num_per_layer``.

Threads of one task (daemon threads; all end with the task):

* the *coordinator* calls ``synchronize_layer(i, None)`` for each source layer that some
  config sends, in ascending order, as CANN does (no timeout: it waits as long as the
  caller's synchronizer takes), turns the answer into a verdict (send it;
  ``LLM_PARAM_INVALID`` for False; the status of what the synchronizer raised, e.g.
  ``LLM_TIMEOUT`` for a ``TimeoutError``) and hands the layer with its verdict to the
  worker of every destination link;
* one *link worker* per destination link sends the layer to each of that link's configs
  that contains it (``Link.transfer``: its own ``sync_kv_timeout`` deadline per send).
  Workers of different links run at the same time, so several decoders receive a layer
  concurrently, and a slow or dead one delays no other.

A synchronizer that never answers leaves its configs running: ``CacheTask.synchronize`` /
``get_results`` report ``LLM_TIMEOUT`` for them after the timeout they are given, and the
task's threads wait on.  Nothing joins them, so neither ``finalize`` nor interpreter exit
waits for such a task; a layer answered after ``finalize`` fails its configs with
``LLM_ENGINE_FINALIZED`` when its worker looks at the source cache.  A config fails at its
first failed layer (its later layers are not sent) and never stops the other configs.  Each
config's result is a ``concurrent.futures.Future`` resolved to an :class:`LLMStatusCode`
once final; :class:`CacheTask` waits on those futures.

Destinations.  A :class:`TransferWithCacheKeyConfig` names a peer cache by key, like
``push_blocks``/``push_cache``.  A :class:`TransferConfig` gives raw peer addresses, one per
destination tensor; they reach the transports as a ``RemoteCache`` whose ``cache_id`` is
``ANY_CACHE``: a socket peer accepts them only inside one of its caches, and a same-host link
copies them directly only where they lie in the peer's mapped pool arenas (elsewhere they go
over the socket and the peer checks them).

Block mapping (the task's ``src_block_indices``/``dst_block_indices``): a blocks source sends
block ``src_block_indices[j]`` to destination block ``dst_block_indices[j]`` (neither given:
every block i to block i, the whole cache, as CANN does); a contiguous
source sends row ``src_batch_index`` of each config, whole into a contiguous destination row,
or cut in destination blocks (chunk j -> ``dst_block_indices[j]``).  A blocks source into a
contiguous destination is rejected, as in CANN.

The source cache must stay allocated until the task is done; a layer sent after it was freed
fails its configs with ``LLM_KV_CACHE_NOT_EXIST``.
"""
from __future__ import annotations

import abc
import dataclasses
import functools
import logging
import queue
import threading
from concurrent.futures import Future, wait
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import numpy as np
from numpy.typing import NDArray

from ._planning import cache_ref
from .engine.planning import (BlockList, Side, block_list_arg, blocks_plan, int_arg, layer_range_arg,
                              row_blocks_plan, row_plan, row_size_arg)
from ._status import LLMStatusCode, api_class, raise_error, status_of
from ._transfer_configs import TransferConfig, TransferWithCacheKeyConfig, check_push_ranges
from .engine.keys import CacheRef
from .engine.layout import Plan
from .engine.link import Link
from .engine.transports.base import ANY_CACHE, Prepared, RemoteCache

__all__ = ["LayerSynchronizer", "TransferConfig", "TransferWithCacheKeyConfig", "CacheTask"]

log = logging.getLogger("datadist")

_S = LLMStatusCode
#: What a task's transfers count as (datadist.engine.metrics).
_OP = "transfer_cache_async"
#: Tensors per layer (K, V): transfer_cache_async takes no tensor_num_per_layer.
_TNPL = 2
#: Destination block indices of raw addresses have no known upper bound.
_ANY_BLOCK = 2**62
#: The one destination layer of a raw-address description (it holds one layer's tensors).
_FIRST_LAYER = range(0, 1)
#: What the coordinator hands a link worker: a layer with its verdict, or None (no more).
_Inbox = queue.SimpleQueue[Optional[Tuple[int, LLMStatusCode]]]
#: Block indices, checked.
_Blocks = NDArray[np.integer]


# ------------------------------------------------------------------------ public objects


class LayerSynchronizer(abc.ABC):
    """Tells a ``transfer_cache_async`` task when a layer of the source cache is computed.

    The task calls :meth:`synchronize_layer` from a thread of its own, once per layer that
    some config sends, in ascending layer order.
    """

    @abc.abstractmethod
    def synchronize_layer(self, layer_index: int, timeout_in_millis: Optional[int]) -> bool:
        """Wait until layer ``layer_index`` of the source cache holds its final bytes, then
        return True; return False if it never will (the configs that send the layer fail with
        ``LLM_PARAM_INVALID``).  ``transfer_cache_async`` passes ``timeout_in_millis=None``
        (no timeout), as CANN does, and waits as long as this takes; an exception fails the
        configs that send the layer with its status (``LLM_TIMEOUT`` for ``TimeoutError``)."""


@api_class
class CacheTask:
    """A running ``transfer_cache_async``: one result per transfer config, in config order.

    A config's result is final once all its layers are sent (``LLM_SUCCESS``) or one failed
    (that layer's status).  Made by the cache manager, never by users.
    """

    def __init__(self, results: Sequence["Future[LLMStatusCode]"]) -> None:
        self._results = list(results)

    def synchronize(self, timeout_in_millis: Optional[int] = None) -> LLMStatusCode:
        """Wait up to ``timeout_in_millis`` (None: until done) for every config.

        Returns ``LLM_TIMEOUT`` if some config is still running then, else ``LLM_SUCCESS`` if
        all succeeded, else the status of the first failed config.  Raises ``TypeError`` for a
        non-int timeout and :class:`ParamInvalidError` for a negative one."""
        if not self._wait(timeout_in_millis):
            return _S.LLM_TIMEOUT
        for result in self._results:
            code = result.result()
            if code != _S.LLM_SUCCESS:
                return code
        return _S.LLM_SUCCESS

    def get_results(self, timeout_in_millis: Optional[int] = None) -> List[LLMStatusCode]:
        """Wait as :meth:`synchronize` does, then return one status per config: the final
        one, or ``LLM_TIMEOUT`` for a config still running."""
        self._wait(timeout_in_millis)
        return [r.result() if r.done() else _S.LLM_TIMEOUT for r in self._results]

    def _wait(self, timeout_in_millis: Optional[int]) -> bool:
        timeout = None
        if timeout_in_millis is not None:
            ms = int_arg("timeout_in_millis", timeout_in_millis)
            if ms < 0:
                raise_error(_S.LLM_PARAM_INVALID, f"timeout_in_millis = {ms} must be >= 0 or None")
            timeout = ms / 1000.0
        _, running = wait(self._results, timeout=timeout)
        return not running


# ------------------------------------------------------------------------ validation


class _Source:
    """The source cache and the block mapping that every config of a task shares."""

    __slots__ = ("side", "is_blocks", "src_blocks", "dst_blocks", "block_size", "num_layers")

    def __init__(self, side: Side, is_blocks: bool, src_block_indices: Optional[BlockList],
                 dst_block_indices: Optional[BlockList], dst_block_memory_size: Optional[int]) -> None:
        if side.num_tensors % _TNPL:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"src_cache has {side.num_tensors} tensors; transfer_cache_async sends layers of "
                        f"{_TNPL} tensors (K, V)")
        size = _block_memory_size_arg(dst_block_memory_size)
        sb = None if src_block_indices is None else block_list_arg("src_block_indices", src_block_indices, side.batch_size)
        db = None if dst_block_indices is None else block_list_arg("dst_block_indices", dst_block_indices, _ANY_BLOCK)
        if is_blocks:
            sb, db = _block_mapping(side, sb, db, src_block_indices, dst_block_indices)
            size = _whole_blocks(side, size)
        else:
            _check_row_source(side, sb, db, size, src_block_indices)
        self.side, self.is_blocks, self.src_blocks, self.dst_blocks = side, is_blocks, sb, db
        self.block_size: Optional[int] = size  # of a destination block, where known before any lookup
        self.num_layers = side.num_tensors // _TNPL

    def plan(self, row: int, remote: RemoteCache, src_layers: range, dst_layers: range) -> Plan:
        """Plan source layers ``src_layers`` (row ``row`` of a contiguous source) into
        ``dst_layers`` of ``remote``; raises ``LLM_PARAM_INVALID`` if they do not fit."""
        dst = Side.of_remote(remote)
        if self.dst_blocks is None:
            if remote.is_blocks:
                raise_error(_S.LLM_PARAM_INVALID,
                            f"cache {remote.cache_id} is a blocks cache: give dst_block_indices")
            return row_plan(self.side, row, dst, remote.row, row_size_arg(-1, self.side, dst), 0, _TNPL,
                             src_layers, dst_layers)
        if not remote.is_blocks:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"dst_block_indices given, but cache {remote.cache_id} is not a blocks cache")
        if self.block_size is not None and self.block_size != dst.stride:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"cache {remote.cache_id} has {dst.stride}-byte blocks, the transfer {self.block_size}")
        if self.src_blocks is not None:  # a blocks source (which always has its block list)
            return blocks_plan(self.side, dst, self.src_blocks, self.dst_blocks, _TNPL, src_layers, dst_layers)
        return row_blocks_plan(self.side, row, dst, self.dst_blocks, _TNPL, src_layers, dst_layers)


def _block_memory_size_arg(value: Optional[int]) -> Optional[int]:
    """``dst_block_memory_size`` checked; None where not given (None or 0, as in CANN)."""
    size = None if value is None else int_arg("dst_block_memory_size", value)
    if size is not None and size < 0:
        raise_error(_S.LLM_PARAM_INVALID, f"dst_block_memory_size = {size} must be >= 0 (0: not given)")
    return size or None


def _block_mapping(side: Side, sb: Optional[_Blocks], db: Optional[_Blocks], src_block_indices: object,
                   dst_block_indices: object) -> Tuple[_Blocks, _Blocks]:
    """The blocks of a blocks source and where they go: both lists given, or neither (CANN:
    the whole blocks cache, block i -> block i)."""
    if sb is None and db is None:
        sb = db = np.arange(side.batch_size, dtype=np.int64)
    if sb is None or db is None:
        raise_error(_S.LLM_PARAM_INVALID,
                    "src_cache is a blocks cache: give both src_block_indices and dst_block_indices, "
                    f"or neither (the whole cache); got {src_block_indices!r:.60} and "
                    f"{dst_block_indices!r:.60}")
    if sb.shape != db.shape:
        raise_error(_S.LLM_PARAM_INVALID, f"src_block_indices has {sb.shape[0]} entries, "
                                          f"dst_block_indices {db.shape[0]}; they must be equal")
    return sb, db


def _whole_blocks(side: Side, size: Optional[int]) -> int:
    """The destination block size of a blocks source: its own (blocks are sent whole)."""
    if size is not None and size != side.stride:
        raise_error(_S.LLM_PARAM_INVALID,
                    f"dst_block_memory_size = {size} differs from the source's {side.stride}-byte blocks; "
                    "blocks are sent whole")
    return side.stride


def _check_row_source(side: Side, sb: Optional[_Blocks], db: Optional[_Blocks], size: Optional[int],
                      src_block_indices: object) -> None:
    """A contiguous source has no source blocks, and its row holds the destination blocks."""
    if sb is not None:
        raise_error(_S.LLM_PARAM_INVALID,
                    f"src_block_indices = {src_block_indices!r:.60} given, but src_cache is not a blocks cache")
    if db is not None and size is not None and db.shape[0] * size > side.stride:
        raise_error(_S.LLM_PARAM_INVALID,
                    f"{db.shape[0]} destination blocks of dst_block_memory_size = {size} bytes exceed "
                    f"the source row of {side.stride} bytes")


class _Route:
    """One transfer config, validated: its link, its source layers and how a layer is sent."""

    def __init__(self, index: int, config: object, src: _Source, get_link: Callable[[int], Link]) -> None:
        name = f"transfer_configs[{index}]"
        if not isinstance(config, (TransferConfig, TransferWithCacheKeyConfig)):
            raise TypeError(f"{name} must be a TransferConfig or TransferWithCacheKeyConfig, "
                            f"got {type(config).__name__}")
        self.index = index
        self.layers = layer_range_arg(f"{name}.src_layer_range", config.src_layer_range, src.num_layers)
        self.row = config.src_batch_index
        if src.is_blocks and self.row:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"{name}.src_batch_index = {self.row}, but src_cache is a blocks cache: it must be 0")
        if not src.is_blocks and self.row >= src.side.batch_size:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"{name}.src_batch_index = {self.row} outside [0, {src.side.batch_size})")
        #: The peer cache by key, or raw peer addresses described as a cache.
        self.target: Union[CacheRef, RemoteCache]
        if isinstance(config, TransferWithCacheKeyConfig):
            check_push_ranges(name, config, self.layers)
            self.target = cache_ref(config.cache_key)
            cluster = config.cache_key.cluster_id
        else:
            self.target = self._describe_raw(name, config, src)
            cluster = config.dst_cluster_id
        self.link = get_link(cluster)
        self.result: "Future[LLMStatusCode]" = Future()
        #: Layers looked up and planned ahead (:meth:`prepare_next`), each used once.
        self._prepared: Dict[int, Prepared] = {}
        self._ahead = iter(self.layers)

    def _describe_raw(self, name: str, config: TransferConfig, src: _Source) -> RemoteCache:
        """Raw destination addresses described as a peer cache of all the layers sent: each
        tensor one source row long, or reaching to the highest destination block."""
        need = _TNPL * len(self.layers)
        if len(config.dst_addrs) != need:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"{name}.dst_addrs has {len(config.dst_addrs)} addresses; {len(self.layers)} layers "
                        f"need {need} (one per destination tensor)")
        if src.dst_blocks is None:
            tensor_size, batch_size = src.side.stride, 1
        elif src.block_size is None:
            raise_error(_S.LLM_PARAM_INVALID,
                        f"{name} sends a row into destination blocks at raw addresses: give dst_block_memory_size")
        else:
            batch_size = int(src.dst_blocks.max()) + 1 if src.dst_blocks.shape[0] else 1
            tensor_size = batch_size * src.block_size
        return RemoteCache(cache_id=ANY_CACHE, row=0, num_tensors=need, tensor_size=tensor_size,
                           batch_size=batch_size, is_blocks=src.dst_blocks is not None, dtype="",
                           addrs=np.asarray(config.dst_addrs, dtype=np.uint64), epoch=0)

    def _layer(self, src: _Source, layer: int) -> Tuple[Union[CacheRef, RemoteCache], Callable[[RemoteCache], Plan]]:
        """What layer ``layer`` is sent to, and its planner."""
        src_layers = range(layer, layer + 1)
        target, dst_layers = self.target, src_layers
        if isinstance(target, RemoteCache):
            # Describe only this layer's two tensors: the shm path then needs just them to
            # lie in one mapped arena.
            k = (layer - self.layers.start) * _TNPL
            target = dataclasses.replace(target, num_tensors=_TNPL, addrs=target.addrs[k:k + _TNPL])
            dst_layers = _FIRST_LAYER
        return target, functools.partial(src.plan, self.row, src_layers=src_layers, dst_layers=dst_layers)

    def prepare_next(self, src: _Source) -> bool:
        """Look up and plan the next layer not yet prepared, so that sending it is only
        its copy; False when there is none left.  A layer that cannot be prepared is
        left to :meth:`send`, which reports its error when the layer's turn comes."""
        layer = next(self._ahead, None)
        if layer is None:
            return False
        try:
            self._prepared[layer] = self.link.prepare(*self._layer(src, layer), push=True)
        except Exception:  # reported by send, at that layer
            self._ahead = iter(())
            return False
        return True

    def send(self, src: _Source, layers: List[int]) -> None:
        """Send source ``layers`` to this config's destination (raises on failure): several
        layers to one peer cache go as one batch (over a socket, one round trip)."""
        if len(layers) > 1 and isinstance(self.target, CacheRef):
            self.link.transfer_batch(self.target, [self._layer(src, layer)[1] for layer in layers], True,
                                     [self._prepared.pop(layer, None) for layer in layers], op=_OP)
            return
        for layer in layers:
            target, planner = self._layer(src, layer)
            self.link.transfer(target, planner, True, self._prepared.pop(layer, None), op=_OP)


# ------------------------------------------------------------------------ the task


class _Task:
    """The threads of one task; see the module docstring."""

    def __init__(self, routes: List[_Route], synchronizer: LayerSynchronizer, src: _Source,
                 check_src: Callable[[], object]) -> None:
        self._sync = synchronizer
        self._src = src
        self._check_src = check_src
        self._routes = routes
        self._layers = sorted(set().union(*(r.layers for r in routes)))
        by_cluster: Dict[int, List[_Route]] = {}
        for r in routes:
            by_cluster.setdefault(r.link.remote_cluster_id, []).append(r)
        self._inboxes: List[Tuple[_Inbox, List[_Route]]] = [(queue.SimpleQueue(), group)
                                                             for group in by_cluster.values()]

    def start(self) -> None:
        """Start the threads: workers first, so every layer handed out has a taker."""
        threads = [threading.Thread(target=self._send, args=(inbox, group), daemon=True,
                                    name=f"datadist-async-link-{group[0].link.remote_cluster_id}")
                   for inbox, group in self._inboxes]
        threads.append(threading.Thread(target=self._coordinate, daemon=True, name="datadist-async-coordinator"))
        started = 0
        try:
            for t in threads:
                t.start()
                started += 1
        except RuntimeError as exc:  # the process is out of threads (the coordinator, last, did not start)
            for inbox, _ in self._inboxes:
                inbox.put(None)  # started workers leave, failing their configs
            raise_error(_S.LLM_FAILED, f"transfer_cache_async could not start its threads "
                                       f"({started} of {len(threads)} started): {exc}")

    def _verdict(self, layer: int) -> LLMStatusCode:
        """Ask the synchronizer about ``layer`` (no timeout, as CANN: it takes as long as it
        takes) and say whether the layer may be sent."""
        try:
            if self._sync.synchronize_layer(layer, None):
                return _S.LLM_SUCCESS
            verdict, why = _S.LLM_PARAM_INVALID, "synchronize_layer returned False"
        except Exception as exc:  # the layer's verdict: what the synchronizer raised
            verdict, why = status_of(exc), f"synchronize_layer raised {exc!r}"
        log.warning("transfer_cache_async: layer %d not sent: %s", layer, why)
        return verdict

    def _coordinate(self) -> None:
        try:
            for i in self._layers:
                if all(r.result.done() for r in self._routes if i in r.layers):
                    continue  # every config sending it already failed: nobody needs the layer
                verdict = self._verdict(i)
                for inbox, _ in self._inboxes:
                    inbox.put((i, verdict))
        finally:
            for inbox, _ in self._inboxes:
                inbox.put(None)

    def _send(self, inbox: _Inbox, routes: List[_Route]) -> None:
        # The coordinator always ends with None: this ends once it has (an unanswered
        # synchronizer keeps both waiting; they are daemon threads nobody joins).
        try:
            while (item := self._next(inbox, routes)) is not None:
                items, more = [item], True
                while more and not inbox.empty():  # layers computed while the last ones were sent
                    nxt = inbox.get()
                    more = nxt is not None
                    if nxt is not None:
                        items.append(nxt)
                for r in routes:
                    self._send_layers(r, items)
                if not more:
                    return
        finally:
            for r in routes:
                if not r.result.done():  # the task was cut short before this config's last layer
                    r.result.set_result(_S.LLM_FAILED)

    def _next(self, inbox: _Inbox, routes: List[_Route]) -> Optional[Tuple[int, LLMStatusCode]]:
        """The next layer to send; while none is waiting, layers still to come are
        prepared (the first layers are being computed meanwhile)."""
        while inbox.empty() and any([r.prepare_next(self._src) for r in routes]):
            pass
        return inbox.get()

    def _send_layers(self, route: _Route, items: List[Tuple[int, LLMStatusCode]]) -> None:
        """Send ``route`` its layers among ``items`` (layers and verdicts, in order): the
        computed ones up to the first that is not, in one batch; then that verdict ends
        the route."""
        mine = [(layer, verdict) for layer, verdict in items if layer in route.layers]
        if not mine or route.result.done():
            return
        ok = [layer for layer, verdict in mine if verdict == _S.LLM_SUCCESS]
        verdict = next((v for _, v in mine if v != _S.LLM_SUCCESS), _S.LLM_SUCCESS)
        if verdict != _S.LLM_SUCCESS:
            ok = ok[:[v for _, v in mine].index(verdict)]
        if ok:
            try:
                self._check_src()
                route.send(self._src, ok)
            except Exception as exc:  # this config fails; the others go on
                verdict = status_of(exc)
                log.warning("transfer_cache_async: transfer_configs[%d] failed at layers %s: %s",
                            route.index, ok, exc)
        if verdict != _S.LLM_SUCCESS:
            route.result.set_result(verdict)
        elif mine[-1][0] == route.layers[-1]:
            route.result.set_result(_S.LLM_SUCCESS)


def start_task(get_link: Callable[[int], Link], src_side: Side, src_is_blocks: bool,
               check_src: Callable[[], object], layer_synchronizer: LayerSynchronizer,
               transfer_configs: Sequence[Union[TransferConfig, TransferWithCacheKeyConfig]],
               src_block_indices: Optional[BlockList], dst_block_indices: Optional[BlockList],
               dst_block_memory_size: Optional[int]) -> CacheTask:
    """Validate ``transfer_cache_async``'s arguments against the source cache and the links,
    then start the task.  Raises before anything starts: ``TypeError`` for wrong types,
    ``LLM_PARAM_INVALID`` for invalid values, ``LLM_NOT_YET_LINK`` for an unlinked cluster.
    ``check_src`` raises once the source cache is gone; it runs before each send."""
    if not isinstance(layer_synchronizer, LayerSynchronizer):
        raise TypeError(f"layer_synchronizer must be a LayerSynchronizer, got {type(layer_synchronizer).__name__}")
    if not isinstance(transfer_configs, (list, tuple)):
        raise TypeError(f"transfer_configs must be a list or tuple of transfer configs, "
                        f"got {type(transfer_configs).__name__}")
    if not transfer_configs:
        raise_error(_S.LLM_PARAM_INVALID, "transfer_configs is empty")
    src = _Source(src_side, src_is_blocks, src_block_indices, dst_block_indices, dst_block_memory_size)
    routes = [_Route(i, config, src, get_link) for i, config in enumerate(transfer_configs)]
    _Task(routes, layer_synchronizer, src, check_src).start()
    return CacheTask([r.result for r in routes])
