// The prepared calls of tilenorm.pytorch.calls, run in C++: a forward or backward with one
// operand layout allocates its outputs, writes the data pointers into the parameter blocks
// that tilenorm.launch.driver prepared (LaunchRecipe) and calls cuLaunchKernelEx, and the
// autograd node is a C++ one, so that neither a call nor autograd's backward runs Python.
// A Python torch.autograd.Function costs about what torch's whole RMSNorm step does
// (bench/NOTES.md #39); this path is what meets torch's host cost (#40).
//
// Built on first use by tilenorm.pytorch.native against the installed torch; it needs no CUDA
// headers: the driver's entry points are looked up in libcuda and its launch structures are
// declared below.

#include <torch/extension.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <array>
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

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
  TORCH_CHECK(found != nullptr, "tilenorm: libcuda has no ", name);
  return reinterpret_cast<F>(found);
}

const Driver& driver() {
  static const Driver d = [] {
    void* cuda = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    TORCH_CHECK(cuda != nullptr, "tilenorm: cannot open libcuda.so.1");
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

void check(int result, const char* what) {
  if (result == 0) return;
  const char* text = nullptr;
  driver().error_string(result, &text);
  TORCH_CHECK(false, what, " failed: CUDA error ", result, ": ", text ? text : "unknown");
}

// A thread that has made no CUDA runtime call (autograd's backward thread, say) has no current
// context: make the device's primary context (torch's) current, as the runtime would.
void make_primary_context_current(int device_index) {
  const Driver& d = driver();
  int device = 0;
  void* context = nullptr;
  check(d.device_get(&device, device_index), "cuDeviceGet");
  check(d.primary_retain(&context, device), "cuDevicePrimaryCtxRetain");
  int result = d.set_current(context);
  d.primary_release(device);
  check(result, "cuCtxSetCurrent");
}

void* current_stream(const c10::Device& device) {
  static const c10::impl::DeviceGuardImplInterface* cuda =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return cuda->getStreamNativeHandle(cuda->getStream(device));
}

// --- launches --------------------------------------------------------------------------------

// The operands a kernel may take, by the names of the kernels' array parameters.
enum Operand : int {
  kX, kResidual, kWeight, kBias, kY, kResidualOut, kMean, kRstd,
  kDy, kH, kRowSums, kDresIn, kDx, kDres, kPartialW, kPartialB, kPartial, kOutA, kOutB,
  kOperands
};
const std::array<const char*, kOperands> kOperandNames = {
    "x", "residual", "weight", "bias", "y", "residual_out", "mean", "rstd",
    "dy", "h", "row_sums", "dres_in", "dx", "dres", "partial_w", "partial_b", "partial",
    "out_a", "out_b"};
enum Scalar : int { kEps, kOffset, kScalars };
const std::array<const char*, kScalars> kScalarNames = {"eps", "offset"};

template <size_t N>
int index_of(const std::array<const char*, N>& names, const std::string& name) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<int>(i);
  }
  TORCH_CHECK(false, "tilenorm: a kernel parameter no prepared call fills: ", name);
}

constexpr size_t kMaxParamBytes = 4096;
constexpr size_t kMaxParams = 512;

// A tilenorm.launch.driver.LaunchRecipe.
struct Recipe {
  void* kernel = nullptr;
  std::array<unsigned, 3> grid{};
  bool dependent = false;
  std::vector<uint8_t> params;
  std::vector<uint32_t> param_offsets;
  std::vector<std::pair<int, uint32_t>> arrays;
  std::vector<std::pair<int, uint32_t>> scalars;

  static Recipe of(const py::handle& r) {
    Recipe out;
    out.kernel = reinterpret_cast<void*>(r.attr("kernel").cast<uintptr_t>());
    auto grid = r.attr("grid").cast<std::array<unsigned, 3>>();
    out.grid = grid;
    out.dependent = r.attr("dependent_launch").cast<bool>();
    auto params = r.attr("params").cast<std::string>();
    out.params.assign(params.begin(), params.end());
    out.param_offsets = r.attr("param_offsets").cast<std::vector<uint32_t>>();
    TORCH_CHECK(out.params.size() <= kMaxParamBytes && out.param_offsets.size() <= kMaxParams,
                "tilenorm: a kernel with more parameters than the C++ launcher takes");
    for (auto& [name, offset] :
         r.attr("arrays").cast<std::vector<std::pair<std::string, uint32_t>>>()) {
      out.arrays.emplace_back(index_of(kOperandNames, name), offset);
    }
    for (auto& [name, offset] :
         r.attr("scalars").cast<std::vector<std::pair<std::string, uint32_t>>>()) {
      out.scalars.emplace_back(index_of(kScalarNames, name), offset);
    }
    return out;
  }

  // Launch on `stream` with the operands' pointers; false, launching nothing, where one the
  // kernel takes is null or not 16-byte aligned (the layout promised alignment).
  bool launch(void* stream, int device_index, const std::array<uint64_t, kOperands>& pointers,
              const std::array<float, kScalars>& values) const {
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

uint64_t address(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.const_data_ptr()) : 0;
}

bool aligned(const at::Tensor& t) { return !t.defined() || (address(t) & 15) == 0; }

// --- backward --------------------------------------------------------------------------------

// A tilenorm.pytorch.calls.BackwardCall without copies and without the CuTe DSL kernel.
struct BackwardNative : torch::CustomClassHolder {
  bool has_first = false, has_reduce = false;
  Recipe first, row, reduce;
  std::vector<int64_t> row_sums_shape;
  int64_t partial_numel = 0, partial_b_offset = 0;
  at::ScalarType x_dtype;
  bool has_residual = false, split = false, dx_like_h = false;
  at::ScalarType residual_dtype;

  // (dx, dresidual, dweight, dbias); empty where an operand is not 16-byte aligned.
  std::vector<at::Tensor> run(const at::Tensor& dy, const at::Tensor& dres_in,
                              const at::Tensor& h, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& mean,
                              const at::Tensor& rstd, double offset) const {
    auto options = h.options();
    at::Tensor dx = dx_like_h ? at::empty_like(h) : at::empty(h.sizes(), options.dtype(x_dtype));
    at::Tensor dres = split ? at::empty(h.sizes(), options.dtype(residual_dtype)) : at::Tensor();
    at::Tensor dweight = weight.defined() ? at::empty(weight.sizes(), weight.options())
                                          : at::Tensor();
    at::Tensor dbias = bias.defined() ? at::empty(bias.sizes(), bias.options()) : at::Tensor();
    at::Tensor partial = has_reduce ? at::empty({partial_numel}, options.dtype(at::kFloat))
                                    : at::Tensor();
    at::Tensor row_sums = has_first ? at::empty(row_sums_shape, options.dtype(at::kFloat))
                                    : at::Tensor();
    std::array<uint64_t, kOperands> p{};
    p[kDy] = address(dy);
    p[kH] = address(h);
    p[kWeight] = address(weight);
    p[kMean] = address(mean);
    p[kRstd] = address(rstd);
    p[kRowSums] = address(row_sums);
    p[kDresIn] = address(dres_in);
    p[kDx] = address(dx);
    p[kDres] = address(dres);
    p[kPartial] = address(partial);
    p[kPartialW] = weight.defined() ? p[kPartial] : 0;
    p[kPartialB] = bias.defined() ? p[kPartial] + partial_b_offset : 0;
    p[kOutA] = weight.defined() ? address(dweight) : address(dbias);
    p[kOutB] = weight.defined() ? address(dbias) : 0;
    const std::array<float, kScalars> values{0.0f, static_cast<float>(offset)};
    void* stream = current_stream(h.device());
    int device = h.device().index();
    if (has_first && !first.launch(stream, device, p, values)) return {};
    if (!row.launch(stream, device, p, values)) return {};
    if (has_reduce && !reduce.launch(stream, device, p, values)) return {};
    if (has_residual && !split) dres = dx;
    return {dx, dres, dweight, dbias};
  }
};

c10::intrusive_ptr<BackwardNative> make_backward(
    const py::handle& row, const py::handle& first, const py::handle& reduce,
    std::vector<int64_t> row_sums_shape, int64_t partial_numel, int64_t partial_b_offset,
    at::ScalarType x_dtype, std::optional<at::ScalarType> residual_dtype, bool split,
    bool dx_like_h) {
  auto b = c10::make_intrusive<BackwardNative>();
  b->row = Recipe::of(row);
  b->has_first = !first.is_none();
  if (b->has_first) b->first = Recipe::of(first);
  b->has_reduce = !reduce.is_none();
  if (b->has_reduce) b->reduce = Recipe::of(reduce);
  b->row_sums_shape = std::move(row_sums_shape);
  b->partial_numel = partial_numel;
  b->partial_b_offset = partial_b_offset;
  b->x_dtype = x_dtype;
  b->has_residual = residual_dtype.has_value();
  b->residual_dtype = residual_dtype.value_or(x_dtype);
  b->split = split;
  b->dx_like_h = dx_like_h;
  return b;
}

// --- forward ---------------------------------------------------------------------------------

// A tilenorm.pytorch.calls.ForwardCall without copies, with the backwards of its outputs'
// dense gradients once autograd needs them (attach_backward).
struct ForwardNative : torch::CustomClassHolder {
  Recipe recipe;
  std::vector<int64_t> out_shape, stat_shape;
  at::ScalarType out_dtype;
  bool has_mean = false, has_residual = false, y_like_x = false;
  at::ScalarType h_dtype;
  // By whether the gradient of h (the residual stream) reaches the node.
  c10::intrusive_ptr<BackwardNative> backward, backward_dh;

  // (y, h, mean, rstd); empty where an operand is not 16-byte aligned.
  std::vector<at::Tensor> run(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& residual, double eps,
                              double offset) const {
    auto options = x.options();
    at::Tensor y = y_like_x ? at::empty_like(x) : at::empty(out_shape, options.dtype(out_dtype));
    at::Tensor rstd = at::empty(stat_shape, options.dtype(at::kFloat));
    at::Tensor mean = has_mean ? at::empty(stat_shape, options.dtype(at::kFloat)) : at::Tensor();
    at::Tensor h = has_residual ? at::empty(out_shape, options.dtype(h_dtype)) : at::Tensor();
    std::array<uint64_t, kOperands> p{};
    p[kX] = address(x);
    p[kResidual] = address(residual);
    p[kWeight] = address(weight);
    p[kBias] = address(bias);
    p[kY] = address(y);
    p[kResidualOut] = address(h);
    p[kMean] = address(mean);
    p[kRstd] = address(rstd);
    const std::array<float, kScalars> values{static_cast<float>(eps), static_cast<float>(offset)};
    if (!recipe.launch(current_stream(x.device()), x.device().index(), p, values)) return {};
    return {y, has_residual ? h : x, mean, rstd};
  }
};

c10::intrusive_ptr<ForwardNative> make_forward(
    const py::handle& recipe, std::vector<int64_t> out_shape, std::vector<int64_t> stat_shape,
    at::ScalarType out_dtype, bool has_mean, std::optional<at::ScalarType> h_dtype,
    bool y_like_x) {
  auto f = c10::make_intrusive<ForwardNative>();
  f->recipe = Recipe::of(recipe);
  f->out_shape = std::move(out_shape);
  f->stat_shape = std::move(stat_shape);
  f->out_dtype = out_dtype;
  f->has_mean = has_mean;
  f->has_residual = h_dtype.has_value();
  f->h_dtype = h_dtype.value_or(out_dtype);
  f->y_like_x = y_like_x;
  return f;
}

// Set once, before the first autograd call through `call`.
void attach_backward(const c10::intrusive_ptr<ForwardNative>& call,
                     const c10::intrusive_ptr<BackwardNative>& backward,
                     const c10::intrusive_ptr<BackwardNative>& backward_dh) {
  call->backward = backward;
  call->backward_dh = backward_dh;
}

// --- autograd --------------------------------------------------------------------------------

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

// A gradient the prepared backward can read: dense (its layout is the output's) and aligned.
at::Tensor dense(const at::Tensor& g) {
  at::Tensor out = g.contiguous();
  return aligned(out) ? out : out.clone();
}

struct NormNode : torch::autograd::Function<NormNode> {
  // Absent operands are empty optionals: autograd records an undefined tensor as an input.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<ForwardNative> call,
                               const at::Tensor& x, const std::optional<at::Tensor>& weight_in,
                               const std::optional<at::Tensor>& bias_in,
                               const std::optional<at::Tensor>& residual_in, double eps,
                               double offset) {
    at::Tensor weight = or_undefined(weight_in), bias = or_undefined(bias_in);
    at::Tensor residual = or_undefined(residual_in);
    auto out = call->run(x, weight, bias, residual, eps, offset);
    TORCH_CHECK(!out.empty(), "tilenorm: operands checked aligned were not");
    const at::Tensor &y = out[0], &h = out[1];
    ctx->save_for_backward({h, weight, bias, out[2], out[3]});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["call"] = c10::IValue::make_capsule(std::move(call));
    ctx->set_materialize_grads(false);
    if (residual.defined()) return {y, h};
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto call = c10::static_intrusive_pointer_cast<ForwardNative>(
        ctx->saved_data["call"].toCapsule());
    double offset = ctx->saved_data["offset"].toDouble();
    auto saved = ctx->get_saved_variables();
    const at::Tensor& h = saved[0];
    at::Tensor dy = grads[0].defined()
                        ? dense(grads[0])
                        : at::zeros(call->out_shape, h.options().dtype(call->out_dtype));
    at::Tensor dh = grads.size() > 1 && grads[1].defined() ? dense(grads[1]) : at::Tensor();
    const auto& backward = dh.defined() ? call->backward_dh : call->backward;
    auto g = backward->run(dy, dh, h, saved[1], saved[2], saved[3], saved[4], offset);
    TORCH_CHECK(!g.empty(), "tilenorm: saved operands are no longer 16-byte aligned");
    // The forward's inputs: call, x, weight, bias, residual, eps, offset.
    return {at::Tensor(), g[0], g[2], g[3], g[1], at::Tensor(), at::Tensor()};
  }
};

bool operands_aligned(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& residual) {
  return aligned(x) && aligned(weight) && aligned(bias) && aligned(residual);
}

// The forward through autograd: y, or (y, h) with a residual; None where an operand is not
// 16-byte aligned (the caller takes the Python path). Needs attach_backward first.
py::object apply(const c10::intrusive_ptr<ForwardNative>& call, const at::Tensor& x,
                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                 const std::optional<at::Tensor>& residual, double eps, double offset) {
  at::Tensor w = or_undefined(weight), b = or_undefined(bias), r = or_undefined(residual);
  if (!call->backward || !operands_aligned(x, w, b, r)) return py::none();
  auto out = NormNode::apply(call, x, weight, bias, residual, eps, offset);
  if (out.size() == 1) return py::cast(out[0]);
  return py::make_tuple(out[0], out[1]);
}

// The forward without autograd: (y, h, mean, rstd), or None as in apply.
py::object forward(const c10::intrusive_ptr<ForwardNative>& call, const at::Tensor& x,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual, double eps, double offset) {
  at::Tensor w = or_undefined(weight), b = or_undefined(bias), r = or_undefined(residual);
  if (!operands_aligned(x, w, b, r)) return py::none();
  auto out = call->run(x, w, b, r, eps, offset);
  if (out.empty()) return py::none();
  return py::make_tuple(out[0], out[1], out[2], out[3]);
}

// The backward without autograd: (dx, dresidual, dweight, dbias), or None where an operand is
// not 16-byte aligned.
py::object backward(const c10::intrusive_ptr<BackwardNative>& call, const at::Tensor& dy,
                    const std::optional<at::Tensor>& dres_in, const at::Tensor& h,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double offset) {
  auto g = call->run(dy, or_undefined(dres_in), h, or_undefined(weight), or_undefined(bias),
                     or_undefined(mean), rstd, offset);
  if (g.empty()) return py::none();
  return py::make_tuple(g[0], g[1], g[2], g[3]);
}

// The layout of the operands as a cache key: each one's dims, sizes, strides, dtype and
// device (None marked as such), the same information as tilenorm.pytorch.calls.layouts in
// a quarter of its host time. TypeError for an operand that is neither a tensor nor None.
py::bytes layout_key(const py::args& operands) {
  std::string key;
  key.reserve(32 * 8 * operands.size());
  auto put = [&key](int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); };
  for (const py::handle& operand : operands) {
    if (operand.is_none()) {
      put(-1);
      continue;
    }
    if (!THPVariable_Check(operand.ptr())) throw py::type_error("not a tensor");
    const at::Tensor& t = THPVariable_Unpack(operand.ptr());
    put(t.dim());
    for (int64_t v : t.sizes()) put(v);
    for (int64_t v : t.strides()) put(v);
    put(static_cast<int64_t>(t.scalar_type()));
    put(static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() & 0xffff));
  }
  return py::bytes(key);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<BackwardNative, c10::intrusive_ptr<BackwardNative>>(m, "BackwardNative");
  py::class_<ForwardNative, c10::intrusive_ptr<ForwardNative>>(m, "ForwardNative");
  m.def("make_backward", &make_backward);
  m.def("make_forward", &make_forward);
  m.def("attach_backward", &attach_backward);
  m.def("apply", &apply);
  m.def("forward", &forward);
  m.def("backward", &backward);
  m.def("layout_key", &layout_key);
}
