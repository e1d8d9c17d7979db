// The XLA FFI custom calls of tilenorm.jax's kernel path: a prepared call (the kernel launches
// tilenorm.launch.driver prepared for one shard's shapes and dtypes, registered from Python
// at trace time) run on XLA's stream, with its data pointers taken from the call's operand
// and result buffers.
//
// Built on first use by tilenorm.jax.native against jaxlib's FFI headers; it needs no CUDA
// headers (the launch is tilenorm/launch/recipe.h's, shared with the torch extension) and no
// Python: calls are registered through the C functions at the bottom (ctypes).

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <utility>
#include <vector>

#include "recipe.h"
#include "xla/ffi/api/ffi.h"

namespace {

namespace ffi = xla::ffi;
using tilenorm::launch::Recipe;

// Where a kernel's data pointer points: into buffer `buffer` of the call (its operands, then
// its results, as XLA passes them), `offset` bytes in (a partial buffer's second group, a
// placeholder's slice).
struct PointerSource {
  int32_t buffer;
  uint64_t offset;
};

// One prepared call: its launches in order, the pointer table they read (PointerSource per
// entry) and the values of their fp32 scalars (eps, offset: static in a traced call).
struct PreparedCall {
  std::vector<Recipe> launches;
  std::vector<PointerSource> pointers;
  std::vector<float> values;
  size_t operands = 0, results = 0;
};

// Prepared calls by id: registered at trace time, never removed (a compiled executable may
// run as long as the process), read by every call.
class Registry {
 public:
  int64_t add(std::unique_ptr<PreparedCall> call) {
    std::unique_lock lock(mutex_);
    calls_.push_back(std::move(call));
    return static_cast<int64_t>(calls_.size()) - 1;
  }

  const PreparedCall* find(int64_t id) const {
    std::shared_lock lock(mutex_);
    return id >= 0 && id < static_cast<int64_t>(calls_.size()) ? calls_[id].get() : nullptr;
  }

  int64_t size() const {
    std::shared_lock lock(mutex_);
    return static_cast<int64_t>(calls_.size());
  }

 private:
  mutable std::shared_mutex mutex_;
  std::vector<std::unique_ptr<PreparedCall>> calls_;
};

Registry& registry() {
  static Registry calls;
  return calls;
}

ffi::Error run_prepared(void* stream, int32_t device, int64_t id, ffi::RemainingArgs args,
                        ffi::RemainingRets rets) {
  const PreparedCall* call = registry().find(id);
  if (call == nullptr) {
    return ffi::Error::InvalidArgument("tilenorm: no prepared call " + std::to_string(id) +
                                       " in this process (a call is prepared when traced)");
  }
  if (args.size() != call->operands || rets.size() != call->results) {
    return ffi::Error::InvalidArgument("tilenorm: prepared call " + std::to_string(id) +
                                       " takes other operands and results");
  }
  std::vector<uint64_t> buffers;
  buffers.reserve(args.size() + rets.size());
  for (size_t i = 0; i < args.size(); ++i) {
    auto buffer = args.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    buffers.push_back(reinterpret_cast<uint64_t>(buffer->untyped_data()));
  }
  for (size_t i = 0; i < rets.size(); ++i) {
    auto buffer = rets.get<ffi::AnyBuffer>(i);
    if (buffer.has_error()) return buffer.error();
    buffers.push_back(reinterpret_cast<uint64_t>((*buffer)->untyped_data()));
  }
  std::vector<uint64_t> pointers;
  pointers.reserve(call->pointers.size());
  for (const PointerSource& source : call->pointers) {
    uint64_t base = buffers[source.buffer];
    pointers.push_back(base == 0 ? 0 : base + source.offset);
  }
  try {
    for (const Recipe& launch : call->launches) {
      if (!launch.launch(stream, device, pointers.data(), call->values.data())) {
        return ffi::Error::Internal("tilenorm: an operand of prepared call " +
                                    std::to_string(id) + " is not 16-byte aligned");
      }
    }
  } catch (const std::exception& error) {
    return ffi::Error::Internal(error.what());
  }
  return ffi::Error::Success();
}

}  // namespace

// The forward and the backward run alike (what they launch is in the prepared call); two
// targets name them apart in a compiled program.
#define TILENORM_PREPARED_CALL_HANDLER(name)                        \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, run_prepared,                 \
                                ffi::Ffi::Bind()                    \
                                    .Ctx<ffi::PlatformStream<void*>>() \
                                    .Ctx<ffi::DeviceOrdinal>()      \
                                    .Attr<int64_t>("call")          \
                                    .RemainingArgs()                \
                                    .RemainingRets())

// Exported for jax.ffi.pycapsule (the library is built with hidden visibility).
#pragma GCC visibility push(default)
TILENORM_PREPARED_CALL_HANDLER(tilenorm_norm_forward);
TILENORM_PREPARED_CALL_HANDLER(tilenorm_norm_backward);
#pragma GCC visibility pop

// --- registration (ctypes) -------------------------------------------------------------------

extern "C" {

// One kernel launch of a prepared call: a tilenorm.launch.driver.LaunchRecipe whose runtime
// pointers and scalars are given as indices into the call's pointer and value tables.
struct TilenormLaunch {
  uint64_t kernel;
  uint32_t grid[3];
  int32_t dependent;
  const uint8_t* params;
  uint32_t params_size;
  const uint32_t* param_offsets;
  uint32_t num_params;
  const int32_t* array_pointers;  // index into the pointer table, per runtime pointer
  const uint32_t* array_offsets;  // its byte offset in the parameter block
  uint32_t num_arrays;
  const int32_t* scalar_values;  // index into the value table, per runtime scalar
  const uint32_t* scalar_offsets;
  uint32_t num_scalars;
};

// Registers a prepared call of `num_launches` launches whose pointer table entry i is buffer
// `pointer_buffers[i]` (operands then results) plus `pointer_offsets[i]` bytes; returns its id
// for the custom call's `call` attribute, or -1 where the call is malformed.
__attribute__((visibility("default"))) int64_t tilenorm_register_call(
    const TilenormLaunch* launches, uint32_t num_launches, const int32_t* pointer_buffers,
    const uint64_t* pointer_offsets, uint32_t num_pointers, const float* values,
    uint32_t num_values, uint32_t num_operands, uint32_t num_results) {
  auto call = std::make_unique<PreparedCall>();
  call->operands = num_operands;
  call->results = num_results;
  call->values.assign(values, values + num_values);
  for (uint32_t i = 0; i < num_pointers; ++i) {
    if (pointer_buffers[i] < 0 || pointer_buffers[i] >= int32_t(num_operands + num_results)) {
      return -1;
    }
    call->pointers.push_back({pointer_buffers[i], pointer_offsets[i]});
  }
  for (uint32_t l = 0; l < num_launches; ++l) {
    const TilenormLaunch& in = launches[l];
    Recipe recipe;
    recipe.kernel = reinterpret_cast<void*>(in.kernel);
    recipe.grid = {in.grid[0], in.grid[1], in.grid[2]};
    recipe.dependent = in.dependent != 0;
    recipe.params.assign(in.params, in.params + in.params_size);
    recipe.param_offsets.assign(in.param_offsets, in.param_offsets + in.num_params);
    for (uint32_t a = 0; a < in.num_arrays; ++a) {
      if (in.array_pointers[a] < 0 || uint32_t(in.array_pointers[a]) >= num_pointers) return -1;
      recipe.arrays.emplace_back(in.array_pointers[a], in.array_offsets[a]);
    }
    for (uint32_t s = 0; s < in.num_scalars; ++s) {
      if (in.scalar_values[s] < 0 || uint32_t(in.scalar_values[s]) >= num_values) return -1;
      recipe.scalars.emplace_back(in.scalar_values[s], in.scalar_offsets[s]);
    }
    if (!recipe.fits()) return -1;
    call->launches.push_back(std::move(recipe));
  }
  return registry().add(std::move(call));
}

// How many calls are registered (tests).
__attribute__((visibility("default"))) int64_t tilenorm_registered_calls() {
  return registry().size();
}

}  // extern "C"
