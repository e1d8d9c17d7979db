// The launch of a prepared cuTile kernel from C++, shared by tilenorm's C++ launchers (the
// torch extension tilenorm/pytorch/native_calls.cpp and the XLA FFI handlers of
// tilenorm/jax/ffi_calls.cc): a tilenorm.launch.driver.LaunchRecipe as plain data, its
// parameter block filled from a table of device pointers, and cuLaunchKernelEx.
//
// Framework-neutral and header-only: no CUDA headers (the driver's entry points are looked up
// in libcuda and its launch structures are declared below), no Python; errors are thrown as
// std::runtime_error for each launcher to report its own way.

#ifndef TILENORM_LAUNCH_RECIPE_H_
#define TILENORM_LAUNCH_RECIPE_H_

#include <dlfcn.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace tilenorm::launch {

// --- the driver ------------------------------------------------------------------------------

// cuda.h: CUlaunchAttribute (an id, then a 64-byte value union) and CUlaunchConfig.
struct LaunchAttribute {
  int id;
  char pad[4];
  union {
    int value;
    char bytes[64];
  };
};
struct LaunchConfig {
  unsigned grid_x, grid_y, grid_z, block_x, block_y, block_z, shared_bytes;
  void* stream;
  LaunchAttribute* attrs;
  unsigned num_attrs;
};
constexpr int kProgrammaticStreamSerialization = 6;
constexpr int kInvalidContext = 201;

struct Driver {
  int (*launch)(const LaunchConfig*, void*, void**, void**);
  int (*device_get)(int*, int);
  int (*primary_retain)(void**, int);
  int (*primary_release)(int);
  int (*set_current)(void*);
  int (*error_string)(int, const char**);
};

template <typename F>
F symbol(void* library, const char* name) {
  void* found = dlsym(library, name);
  if (found == nullptr) throw std::runtime_error(std::string("tilenorm: libcuda has no ") + name);
  return reinterpret_cast<F>(found);
}

// libcuda's entry points, looked up on first use (throws where libcuda or one is missing).
inline const Driver& driver() {
  static const Driver d = [] {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (cuda == nullptr) throw std::runtime_error("tilenorm: cannot open libcuda.so.1");
    Driver out{};
    out.launch = symbol<decltype(out.launch)>(cuda, "cuLaunchKernelEx");
    out.device_get = symbol<decltype(out.device_get)>(cuda, "cuDeviceGet");
    out.primary_retain = symbol<decltype(out.primary_retain)>(cuda, "cuDevicePrimaryCtxRetain");
    out.primary_release =
        symbol<decltype(out.primary_release)>(cuda, "cuDevicePrimaryCtxRelease_v2");
    out.set_current = symbol<decltype(out.set_current)>(cuda, "cuCtxSetCurrent");
    out.error_string = symbol<decltype(out.error_string)>(cuda, "cuGetErrorString");
    return out;
  }();
  return d;
}

inline void check(int result, const char* what) {
  if (result == 0) return;
  const char* text = nullptr;
  driver().error_string(result, &text);
  throw std::runtime_error(std::string(what) + " failed: CUDA error " + std::to_string(result) +
                           ": " + (text ? text : "unknown"));
}

// A thread that has made no CUDA runtime call (autograd's backward thread, say) has no current
// context: make the device's primary context (the frameworks') current, as the runtime would.
inline void make_primary_context_current(int device_index) {
  const Driver& d = driver();
  int device = 0;
  void* context = nullptr;
  check(d.device_get(&device, device_index), "cuDeviceGet");
  check(d.primary_retain(&context, device), "cuDevicePrimaryCtxRetain");
  int result = d.set_current(context);
  d.primary_release(device);
  check(result, "cuCtxSetCurrent");
}

// --- launches --------------------------------------------------------------------------------

constexpr size_t kMaxParamBytes = 4096;
constexpr size_t kMaxParams = 512;

// A tilenorm.launch.driver.LaunchRecipe whose array and scalar names a launcher has resolved
// to indices into the pointer and value tables it launches with.
struct Recipe {
  void* kernel = nullptr;
  std::array<unsigned, 3> grid{};
  bool dependent = false;
  // The parameter block with the shapes, strides and fixed values written.
  std::vector<uint8_t> params;
  std::vector<uint32_t> param_offsets;
  // (index into the pointer table, byte offset in the block) of each runtime pointer.
  std::vector<std::pair<int, uint32_t>> arrays;
  // (index into the value table, byte offset in the block) of each runtime fp32 scalar.
  std::vector<std::pair<int, uint32_t>> scalars;

  // Whether the launcher's fixed-size parameter block and argument list hold this kernel's.
  bool fits() const {
    return params.size() <= kMaxParamBytes && param_offsets.size() <= kMaxParams;
  }

  // Launch on `stream` with `pointers` and `values` (indexed as `arrays` and `scalars` say);
  // false, launching nothing, where a pointer the kernel takes is null or not 16-byte aligned
  // (the layout promised alignment). Throws where the driver fails.
  bool launch(void* stream, int device_index, const uint64_t* pointers,
              const float* values) const {
    for (const auto& [operand, offset] : arrays) {
      uint64_t p = pointers[operand];
      if (p == 0 || (p & 15) != 0) return false;
    }
    alignas(16) uint8_t block[kMaxParamBytes];
    std::memcpy(block, params.data(), params.size());
    for (const auto& [operand, offset] : arrays) {
      std::memcpy(block + offset, &pointers[operand], sizeof(uint64_t));
    }
    for (const auto& [scalar, offset] : scalars) {
      std::memcpy(block + offset, &values[scalar], sizeof(float));
    }
    void* args[kMaxParams];
    for (size_t i = 0; i < param_offsets.size(); ++i) args[i] = block + param_offsets[i];
    LaunchAttribute attribute{};
    attribute.id = kProgrammaticStreamSerialization;
    attribute.value = 1;
    LaunchConfig config{grid[0], grid[1], grid[2], 1, 1, 1, 0, stream,
                        dependent ? &attribute : nullptr, dependent ? 1u : 0u};
    int result = driver().launch(&config, kernel, args, nullptr);
    if (result == kInvalidContext) {
      make_primary_context_current(device_index);
      result = driver().launch(&config, kernel, args, nullptr);
    }
    check(result, "cuLaunchKernelEx");
    return true;
  }
};

}  // namespace tilenorm::launch

#endif  // TILENORM_LAUNCH_RECIPE_H_
