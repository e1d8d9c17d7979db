// The XLA FFI custom call of a CuTe DSL kernel of tilenorm.jax: one compiled variant of
// RowNormForward or ClusterRowNormForward (tilenorm/kernels/cute_row_norm_forward.py,
// cute_cluster_norm_forward.py) or of ClusterRowNormBackward (cute_cluster_norm_backward.py),
// exported by the DSL to an object whose one entry, TILENORM_CUTE_ENTRY, takes the TVM-FFI
// safe-call ABI (tvm/ffi/c_api.h: TVMFFISafeCallType), called on XLA's stream. The exported
// entry launches the kernel itself, cluster shape included: its host code calls
// cudaLaunchKernelEx with the cluster-dimension attribute of the kernel's compile, as the
// DSL's own JIT does (the JIT loads an export of the same module; tests/test_jax_cute_forward.py
// reads it in the exported host code).
//
// Built on first use by tilenorm.jax.cute_ffi, once per compiled variant: this file and the
// exported object are linked into one library with the DSL's runtime (libcute_dsl_runtime.so,
// the CUDA calls of the exported code) and TVM-FFI (libtvm_ffi.so: its error and stream
// functions). The build defines:
//
//   TILENORM_CUTE_ENTRY     the exported entry's symbol (__tvm_ffi_<name>)
//   TILENORM_CUTE_KERNEL    the kernel's name in messages ("forward", "cluster backward")
//   TILENORM_CUTE_ARRAYS    the entry's array arguments in order, each 0 (absent: None), 1 (the
//                           call's next operand) or 2 (its next result)
//   TILENORM_CUTE_TAKES_EPS 1: the entry's scalars are (eps, offset, grid); 0: (offset, grid)
//
// The forward's entry is fn(x, residual, weight, bias, y, h, mean, rstd, eps, offset, grid)
// (tilenorm.launch.cute.compile_forward), the cluster backward's fn(h, dy, weight, mean,
// rstd, dres_in, dx, partial, offset, grid) (compile_cluster_backward), None for the absent
// arrays; the entry checks every array's dtype, shape, strides, device and alignment itself,
// so a mismatch is its error message, returned to XLA.

#include <dlpack/dlpack.h>
#include <tvm/ffi/c_api.h>
#include <tvm/ffi/extra/c_env_api.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

#if !defined(TILENORM_CUTE_ENTRY) || !defined(TILENORM_CUTE_KERNEL) || \
    !defined(TILENORM_CUTE_ARRAYS) || !defined(TILENORM_CUTE_TAKES_EPS)
#error "tilenorm.jax.cute_ffi defines the entry and the variant's arrays"
#endif

extern "C" int TILENORM_CUTE_ENTRY(void* handle, const TVMFFIAny* args, int32_t num_args,
                                   TVMFFIAny* result);

namespace {

namespace ffi = xla::ffi;

constexpr char kKernel[] = TILENORM_CUTE_KERNEL;
enum Slot : int { kAbsent = 0, kOperand = 1, kResult = 2 };
constexpr int kSlots[] = {TILENORM_CUTE_ARRAYS};
constexpr int kArrays = sizeof(kSlots) / sizeof(kSlots[0]);
constexpr bool kTakesEps = TILENORM_CUTE_TAKES_EPS;

constexpr size_t count(int kind) {
  size_t n = 0;
  for (int slot : kSlots) n += slot == kind;
  return n;
}
constexpr size_t kOperands = count(kOperand);
constexpr size_t kResults = count(kResult);
static_assert(kOperands + kResults + count(kAbsent) == kArrays, "slots are 0, 1 or 2");
// The kernels' arrays are (rows, cols), (cols,), (rows,) and the cluster backward's partial
// buffer (clusters, groups, cols): ranks up to 3.
constexpr int kMaxRank = 3;
// The entry's scalars after its arrays: eps (the forward's), offset, grid.
constexpr int kScalars = kTakesEps ? 3 : 2;

// Calls that reached the kernel, for the tests' check that this target ran.
std::atomic<int64_t> calls_run{0};

// A dense row-major DLTensor over one XLA buffer, with the shape and strides it points to.
struct TensorView {
  DLTensor tensor{};
  int64_t shape[kMaxRank] = {};
  int64_t strides[kMaxRank] = {};
};

ffi::Error dl_dtype(ffi::DataType type, DLDataType* out) {
  switch (type) {
    case ffi::DataType::BF16:
      *out = DLDataType{kDLBfloat, 16, 1};
      return ffi::Error::Success();
    case ffi::DataType::F16:
      *out = DLDataType{kDLFloat, 16, 1};
      return ffi::Error::Success();
    case ffi::DataType::F32:
      *out = DLDataType{kDLFloat, 32, 1};
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument(std::string("tilenorm: the CuTe DSL ") + kKernel +
                                         " takes bfloat16, float16 and float32 arrays");
  }
}

// `view` over `buffer` on CUDA device `device`. Strides are always given (DLPack allows
// NULL for compact tensors, but the exported checks read them).
ffi::Error make_view(const ffi::AnyBuffer& buffer, int32_t device, TensorView* view) {
  auto dims = buffer.dimensions();
  if (dims.size() < 1 || dims.size() > kMaxRank) {
    return ffi::Error::InvalidArgument(std::string("tilenorm: the CuTe DSL ") + kKernel +
                                       "'s arrays have rank 1 to " +
                                       std::to_string(kMaxRank));
  }
  ffi::Error error = dl_dtype(buffer.element_type(), &view->tensor.dtype);
  if (error.failure()) return error;
  const int rank = static_cast<int>(dims.size());
  int64_t stride = 1;
  for (int d = rank - 1; d >= 0; --d) {
    view->shape[d] = dims[d];
    view->strides[d] = stride;
    stride *= dims[d];
  }
  view->tensor.data = buffer.untyped_data();
  view->tensor.device = DLDevice{kDLCUDA, device};
  view->tensor.ndim = rank;
  view->tensor.shape = view->shape;
  view->tensor.strides = view->strides;
  view->tensor.byte_offset = 0;
  return ffi::Error::Success();
}

TVMFFIAny none() {
  TVMFFIAny any{};
  any.type_index = kTVMFFINone;
  return any;
}

TVMFFIAny tensor_arg(TensorView* view) {
  if (view == nullptr) return none();
  TVMFFIAny any{};
  any.type_index = kTVMFFIDLTensorPtr;
  any.v_ptr = &view->tensor;
  return any;
}

TVMFFIAny float_arg(double value) {
  TVMFFIAny any{};
  any.type_index = kTVMFFIFloat;
  any.v_float64 = value;
  return any;
}

TVMFFIAny int_arg(int64_t value) {
  TVMFFIAny any{};
  any.type_index = kTVMFFIInt;
  any.v_int64 = value;
  return any;
}

// The error the entry raised (TVM-FFI keeps it in thread-local storage), as "Kind: message".
std::string raised_error() {
  TVMFFIObjectHandle error = nullptr;
  TVMFFIErrorMoveFromRaised(&error);
  if (error == nullptr) return "an error without a message";
  const TVMFFIErrorCell* cell = TVMFFIErrorGetCellPtr(error);
  std::string text(cell->kind.data, cell->kind.size);
  text += ": ";
  text.append(cell->message.data, cell->message.size);
  TVMFFIObjectDecRef(error);
  return text;
}

// Whether the entry's result holds an object to release (it returns None: never, so far).
void release(TVMFFIAny* result) {
  if (result->type_index >= kTVMFFIStaticObjectBegin && result->v_obj != nullptr) {
    TVMFFIObjectDecRef(result->v_obj);
  }
}

ffi::Error run(void* stream, int32_t device, float eps, float offset, int64_t grid,
               ffi::RemainingArgs args, ffi::RemainingRets rets) {
  if (args.size() != kOperands || rets.size() != kResults) {
    return ffi::Error::InvalidArgument(
        std::string("tilenorm: the CuTe DSL ") + kKernel + "'s call has other operands or "
        "results than its compiled variant (" + std::to_string(kOperands) + " and " +
        std::to_string(kResults) + ")");
  }
  // The call's operands, then its results, in the entry's order; null where the variant
  // has none.
  TensorView views[kArrays];
  TVMFFIAny call_args[kArrays + 3];
  size_t next_operand = 0, next_result = 0;
  for (int slot = 0; slot < kArrays; ++slot) {
    TensorView* view = nullptr;
    if (kSlots[slot] == kOperand) {
      auto buffer = args.get<ffi::AnyBuffer>(next_operand++);
      if (buffer.has_error()) return buffer.error();
      ffi::Error error = make_view(*buffer, device, &views[slot]);
      if (error.failure()) return error;
      view = &views[slot];
    } else if (kSlots[slot] == kResult) {
      auto buffer = rets.get<ffi::AnyBuffer>(next_result++);
      if (buffer.has_error()) return buffer.error();
      ffi::Error error = make_view(**buffer, device, &views[slot]);
      if (error.failure()) return error;
      view = &views[slot];
    }
    call_args[slot] = tensor_arg(view);
  }
  int next = kArrays;
  if (kTakesEps) call_args[next++] = float_arg(eps);
  call_args[next++] = float_arg(offset);
  call_args[next++] = int_arg(grid);

  // The exported code launches on TVM-FFI's stream of x's device (TVMFFIEnvGetStream): set
  // it to XLA's for the call and put back what was there (a torch call on this thread
  // sets its own).
  TVMFFIStreamHandle previous = nullptr;
  if (TVMFFIEnvSetStream(kDLCUDA, device, stream, &previous) != 0) {
    return ffi::Error::Internal("tilenorm: setting TVM-FFI's stream failed: " +
                                raised_error());
  }
  TVMFFIAny result = none();
  const int failed = TILENORM_CUTE_ENTRY(nullptr, call_args, kArrays + kScalars, &result);
  std::string message;
  if (failed) {
    message = raised_error();
  } else {
    release(&result);
  }
  TVMFFIEnvSetStream(kDLCUDA, device, previous, nullptr);
  if (failed) {
    return ffi::Error::Internal(std::string("tilenorm: the CuTe DSL ") + kKernel +
                                " failed: " + message);
  }
  calls_run.fetch_add(1, std::memory_order_relaxed);
  return ffi::Error::Success();
}

ffi::Error run_on_cuda(void* stream, int32_t device, float eps, float offset, int64_t grid,
                       ffi::RemainingArgs args, ffi::RemainingRets rets) {
  return run(stream, device, eps, offset, grid, args, rets);
}

// The same call from XLA's CPU backend: no stream and device 0, the arrays host memory
// described as CUDA's. On a machine without a GPU the entry then runs its argument checks
// and stops at loading its kernel (no driver), which lets the CPU tests check every array
// it is given; it is never registered outside them.
ffi::Error run_without_gpu(float eps, float offset, int64_t grid, ffi::RemainingArgs args,
                           ffi::RemainingRets rets) {
  return run(nullptr, 0, eps, offset, grid, args, rets);
}

}  // namespace

// Exported for jax.ffi.pycapsule and ctypes (the library is built with hidden visibility and
// a version script: it exports nothing else, the exported object's symbols included). Every
// call carries eps, offset and grid: an entry without eps (the backward's) is not given it.
#pragma GCC visibility push(default)
XLA_FFI_DEFINE_HANDLER_SYMBOL(tilenorm_cute_call, run_on_cuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<void*>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset")
                                  .Attr<int64_t>("grid")
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(tilenorm_cute_call_without_gpu, run_without_gpu,
                              ffi::Ffi::Bind()
                                  .Attr<float>("eps")
                                  .Attr<float>("offset")
                                  .Attr<int64_t>("grid")
                                  .RemainingArgs()
                                  .RemainingRets());

// How many calls reached the kernel in this process (tests).
extern "C" int64_t tilenorm_cute_calls() {
  return calls_run.load(std::memory_order_relaxed);
}
#pragma GCC visibility pop
