"""Run real vLLM instances in processes of their own, for the vLLM samples and tests.

:class:`Instance` starts one ``vllm.LLM`` in a child process (its own process group, so
``kill()`` takes vLLM's engine and worker processes with it) and drives it over a pipe:
``generate`` returns each request's tokens, ``kv_transfer_params``, finish reason and time
to the first token; ``metrics`` returns vLLM's prompt-token counters by source.  Every
call has a deadline; a child that fails sends its traceback, which the call raises.

The model is a tiny random Llama (``write_tiny_model``) loaded with dummy weights, so no
download is needed and two instances of the same config compute the same tokens.

Instances run with ``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless the environment sets it:
vLLM's automatic binding pins the worker of every instance on a machine to the same
cores, and two instances pinned to one core starve each other (the decode worker's
spinning thread kept the prefill worker's threads, pinned to the same core, from running
for over a minute; a starved thread that holds the GIL stops the whole worker).  A real
deployment gives each instance cores of its own; unpinned, the kernel does that here.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

#: vLLM's CPU backend needs a block size that is a multiple of 32.
BLOCK_SIZE = 32
START_TIMEOUT_S = 300.0


def write_tiny_model(path: str, max_len: int = 4096, weights: bool = False) -> str:
    """Save a small random Llama config (2 layers, 4 heads, 2 KV heads) at ``path``; with
    ``weights``, random weights too (seeded), for instances of different tensor parallelism
    (vLLM's dummy weights are drawn per rank's shard, so they are another model at another
    tensor-parallel size)."""
    from transformers import LlamaConfig

    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_len)
    config.save_pretrained(path)
    if weights:
        import torch
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    return path


def connector_config(name: str, module: str, role: str, extra: Optional[dict] = None) -> Dict[str, Any]:
    """``KVTransferConfig`` arguments for a connector loaded by module path."""
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
            "kv_connector_extra_config": dict(extra or {})}


@dataclass
class Result:
    tokens: List[int]
    kv_transfer_params: Optional[dict]
    finish_reason: Optional[str]
    num_cached_tokens: int
    ttft_s: float


def _ttft(output: Any, fallback: float) -> float:
    """vLLM's own first-token latency of a request (arrival to first token)."""
    latency = getattr(getattr(output, "metrics", None), "first_token_latency", 0.0)
    return float(latency) if latency else fallback


def _serve(conn, model: str, max_model_len: int, kv: Optional[dict], prefix_caching: bool, env: Dict[str, str],
           block_size: int) -> None:
    os.setsid()  # kill() ends vLLM's processes too
    os.environ.update(env)
    try:
        from vllm import LLM, SamplingParams
        from vllm.config import KVTransferConfig
        from vllm.inputs import TokensPrompt

        llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", block_size=block_size,
                  enforce_eager=True, max_model_len=max_model_len, enable_prefix_caching=prefix_caching,
                  disable_log_stats=False, kv_transfer_config=KVTransferConfig(**kv) if kv else None)
        conn.send(("ready", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        try:
            if cmd == "exit":
                llm.llm_engine.engine_core.shutdown()  # stops vLLM's engine and worker processes
                break
            if cmd == "metrics":
                metrics = llm.get_metrics()
                found = {m.labels.get("source"): m.value for m in metrics if m.name == "vllm:prompt_tokens_by_source"}
                found["kv_cache_usage"] = sum(m.value for m in metrics if m.name == "vllm:kv_cache_usage_perc")
                conn.send(("ok", found))
                continue
            prompts, params = args
            start = time.perf_counter()
            outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                [SamplingParams(temperature=0, detokenize=False, **p) for p in params],
                                use_tqdm=False)
            conn.send(("ok", [Result(list(o.outputs[0].token_ids), o.kv_transfer_params, o.outputs[0].finish_reason,
                                     o.num_cached_tokens or 0, _ttft(o, time.perf_counter() - start))
                              for o in outs]))
        except BaseException:
            conn.send(("error", traceback.format_exc()))
    conn.close()


class Instance:
    """One vLLM instance in a child process (see the module docstring)."""

    def __init__(self, model: str, *, max_model_len: int = 512, kv: Optional[dict] = None,
                 prefix_caching: bool = False, kvcache_gib: int = 1, block_size: int = BLOCK_SIZE) -> None:
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        child_env = {"VLLM_CPU_KVCACHE_SPACE": str(kvcache_gib),
                     "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind")}
        self.process = ctx.Process(target=_serve,
                                   args=(child, model, max_model_len, kv, prefix_caching, child_env, block_size))
        self.process.start()
        child.close()
        self._call_result(START_TIMEOUT_S)

    def _call_result(self, timeout_s: float) -> Any:
        if not self._conn.poll(timeout_s):
            self.kill()
            raise TimeoutError(f"vLLM instance did not answer within {timeout_s:.0f} s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise RuntimeError(f"vLLM instance died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise RuntimeError(f"vLLM instance failed:\n{value}")
        return value

    def generate(self, prompts: Sequence[List[int]], params: Sequence[dict], timeout_s: float = 300.0) -> List[Result]:
        """Greedy generation; ``params`` are ``SamplingParams`` keyword arguments per prompt."""
        self._conn.send(("generate", (list(prompts), list(params))))
        return self._call_result(timeout_s)

    def metrics(self) -> Dict[str, float]:
        """vLLM's ``prompt_tokens_by_source`` counters (local_compute, local_cache_hit,
        external_kv_transfer) and ``kv_cache_usage`` (the share of KV blocks in use)."""
        self._conn.send(("metrics", None))
        return self._call_result(60.0)

    def close(self, timeout_s: float = 30.0) -> None:
        if self.process.is_alive():
            try:
                self._conn.send(("exit", None))
            except OSError:
                pass
            self.process.join(timeout_s)
        self.kill()

    def kill(self) -> None:
        """SIGKILL the instance and every process vLLM started for it."""
        if self.process.pid is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.process.join(10.0)

    def __enter__(self) -> "Instance":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
