"""Every code sample of the vendor documents (seeds 003 and 000), run against a real daemon.

Adaptation: tensors on CPU (``device="npu:1"`` -> ``"cpu"``, no ``import torch_npu``).
Samples that are fragments run after a preamble giving the context the documents assume
(an initialised ``cc`` with a registered 8-block, block_size-4 cache).  Where a sample
names a variable it never defines (``cc_config`` in the quick start, ``heads`` / ``v_t1`` /
``context_caching`` in 8.1, ``hashes`` / ``offsets`` in the token snippets that were copied
from the hash ones), the missing name is bound as the surrounding text intends; the calls
themselves are unchanged, so samples whose arguments break the contract (``sum(offsets) !=
len(slot_mapping)``, ``tonken_ids``, a mask of the wrong length) are checked to fail as the
contract says: ``EMS_INVALID_ARGUMENT``, caught by the sample, which exits with its code.
"""
from __future__ import annotations

import textwrap

import pytest
from ems_helpers import check, daemon_factory, ems_daemon, run_client  # noqa: F401

pytestmark = pytest.mark.timeout(120)

PREAMBLE = """
import torch
from ems import Ems, EmsConfig, EmsException, CcConfig, CcConfig_v1, CcKvOption, KvBufferWrapper, PrimaryKey
Ems.init(EmsConfig(cc_config=CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")))
cc = Ems.get_cc()
kvcache = [[torch.zeros((8, 4, 2, 4), dtype=torch.float16) for _ in range(2)] for _ in range(2)]
cc.register_kvcache(kvcache)
"""

# (name, needs preamble, code, expected exit code, substrings expected in stdout)
SAMPLES = [
    ("003-5-quickstart-init", False, """
# 引入模块
import os, torch
from ems import Ems, EmsConfig, EmsException, CcConfig, CcKvOption, KvBufferWrapper
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")  # bound: the sample uses it
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
print("init ok")
""", 0, ["init ok"]),
    ("003-5-quickstart-register", False, """
import os, torch
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
# 初始化cc配置
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
context_caching = cc  # bound: the sample uses both names
kvcache = [[torch.zeros((2, 4, 2, 4), dtype=torch.float16) for _ in range(2)] for _ in range(2)]
# 注册到Context Caching
try:
    context_caching.register_kvcache(kvcache)
    # 期望kvcache形状: [layers, k_v_index, GPU_blocks, Block_size, heads, head_size]
    print("register_kvcache: success")
except EmsException as e:
    print(f"register_kvcache failed: {e}")
""", 0, ["register_kvcache: success"]),
    ("003-5-quickstart-hash", True, """
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 保存
slot_mapping = [0,1,2,3,4,5,6,7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
# 读取保存的数据
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
print(cc_result)
""", 0, ["CcResult(success=2, total=2)"]),
    ("003-5-quickstart-token", True, """
# 设置save请求的超时时间
option = CcKvOption(timeout=5000)
block_size = 4
# 保存
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
# 读取保存的数据
try:
    cc_result = cc.save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(1)
print(cc_result)
""", 0, ["CcResult(success=0, total=0)"]),
    ("003-6.1-init", False, """
# 引入模块
import os
from ems import Ems, EmsConfig, EmsException, CcConfig

# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
print("done")
""", 0, ["done"]),
    ("003-7.1-get-cc", False, """
from ems import Ems, EmsConfig, EmsException, CcConfig
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is not initialized.")
print(type(cc).__name__)
""", 0, ["ContextCaching"]),
    ("003-7.2-check-health", False, """
from ems import Ems, EmsConfig, EmsException, CcConfig
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
status = Ems.check_health()
if status is not True:
    print("ems is not ok.")
else:
    print(f"ems is ok")
""", 0, ["ems is ok"]),
    ("003-8.1-register", False, """
import os, torch
from ems import Ems, EmsConfig, EmsException, CcConfig, CcKvOption, KvBufferWrapper
# 初始化cc配置
cc_config = CcConfig(rank_id=8, device_id=0, model_id="llama2-13b")
# 初始化Ems
config = EmsConfig(cc_config=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
# 获取context caching对象
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
# 设定形状
layers = 2
k_v_index = 2
GPU_blocks = 2
Block_size = 4
head = 2
heads = head  # bound: the sample defines head and uses heads
head_size = 4
# 设置device和dtype
device = "cpu"
dtype = torch.float16
k_t0 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
v_t0 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
k_t1 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
v_t2 = torch.zeros((GPU_blocks, Block_size, heads, head_size), device=device, dtype=dtype)
v_t1 = v_t2  # bound: the sample defines v_t2 and uses v_t1
kvcache = [
    [k_t0, v_t0], # 第 0 层
    [k_t1, v_t1], # 第 1 层
]
context_caching = cc  # bound
try:
    context_caching.register_kvcache(kvcache)
    print("register_kvcache: success")
except EmsException as e:
    print(f"register_kvcache failed: {e}")
""", 0, ["register_kvcache: success"]),
    ("003-8.2-save-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0,1,2,3,4,5,6,7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
""", 0, ["CcResult(success=2, total=2)"]),
    ("003-8.2-save-token", True, """
hashes = [0xABCD, 0x1234]  # bound from the hash sample before it
offsets = [4, 4]
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [1, 1, 1, 1, 1, 1]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option =
option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
""", 2, ["failed to save, EMS_INVALID_ARGUMENT", "offsets"]),
    ("003-8.3-async-save-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    hashes = [0x1111, 0x2222]
    offsets = [4, 4]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17]
    hashes = [0xAAAA, 0xBBBB]
    offsets = [4, 4]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
try:
    for future in future_list:
        result = future.result()
        print(f"result:{result}")
except EmsException as e:
    print(f"failed to get result, {e}.")
""", 2, ["failed to save, EMS_INVALID_ARGUMENT", "offsets"]),
    ("003-8.3-async-save-token", True, """
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    token_ids = [101, 102, 103, 104, 105, 106]
    mask = [1, 1, 1, 1, 1, 1]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17, 18]
    token_ids = [201, 202, 203, 204, 205, 206, 207, 208, 209]
    mask = [0, 0, 0, 0, 1, 1, 1, 1]
    future_list.append(cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
""", 2, ["failed to save, EMS_INVALID_ARGUMENT", "mask"]),
    ("003-8.4-load-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
try:
    cc_result = cc.load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
print(f"succeed to load key num {cc_result.success}.")
print(cc_result)
""", 2, ["failed to load, EMS_INVALID_ARGUMENT", "offsets"]),
    ("003-8.4-load-token", True, """
hashes = [0x1111, 0x2222]  # bound from the hash sample before it
offsets = [4, 4]
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [1, 1, 1, 1, 1, 1]
try:
    cc_result = cc.load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
except EmsException as e:
    print(f"failed to load, {e}.")
    exit(2)
print(f"succeed to load key num {cc_result.success}.")
print(cc_result)
""", 2, ["failed to load, EMS_INVALID_ARGUMENT"]),
    ("003-8.5-async-load-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
try:
    slot_mapping = [0, 1, 2, 3, 4, 5]
    hashes = [0x1111, 0x2222]
    offsets = [4, 4]
    future_list.append(cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets,
option = option))
    slot_mapping = [10, 11, 12, 13, 14, 15, 16, 17]
    hashes = [0xAAAA, 0xBBBB]
    offsets = [4, 4]
    future_list.append(cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets,
option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
""", 2, ["failed to save, EMS_INVALID_ARGUMENT"]),
    ("003-8.5-async-load-token", True, """
option = CcKvOption(timeout=5000)
block_size = 4
future_list = []
try:
    for idx in range(2):
        slot_mapping = [0, 1, 2, 3, 4, 5]
        tonken_ids = [102, 103, 104, 105, 106]
        mask = [0, 0, 0, 0, 1, 1]
        future_list.append(cc.async_load(slot_mapping = slot_mapping, tonken_ids = tonken_ids, mask = mask,
option = option))
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
""", 2, ["failed to save, EMS_INVALID_ARGUMENT", "tonken_ids"]),
    ("003-8.6-is-ready-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
future = cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
if cc.is_ready(future):
    print("async_save(hash) 已完成")
else:
    print("async_save(hash) 仍在进行中")
print(cc.get_result(future))
""", 0, ["async_save(hash)", "CcResult(success=2, total=2)"]),
    ("003-8.6-is-ready-token", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
future = cc.async_save(slot_mapping = slot_mapping, token_ids = token_ids, mask = mask, option = option)
if cc.is_ready(future):
    print("async_save(token) 已完成")
else:
    print("async_save(token) 仍在进行中")
""", 0, ["async_save(token)"]),
    ("003-8.7-get-result-hash", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5, 6, 7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    fut = cc.async_save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
    res = cc.get_result(fut)
    print("async_save(hash) result:", res)
except EmsException as e:
    print("async_save(hash) result:", res)
try:
    fut = cc.async_load(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
    res = cc.get_result(fut)
    print("async_load(hash) result:", res)
except EmsException as e:
    print(f"async_load(hash) failed: {e}")
""", 0, ["async_save(hash) result: CcResult(success=2, total=2)",
         "async_load(hash) result: CcResult(success=2, total=2)"]),
    ("003-8.7-get-result-token", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
token_ids = [101, 102, 103, 104, 105, 106]
mask = [0, 0, 0, 0, 1, 1]
try:
    fut = cc.async_save(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=option)
    res = cc.get_result(fut)
    print("async_save(token) result:", res)
except EmsException as e:
    print(f"async_save(token) failed: {e}")
try:
    fut = cc.async_load(slot_mapping=slot_mapping, token_ids=token_ids, mask=mask, option=option)
    res = cc.get_result(fut)
    print("async_load(token) result:", res)
except EmsException as e:
    print(f"async_load(token) failed: {e}")
""", 0, ["async_save(token) result: CcResult(success=0, total=0)",
         "async_load(token) result: CcResult(success=0, total=0)"]),
    ("003-8.8-exists", True, """
option = CcKvOption(timeout=5000)
hashes = [0xABCD, 0x1234]
try:
    cc_result = cc.exists(hashes = hashes, option = option)
except EmsException as e:
    print(f"failed to exists, {e}.")
    exit(2)
print(cc_result)
""", 0, ["CcResult(success=0, total=2)"]),
    ("003-9.1-retry", False, """
import os
import time
import torch
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
from ems.common.exception import EmsErrorCode
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
config = EmsConfig(cc_config_v1=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
option = CcKvOption(timeout=100)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
retries = 0
while True:
    try:
        result = cc.load(slot_mapping, hashes, offsets, option)
        break
    except EmsException as e:
        if e.status_code() != EmsErrorCode.EMS_IO_TIMEOUT or retries >= 3:
            print(f"failed to load cause unrecoverable error or retries is more than 3: {e.status_code()}.")
            exit(2)
        else:
            option.timeout = 1000
            time.sleep(0.01)
            print(f"retry after sleep 10ms.")
print(f"load result: {result}")
""", 2, ["failed to load cause unrecoverable error", "EMS_INVALID_ARGUMENT"]),
    ("003-9.2-message", False, """
import os
import torch
from ems import Ems, EmsConfig, EmsException, CcConfig_v1, CcKvOption, KvBufferWrapper
cc_config = CcConfig_v1(rank_id=8, device_id=0, model_id="llama2-13b")
config = EmsConfig(cc_config_v1=cc_config)
try:
    Ems.init(config)
except EmsException as e:
    print(f"exception: {e}.")
    exit(1)
cc = Ems.get_cc()
if cc is None:
    print("cc is None.")
    exit(1)
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0, 1, 2, 3, 4, 5]
hashes = [0x1111, 0x2222]
offsets = [4, 4]
try:
    result = cc.load(slot_mapping, hashes, offsets, option)
except EmsException as e:
    print(f"failed to load, message: {e.message()}")
""", 0, ["failed to load, message: invalid argument"]),
    ("000-v0-save", True, """
import torch
from ems import CcKvOption, PrimaryKey, KvBufferWrapper
option = CcKvOption(timeout=5000)
# 组成键值列表
key_list = [PrimaryKey("1", "123"), PrimaryKey("1", "66")]
tensor1 = torch.ones(2, device="cpu")
tensor2 = torch.ones(6, device="cpu")
len1 = tensor1.numel() * tensor1.element_size()
len2 = tensor2.numel() * tensor2.element_size()
val_list = [[KvBufferWrapper(tensor1.data_ptr, len1)], [KvBufferWrapper(tensor2.data_ptr, len2)]]
try:
    cc_result = cc.save(option, key_list, val_list)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
out = torch.zeros(6)
print(cc.load(option, [PrimaryKey("1", "66")], [[KvBufferWrapper(out.data_ptr, len2)]]), bool((out == 1).all()))
""", 0, ["CcResult(success=2, total=2)", "CcResult(success=1, total=1) True"]),
    ("000-v1-hash-save", True, """
option = CcKvOption(timeout=5000)
block_size = 4
slot_mapping = [0,1,2,3,4,5,6,7]
hashes = [0xABCD, 0x1234]
offsets = [4, 4]
try:
    cc_result = cc.save(slot_mapping = slot_mapping, hashes = hashes, offsets = offsets, option = option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
""", 0, ["CcResult(success=2, total=2)"]),
    ("000-v1-chunk-save", True, """
option = CcKvOption(timeout=5000)
block_size = 4
hashes = [0xABCD, 0x1234]
chunk_descs = [[(0, 4),(4, 4)]]
try:
    cc_result = cc.save(hashes = hashes, chunk_descs = chunk_descs, option = option)
except EmsException as e:
    print(f"failed to save, {e}.")
    exit(2)
print(cc_result)
print(cc.load(hashes = hashes, chunk_descs = [[(8, 4), (12, 4)]], option = option))
""", 0, ["CcResult(success=2, total=2)"]),
]


@pytest.mark.parametrize("name,preamble,code,exit_code,expect", SAMPLES, ids=[s[0] for s in SAMPLES])
def test_vendor_sample(ems_daemon, name, preamble, code, exit_code, expect):
    source = (textwrap.dedent(PREAMBLE) if preamble else "") + textwrap.dedent(code)
    proc = run_client(source, env={"EMS_SERVER": ems_daemon.dir})
    out = check(proc, exit_code)
    for text in expect:
        assert text in out, f"{name}: {text!r} not in output:\n{out}"
