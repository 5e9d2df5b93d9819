// A fake "npu" device for tests: torch's PrivateUse1 backend with device memory that the
// host cannot read.
//
// Every allocation is its own anonymous mapping, kept PROT_NONE except while one of this
// device's own kernels runs (a copy between the device and the host or within the device,
// which every other op reaches through the CPU fallback).  Code that takes a device
// tensor's data_ptr() for host memory therefore dies with SIGSEGV instead of reading or
// writing bytes that on a real NPU would be somewhere else; the tests rely on exactly that.
// One device, one default stream; work is synchronous.

#include <ATen/EmptyTensor.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>

#include <sys/mman.h>
#include <unistd.h>

#include <cstring>
#include <map>
#include <mutex>

namespace {

constexpr c10::DeviceType kNpu = c10::DeviceType::PrivateUse1;

std::mutex g_lock;
std::map<void*, size_t> g_regions;  // base -> mapped bytes
int g_open = 0;                     // kernels running (they unprotect every region)
int64_t g_kernels = 0;              // kernels run so far, for tests

size_t page_round(size_t n) {
  size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return ((n ? n : 1) + page - 1) / page * page;
}

void protect_all(int prot) {
  for (auto& r : g_regions) TORCH_CHECK(mprotect(r.first, r.second, prot) == 0, "fake npu: mprotect failed");
}

// Device memory is readable and writable while one of these lives.
struct KernelScope {
  KernelScope() {
    std::lock_guard<std::mutex> guard(g_lock);
    if (g_open++ == 0) protect_all(PROT_READ | PROT_WRITE);
    ++g_kernels;
  }
  ~KernelScope() {
    std::lock_guard<std::mutex> guard(g_lock);
    if (--g_open == 0) protect_all(PROT_NONE);
  }
};

void free_region(void* p) {
  std::lock_guard<std::mutex> guard(g_lock);
  auto it = g_regions.find(p);
  if (it == g_regions.end()) return;
  munmap(it->first, it->second);
  g_regions.erase(it);
}

struct FakeNpuAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t n) override {
    size_t bytes = page_round(n);
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    TORCH_CHECK(p != MAP_FAILED, "fake npu: out of memory allocating ", n, " bytes");
    std::lock_guard<std::mutex> guard(g_lock);
    if (g_open) TORCH_CHECK(mprotect(p, bytes, PROT_READ | PROT_WRITE) == 0, "fake npu: mprotect failed");
    g_regions[p] = bytes;
    return {p, p, &free_region, c10::Device(kNpu, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &free_region; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    KernelScope open;
    std::memcpy(dest, src, count);
  }
};

FakeNpuAllocator g_allocator;

struct FakeNpuGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kNpu; }
  c10::Device exchangeDevice(c10::Device d) const override { return c10::Device(kNpu, 0); }
  c10::Device getDevice() const override { return c10::Device(kNpu, 0); }
  void setDevice(c10::Device d) const override {
    TORCH_CHECK(d.index() <= 0, "fake npu: only device 0 exists, got ", d.index());
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device d) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kNpu, 0));
  }
  c10::Stream exchangeStream(c10::Stream s) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kNpu, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
};

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  return at::detail::empty_generic(size, &g_allocator, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  return at::detail::empty_strided_generic(size, stride, &g_allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

// A CPU tensor over the same memory as `t` (device or host), same sizes and strides.
at::Tensor host_alias(const at::Tensor& t) {
  if (t.device().type() != kNpu) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

// Every copy that touches the device: host -> device, device -> host, device -> device.
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  KernelScope open;
  host_alias(dst).copy_(host_alias(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  TORCH_CHECK(dst.sizes() == self.sizes(), "fake npu: _copy_from_and_resize needs equal sizes");
  return copy_from(self, dst, false);
}

void cpu_fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

int64_t kernels_run() {
  std::lock_guard<std::mutex> guard(g_lock);
  return g_kernels;
}

int64_t regions() {
  std::lock_guard<std::mutex> guard(g_lock);
  return static_cast<int64_t>(g_regions.size());
}

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
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&cpu_fallback>());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  c10::SetAllocator(kNpu, &g_allocator);
  m.def("kernels_run", &kernels_run, "device kernels run so far");
  m.def("regions", &regions, "live device allocations");
}
