// A fake "npu" device for tests: torch's PrivateUse1 backend with device memory that the
// host cannot read, several devices, streams, and (optionally) asynchronous work.
//
// Memory.  Every allocation is a memfd mapped twice: the address torch hands out
// (``data_ptr()``) is mapped PROT_NONE for good, and a second, private alias of the same
// pages is what this device's own kernels (the copies below) read and write.  Host code that
// takes a device address for host memory therefore dies with SIGSEGV, whether or not a copy
// is running on another thread at the time, instead of reading bytes that on a real NPU
// would be somewhere else.  A kernel given an address that lies in no live allocation
// fails (as an ACL copy of a bad device pointer does) rather than touching host memory.
// Allocations belong to a device (the ``device`` argument, else the thread's current one).
//
// Streams.  Each thread has a current stream per device (0, the device's default stream,
// unless set).  In asynchronous mode (``set_async(true)``) a device-to-device copy and a
// copy asked for with ``non_blocking`` are queued on the current stream and run only when
// that stream or its device is synchronized, or when a blocking copy on the same stream
// needs them first (stream order).  Work that is never synchronized is never done, so a
// missing synchronization shows as wrong bytes every time, not only in an unlucky race.
//
// Every op other than these copies reaches the device through torch's CPU fallback,
// which copies through them.

#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/set_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;
constexpr int kMaxDevices = 8;

struct Region {
  size_t bytes;      // mapped (page-rounded)
  size_t requested;  // asked for
  int device;
  char* alias;       // the kernels' view of the same pages
};

std::mutex g_lock;                       // g_regions, g_kernels
std::map<uintptr_t, Region> g_regions;   // device address -> region
int64_t g_kernels = 0;                   // kernels run so far, for tests
int g_count = kMaxDevices;               // devices visible to this process
bool g_async = false;

thread_local int tl_device = 0;
thread_local int64_t tl_stream[kMaxDevices] = {0};

size_t page_round(size_t n) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ((n ? n : 1) + page - 1) / page * page;
}

int check_index(int index) {
  TORCH_CHECK(index >= 0 && index < g_count, "fake npu: device ", index, " does not exist (", g_count,
              " visible; ASCEND_RT_VISIBLE_DEVICES)");
  return index;
}

// The kernels' alias of `n` bytes at device address `p`; an address outside every live
// allocation is an error, never a host access.
char* alias_of(const void* p, size_t n) {
  auto a = reinterpret_cast<uintptr_t>(p);
  std::lock_guard<std::mutex> guard(g_lock);
  auto it = g_regions.upper_bound(a);
  TORCH_CHECK(it != g_regions.begin(), "fake npu: ", p, " is not device memory");
  --it;
  TORCH_CHECK(a + n <= it->first + it->second.bytes, "fake npu: ", n, " bytes at ", p,
              " are not inside one device allocation");
  return it->second.alias + (a - it->first);
}

void free_region(void* p) {
  std::lock_guard<std::mutex> guard(g_lock);
  auto it = g_regions.find(reinterpret_cast<uintptr_t>(p));
  if (it == g_regions.end()) return;
  munmap(p, it->second.bytes);
  munmap(it->second.alias, it->second.bytes);
  g_regions.erase(it);
}

thread_local int tl_alloc_device = -1;  // set by the factory functions below for one allocation

struct FakeNpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    int device = tl_alloc_device >= 0 ? tl_alloc_device : tl_device;
    size_t bytes = page_round(n);
    int fd = memfd_create("fake-npu", MFD_CLOEXEC);
    TORCH_CHECK(fd >= 0 && ftruncate(fd, static_cast<off_t>(bytes)) == 0, "fake npu: out of memory allocating ", n,
                " bytes");
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_SHARED, fd, 0);
    void* alias = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    TORCH_CHECK(p != MAP_FAILED && alias != MAP_FAILED, "fake npu: out of memory allocating ", n, " bytes");
    std::lock_guard<std::mutex> guard(g_lock);
    g_regions[reinterpret_cast<uintptr_t>(p)] = Region{bytes, n, device, static_cast<char*>(alias)};
    return {p, p, &free_region, c10::Device(kNpu, static_cast<c10::DeviceIndex>(device))};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_region; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    if (count == 0) return;
    std::memcpy(alias_of(dest, count), alias_of(src, count), count);
    std::lock_guard<std::mutex> guard(g_lock);
    ++g_kernels;
  }
};

FakeNpuAllocator g_allocator;

// ---------------------------------------------------------------------------- streams
std::mutex g_queue_lock;  // g_queues
std::map<std::pair<int, int64_t>, std::deque<std::function<void()>>> g_queues;
std::mutex g_run_lock;    // one kernel at a time, in queue order

// Run what is queued on (device, stream), or on every stream of device when stream < 0.
void flush(int device, int64_t stream) {
  std::lock_guard<std::mutex> run(g_run_lock);
  for (;;) {
    std::function<void()> work;
    {
      std::lock_guard<std::mutex> guard(g_queue_lock);
      for (auto& q : g_queues) {
        if (q.first.first == device && (stream < 0 || q.first.second == stream) && !q.second.empty()) {
          work = std::move(q.second.front());
          q.second.pop_front();
          break;
        }
      }
    }
    if (!work) return;
    work();
  }
}

int64_t queued() {
  std::lock_guard<std::mutex> guard(g_queue_lock);
  int64_t n = 0;
  for (auto& q : g_queues) n += static_cast<int64_t>(q.second.size());
  return n;
}

struct FakeNpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override {
    c10::Device old(kNpu, static_cast<c10::DeviceIndex>(tl_device));
    if (d.has_index()) tl_device = check_index(d.index());
    return old;
  }
  c10::Device getDevice() const override { return c10::Device(kNpu, static_cast<c10::DeviceIndex>(tl_device)); }
  void setDevice(c10::Device d) const override {
    if (d.has_index()) tl_device = check_index(d.index());
  }
  void uncheckedSetDevice(c10::Device d) const noexcept override {
    if (d.has_index() && d.index() < g_count) tl_device = d.index();
  }
  c10::Stream getStream(c10::Device d) const override {
    int index = d.has_index() ? d.index() : tl_device;
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(kNpu, static_cast<c10::DeviceIndex>(index)), tl_stream[index]);
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    int index = s.device().has_index() ? s.device().index() : tl_device;
    c10::Stream old = getStream(c10::Device(kNpu, static_cast<c10::DeviceIndex>(index)));
    tl_stream[index] = s.id();
    return old;
  }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(g_count); }
};

int factory_device(std::optional<c10::Device> device) {
  return device && device->has_index() ? check_index(device->index()) : tl_device;
}

struct AllocOn {
  explicit AllocOn(int device) { tl_alloc_device = device; }
  ~AllocOn() { tl_alloc_device = -1; }
};

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  AllocOn on(factory_device(device));
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  AllocOn on(factory_device(device));
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over the kernels' alias of `t`'s memory (device), or `t` itself (host).
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kNpu) return t;
  if (t.numel() == 0) return at::empty(t.sizes(), t.options().device(c10::kCPU));
  int64_t extent = 1;
  for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
  char* a = alias_of(t.data_ptr(), static_cast<size_t>(extent) * t.element_size());
  return at::from_blob(a, t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

void run_copy(const at::Tensor& self, const at::Tensor& dst) {
  host_alias(dst).copy_(host_alias(self));
  std::lock_guard<std::mutex> guard(g_lock);
  ++g_kernels;
}

// Every copy that touches the device: host -> device, device -> host, device -> device.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const at::Tensor& dev = dst.device().type() == kNpu ? dst : self;
  int device = dev.device().index();
  int64_t stream = tl_stream[device];
  bool host_side = self.device().type() != kNpu || dst.device().type() != kNpu;
  if (g_async && (!host_side || non_blocking)) {
    at::Tensor s = self, d = dst;
    std::lock_guard<std::mutex> guard(g_queue_lock);
    g_queues[{device, stream}].push_back([s, d] { run_copy(s, d); });
    return dst;
  }
  flush(device, stream);  // stream order: what is queued before this copy runs first
  if (self.device().type() == kNpu && self.device().index() != device) flush(self.device().index(), -1);
  run_copy(self, dst);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  TORCH_CHECK(dst.sizes() == self.sizes(), "fake npu: _copy_from_and_resize needs equal sizes");
  return copy_from(self, dst, false);
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

// What torch asks of an accelerator (torch._C._get_accelerator(), used by e.g.
// torch.distributed.barrier), as torch_npu's NPUHooksInterface answers it.
struct FakeNpuHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return g_count > 0; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(g_count); }
  c10::DeviceIndex getCurrentDevice() const override { return static_cast<c10::DeviceIndex>(tl_device); }
  void setCurrentDevice(c10::DeviceIndex d) const override { tl_device = check_index(d); }
  at::Device getDeviceFromPtr(void* data) const override {
    auto a = reinterpret_cast<uintptr_t>(data);
    std::lock_guard<std::mutex> guard(g_lock);
    auto it = g_regions.upper_bound(a);
    TORCH_CHECK(it != g_regions.begin(), "fake npu: ", data, " is not device memory");
    --it;
    TORCH_CHECK(a < it->first + it->second.bytes, "fake npu: ", data, " is not device memory");
    return at::Device(kNpu, static_cast<c10::DeviceIndex>(it->second.device));
  }
};

// -- Python-facing calls -------------------------------------------------------------------
int64_t kernels_run() {
  std::lock_guard<std::mutex> guard(g_lock);
  return g_kernels;
}

int64_t regions() {
  std::lock_guard<std::mutex> guard(g_lock);
  return static_cast<int64_t>(g_regions.size());
}

// (address, mapped bytes, requested bytes, device) of every live allocation.
std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> snapshot() {
  std::lock_guard<std::mutex> guard(g_lock);
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> out;
  for (auto& r : g_regions)
    out.emplace_back(static_cast<int64_t>(r.first), static_cast<int64_t>(r.second.bytes),
                     static_cast<int64_t>(r.second.requested), r.second.device);
  return out;
}

void set_device_count(int64_t n) {
  TORCH_CHECK(n >= 0 && n <= kMaxDevices, "fake npu: at most ", kMaxDevices, " devices");
  g_count = static_cast<int>(n);
}

void set_device(int64_t index) { tl_device = check_index(static_cast<int>(index)); }
int64_t current_device() { return tl_device; }
void set_stream(int64_t device, int64_t id) { tl_stream[check_index(static_cast<int>(device))] = id; }
int64_t current_stream(int64_t device) { return tl_stream[check_index(static_cast<int>(device))]; }
void synchronize_stream(int64_t device, int64_t id) { flush(check_index(static_cast<int>(device)), id); }
void synchronize_device(int64_t device) { flush(check_index(static_cast<int>(device)), -1); }
void set_async(bool on) { g_async = on; }

}  // namespace

C10_REGISTER_GUARD_IMPL(PrivateUse1, FakeNpuGuard);

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("as_strided", at::native::as_strided_tensorimpl);
  m.impl("view", at::native::view);
  m.impl("_reshape_alias", at::native::_reshape_alias);
  m.impl("set_.source_Storage", at::native::set_);
  m.impl("set_.source_Storage_storage_offset", at::native::set_storage_cpu_);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  c10::SetAllocator(kNpu, &g_allocator);
  at::RegisterPrivateUse1HooksInterface(new FakeNpuHooks());
  m.def("kernels_run", &kernels_run, "device kernels run so far");
  m.def("regions", &regions, "live device allocations");
  m.def("snapshot", &snapshot, "(address, mapped, requested, device) of live allocations");
  m.def("set_device_count", &set_device_count);
  m.def("set_device", &set_device);
  m.def("current_device", &current_device);
  m.def("set_stream", &set_stream);
  m.def("current_stream", &current_stream);
  m.def("synchronize_stream", &synchronize_stream, py::call_guard<py::gil_scoped_release>());
  m.def("synchronize_device", &synchronize_device, py::call_guard<py::gil_scoped_release>());
  m.def("set_async", &set_async);
  m.def("queued", &queued, "copies queued and not yet run");
}
