// The prepared calls of tilenorm.pytorch.calls, run in C++: a forward or backward with one
// operand layout allocates its outputs, writes the data pointers into the parameter blocks
// that tilenorm.launch.driver prepared (LaunchRecipe) and calls cuLaunchKernelEx, and the
// autograd node is a C++ one, so that neither a call nor autograd's backward runs Python; an
// eager call whose arguments were seen before finds its prepared call here too (the call
// cache). A Python torch.autograd.Function costs about what torch's whole RMSNorm step does
// (bench/NOTES.md #39); this path is what meets torch's host cost (#40, #42).
//
// Built on first use by tilenorm.pytorch.native against the installed torch; it needs no CUDA
// headers: the launch itself is tilenorm/launch/recipe.h's, shared with the JAX launcher.

#include <torch/extension.h>

#include "recipe.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;
using torch::autograd::variable_list;

using tilenorm::launch::Recipe;

void* current_stream(const c10::Device& device) {
  static const c10::impl::DeviceGuardImplInterface* cuda =
      c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return cuda->getStreamNativeHandle(cuda->getStream(device));
}

// --- launches --------------------------------------------------------------------------------

// The operands a kernel may take, by the names of the kernels' array parameters.
enum Operand : int {
  kX, kResidual, kWeight, kBias, kY, kResidualOut, kMean, kRstd,
  kDy, kDy2, kDy3, kH, kRowSums, kDresIn, kDx, kDres, kPartialW, kPartialB, kPartial, kOutA,
  kOutB, kOperands
};
const std::array<const char*, kOperands> kOperandNames = {
    "x", "residual", "weight", "bias", "y", "residual_out", "mean", "rstd",
    "dy", "dy2", "dy3", "h", "row_sums", "dres_in", "dx", "dres", "partial_w", "partial_b",
    "partial", "out_a", "out_b"};
enum Scalar : int { kEps, kOffset, kScalars };
const std::array<const char*, kScalars> kScalarNames = {"eps", "offset"};

template <size_t N>
int index_of(const std::array<const char*, N>& names, const std::string& name) {
  for (size_t i = 0; i < N; ++i) {
    if (name == names[i]) return static_cast<int>(i);
  }
  TORCH_CHECK(false, "tilenorm: a kernel parameter no prepared call fills: ", name);
}

// A tilenorm.launch.driver.LaunchRecipe, its names resolved to the operand and scalar tables.
Recipe recipe_of(const py::handle& r) {
  Recipe out;
  out.kernel = reinterpret_cast<void*>(r.attr("kernel").cast<uintptr_t>());
  out.grid = r.attr("grid").cast<std::array<unsigned, 3>>();
  out.dependent = r.attr("dependent_launch").cast<bool>();
  auto params = r.attr("params").cast<std::string>();
  out.params.assign(params.begin(), params.end());
  out.param_offsets = r.attr("param_offsets").cast<std::vector<uint32_t>>();
  TORCH_CHECK(out.fits(), "tilenorm: a kernel with more parameters than the C++ launcher takes");
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

uint64_t address(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<uint64_t>(t.const_data_ptr()) : 0;
}

bool aligned(const at::Tensor& t) { return !t.defined() || (address(t) & 15) == 0; }

bool operands_aligned(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                      const at::Tensor& residual) {
  return aligned(x) && aligned(weight) && aligned(bias) && aligned(residual);
}

// --- backward --------------------------------------------------------------------------------

// A tilenorm.pytorch.calls.BackwardCall without the CuTe DSL kernel.
struct BackwardNative : torch::CustomClassHolder {
  bool has_first = false, has_reduce = false;
  Recipe first, row, reduce;
  std::vector<int64_t> row_sums_shape;
  // The kernels' (rows, heads, cols) shape, and which operands they read from contiguous
  // copies in it: those with no view there (tilenorm.pytorch.calls.operand_views); in the
  // order dy, h, dres_in, dy2, dy3.
  std::vector<int64_t> shape3;
  std::array<bool, 5> copy{};
  // In how many parts y's gradient comes (dy, dy2, dy3: a compiled graph's, which the
  // kernels add up).
  int64_t dy_terms = 1;
  int64_t partial_numel = 0, partial_b_offset = 0;
  at::ScalarType x_dtype;
  bool has_residual = false, split = false, dx_like_h = false;
  at::ScalarType residual_dtype;

  // (dx, dresidual, dweight, dbias); empty where an operand is not 16-byte aligned.
  std::vector<at::Tensor> run(const at::Tensor& dy, const at::Tensor& dres_in,
                              const at::Tensor& h, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& mean,
                              const at::Tensor& rstd, double offset,
                              const at::Tensor& dy2 = at::Tensor(),
                              const at::Tensor& dy3 = at::Tensor()) const {
    TORCH_CHECK(dy2.defined() + dy3.defined() + 1 == dy_terms,
                "tilenorm: a backward prepared for ", dy_terms, " parts of y's gradient");
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
    auto read = [&](const at::Tensor& t, bool copy) {
      return copy && t.defined() ? t.reshape(shape3).contiguous() : t;
    };
    const at::Tensor dy_read = read(dy, copy[0]), h_read = read(h, copy[1]),
                     dres_in_read = read(dres_in, copy[2]), dy2_read = read(dy2, copy[3]),
                     dy3_read = read(dy3, copy[4]);
    std::array<uint64_t, kOperands> p{};
    p[kDy] = address(dy_read);
    p[kDy2] = address(dy2_read);
    p[kDy3] = address(dy3_read);
    p[kH] = address(h_read);
    p[kWeight] = address(weight);
    p[kMean] = address(mean);
    p[kRstd] = address(rstd);
    p[kRowSums] = address(row_sums);
    p[kDresIn] = address(dres_in_read);
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
    if (has_first && !first.launch(stream, device, p.data(), values.data())) return {};
    if (!row.launch(stream, device, p.data(), values.data())) return {};
    if (has_reduce && !reduce.launch(stream, device, p.data(), values.data())) return {};
    if (has_residual && !split) dres = dx;
    return {dx, dres, dweight, dbias};
  }
};

c10::intrusive_ptr<BackwardNative> make_backward(
    const py::handle& row, const py::handle& first, const py::handle& reduce,
    std::vector<int64_t> row_sums_shape, int64_t partial_numel, int64_t partial_b_offset,
    at::ScalarType x_dtype, std::optional<at::ScalarType> residual_dtype, bool split,
    bool dx_like_h, std::vector<int64_t> shape3, std::vector<bool> copy, int64_t dy_terms) {
  auto b = c10::make_intrusive<BackwardNative>();
  b->shape3 = std::move(shape3);
  TORCH_CHECK(copy.size() == b->copy.size(), "tilenorm: a copy flag per backward operand");
  std::copy(copy.begin(), copy.end(), b->copy.begin());
  b->dy_terms = dy_terms;
  b->row = recipe_of(row);
  b->has_first = !first.is_none();
  if (b->has_first) b->first = recipe_of(first);
  b->has_reduce = !reduce.is_none();
  if (b->has_reduce) b->reduce = recipe_of(reduce);
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

  // (y, h, mean, rstd); empty, allocating nothing, where an operand is not 16-byte aligned.
  std::vector<at::Tensor> run(const at::Tensor& x, const at::Tensor& weight,
                              const at::Tensor& bias, const at::Tensor& residual, double eps,
                              double offset) const {
    if (!operands_aligned(x, weight, bias, residual)) return {};
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
    if (!recipe.launch(current_stream(x.device()), x.device().index(), p.data(),
                       values.data())) return {};
    return {y, has_residual ? h : x, mean, rstd};
  }
};

c10::intrusive_ptr<ForwardNative> make_forward(
    const py::handle& recipe, std::vector<int64_t> out_shape, std::vector<int64_t> stat_shape,
    at::ScalarType out_dtype, bool has_mean, std::optional<at::ScalarType> h_dtype,
    bool y_like_x) {
  auto f = c10::make_intrusive<ForwardNative>();
  f->recipe = recipe_of(recipe);
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

using torch::autograd::Node;
// The pointer autograd holds nodes by: std::shared_ptr up to torch 2.12, c10::intrusive_ptr
// from 2.13 on.
using NodePtr = decltype(torch::autograd::Edge::function);

template <typename T>
NodePtr new_node() {
  if constexpr (std::is_same_v<NodePtr, std::shared_ptr<Node>>) {
    // deleteNode (found by argument-dependent lookup, as T is a Node) frees long chains of
    // nodes without deep recursion.
    return NodePtr(new T(), [](T* node) { deleteNode(node); });
  } else {
    return c10::make_intrusive<T>();
  }
}

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

// A gradient the prepared backward can read: dense (its layout is the output's) and aligned.
at::Tensor dense(const at::Tensor& g) {
  at::Tensor out = g.contiguous();
  return aligned(out) ? out : out.clone();
}

// What both backward nodes below save; autograd releases it after a backward.
struct SavesOperands : Node {
  torch::autograd::SavedVariable h, weight, bias, mean, rstd;

  void release_variables() override {
    h.reset_data();
    weight.reset_data();
    bias.reset_data();
    mean.reset_data();
    rstd.reset_data();
  }
};

// The backward of one forward call, written as a plain autograd node rather than a
// torch::autograd::Function, whose generic bookkeeping (input and output metadata, a
// name-keyed map of saved values, output wrapping) costs more host time than the launches
// (bench/NOTES.md #42). Saved tensors are SavedVariables: in-place modification is caught,
// saved-tensor hooks (activation checkpointing, offloading) see them, and the graph frees
// them after a backward.
struct NormBackward : SavesOperands {
  c10::intrusive_ptr<ForwardNative> call;
  double offset = 0.0;

  std::string name() const override { return "tilenorm::NormBackward"; }

  // Inputs: the gradients of y and, with a residual, of h. Outputs, in the order of the next
  // edges: the gradients of x, weight, bias and residual.
  variable_list apply(variable_list&& grads) override {
    NodePtr self = getptr();
    at::Tensor saved_h = h.unpack(self);
    at::Tensor dy = grads[0].defined()
                        ? dense(grads[0])
                        : at::zeros(call->out_shape, saved_h.options().dtype(call->out_dtype));
    at::Tensor dh = grads.size() > 1 && grads[1].defined() ? dense(grads[1]) : at::Tensor();
    const auto& backward = dh.defined() ? call->backward_dh : call->backward;
    auto g = backward->run(dy, dh, saved_h, weight.unpack(self), bias.unpack(self),
                           mean.unpack(self), rstd.unpack(self), offset);
    TORCH_CHECK(!g.empty(), "tilenorm: saved operands are no longer 16-byte aligned");
    return {g[0], g[2], g[3], g[1]};
  }
};

// The forward through autograd: (y, h), h being x without a residual; empty where an
// operand is not 16-byte aligned (the caller takes the Python path). Needs attach_backward
// first.
std::vector<at::Tensor> autograd_forward(const c10::intrusive_ptr<ForwardNative>& call,
                                         const at::Tensor& x, const at::Tensor& weight,
                                         const at::Tensor& bias, const at::Tensor& residual,
                                         double eps, double offset) {
  if (!call->backward) return {};
  auto out = call->run(x, weight, bias, residual, eps, offset);
  if (out.empty()) return {};
  at::Tensor &y = out[0], &h = out[1];
  auto node = new_node<NormBackward>();
  auto* backward = static_cast<NormBackward*>(node.get());
  backward->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, residual));
  torch::autograd::create_gradient_edge(y, node);
  if (residual.defined()) torch::autograd::create_gradient_edge(h, node);
  backward->call = call;
  backward->offset = offset;
  backward->h = torch::autograd::SavedVariable(h, /*is_output=*/residual.defined());
  backward->weight = torch::autograd::SavedVariable(weight, false);
  backward->bias = torch::autograd::SavedVariable(bias, false);
  backward->mean = torch::autograd::SavedVariable(out[2], false);
  backward->rstd = torch::autograd::SavedVariable(out[3], false);
  return {y, h};
}

// As autograd_forward: y, or (y, h) with a residual; None where autograd_forward is empty.
py::object apply(const c10::intrusive_ptr<ForwardNative>& call, const at::Tensor& x,
                 const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                 const std::optional<at::Tensor>& residual, double eps, double offset) {
  auto out = autograd_forward(call, x, or_undefined(weight), or_undefined(bias),
                              or_undefined(residual), eps, offset);
  if (out.empty()) return py::none();
  if (!residual) return py::cast(out[0]);
  return py::make_tuple(out[0], out[1]);
}

// The forward without autograd: (y, h, mean, rstd), or None as in apply.
py::object forward(const c10::intrusive_ptr<ForwardNative>& call, const at::Tensor& x,
                   const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                   const std::optional<at::Tensor>& residual, double eps, double offset) {
  auto out = call->run(x, or_undefined(weight), or_undefined(bias), or_undefined(residual), eps,
                       offset);
  if (out.empty()) return py::none();
  return py::make_tuple(out[0], out[1], out[2], out[3]);
}

// The backward without autograd: (dx, dresidual, dweight, dbias), or None where an operand is
// not 16-byte aligned.
py::object backward(const c10::intrusive_ptr<BackwardNative>& call, const at::Tensor& dy,
                    const std::optional<at::Tensor>& dres_in, const at::Tensor& h,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double offset,
                    const std::optional<at::Tensor>& dy2, const std::optional<at::Tensor>& dy3) {
  auto g = call->run(dy, or_undefined(dres_in), h, or_undefined(weight), or_undefined(bias),
                     or_undefined(mean), rstd, offset, or_undefined(dy2), or_undefined(dy3));
  if (g.empty()) return py::none();
  return py::make_tuple(g[0], g[1], g[2], g[3]);
}

// --- cache keys ------------------------------------------------------------------------------

void put(std::string& key, int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

void put_double(std::string& key, double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put(key, bits);
}

// A tensor's dims, sizes, strides, dtype and device.
void put_tensor(std::string& key, const at::Tensor& t) {
  put(key, t.dim());
  for (int64_t v : t.sizes()) put(key, v);
  for (int64_t v : t.strides()) put(key, v);
  put(key, static_cast<int64_t>(t.scalar_type()));
  put(key, static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() & 0xffff));
}

// A tensor's layout as put_tensor, or -1 for None; false for anything else.
bool put_operand(std::string& key, PyObject* operand) {
  if (operand == Py_None) {
    put(key, -1);
    return true;
  }
  if (!THPVariable_Check(operand)) return false;
  put_tensor(key, THPVariable_Unpack(operand));
  return true;
}

// The layout of the operands as a cache key: each one's dims, sizes, strides, dtype and
// device (None marked as such), the same information as tilenorm.pytorch.calls.layouts in
// a quarter of its host time. TypeError for an operand that is neither a tensor nor None.
py::bytes layout_key(const py::args& operands) {
  std::string key;
  key.reserve(32 * 8 * operands.size());
  for (const py::handle& operand : operands) {
    if (!put_operand(key, operand.ptr())) throw py::type_error("not a tensor");
  }
  return py::bytes(key);
}

// --- the call cache ----------------------------------------------------------------------------

// Prepared calls by key, bounded as tilenorm.pytorch.calls is (past its size it starts over).
// The custom ops' kernels below run on any thread (autograd's backward threads included)
// without the GIL: a shared lock to find, an exclusive one to change.
template <typename Value>
struct CallCache {
  static constexpr size_t kMaxCalls = 4096;  // tilenorm.pytorch.calls.MAX_CALLS
  std::shared_mutex mutex;
  std::unordered_map<std::string, Value> calls;

  std::optional<Value> find(const std::string& key) {
    if (key.empty()) return std::nullopt;
    std::shared_lock lock(mutex);
    auto found = calls.find(key);
    if (found == calls.end()) return std::nullopt;
    return found->second;
  }

  void insert(const std::string& key, Value value) {
    std::unique_lock lock(mutex);
    if (calls.size() >= kMaxCalls) calls.clear();
    calls[key] = std::move(value);
  }

  void clear() {
    std::unique_lock lock(mutex);
    calls.clear();
  }
};

// An eager call whose arguments were seen before goes from them to its prepared call here,
// in C++: tilenorm.pytorch.functional looks up and checks in Python only the first time
// (bench/NOTES.md #42). The key is every argument of the call as given, plus the state the
// Python path reads besides them (CUDA autocast); Python clears the cache when the set of
// kernels allowed changes (tilenorm.set_experimental).
struct CachedCall {
  c10::intrusive_ptr<ForwardNative> call;
  double eps = 0.0, offset = 0.0;
  bool prenorm = false;
};

CallCache<CachedCall>& cached_calls() {
  static CallCache<CachedCall> calls;
  return calls;
}

// A number (not a bool) as a double after a tag of 1; None as a tag of 0.
bool put_number(std::string& key, PyObject* v) {
  double value;
  if (v == Py_None) {
    put(key, 0);
    return true;
  }
  if (PyFloat_CheckExact(v)) {
    value = PyFloat_AS_DOUBLE(v);
  } else if (PyLong_CheckExact(v)) {
    value = PyLong_AsDouble(v);
    if (value == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
  } else {
    return false;
  }
  put(key, 1);
  put_double(key, value);
  return true;
}

bool put_int(std::string& key, PyObject* v) {
  if (!PyLong_CheckExact(v)) return false;
  int overflow = 0;
  int64_t value = PyLong_AsLongLongAndOverflow(v, &overflow);
  if (overflow || (value == -1 && PyErr_Occurred())) {
    PyErr_Clear();
    return false;
  }
  put(key, value);
  return true;
}

// None, an int, or a tuple or list of ints (torch.Size included).
bool put_shape(std::string& key, PyObject* v) {
  if (v == Py_None) {
    put(key, -1);
    return true;
  }
  if (PyLong_CheckExact(v)) {
    put(key, 1);
    return put_int(key, v);
  }
  if (!PyTuple_Check(v) && !PyList_Check(v)) return false;
  PyObject* items = PySequence_Fast(v, "");
  if (items == nullptr) {
    PyErr_Clear();
    return false;
  }
  Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
  put(key, n);
  bool ok = true;
  for (Py_ssize_t i = 0; ok && i < n; ++i) ok = put_int(key, PySequence_Fast_GET_ITEM(items, i));
  Py_DECREF(items);
  return ok;
}

bool put_flag(std::string& key, PyObject* v) {
  if (!PyBool_Check(v)) return false;
  put(key, v == Py_True);
  return true;
}

bool put_dtype(std::string& key, PyObject* v) {
  if (v == Py_None) {
    put(key, -1);
    return true;
  }
  if (!THPDtype_Check(v)) return false;
  put(key, static_cast<int64_t>(reinterpret_cast<THPDtype*>(v)->scalar_type));
  return true;
}

// The arguments of tilenorm.pytorch.functional._apply, in its order.
struct CallArguments {
  py::handle op, x, weight, bias, eps, normalized_shape, per_head, offset, residual, prenorm,
      residual_dtype, out_dtype;

  // False where an argument is of a type the key does not encode (the Python path decides).
  bool key(std::string& key) const {
    if (!PyUnicode_CheckExact(op.ptr())) return false;
    Py_ssize_t size = 0;
    const char* name = PyUnicode_AsUTF8AndSize(op.ptr(), &size);
    if (name == nullptr) {
      PyErr_Clear();
      return false;
    }
    key.reserve(512);
    key.append(name, size);
    put(key, at::autocast::is_autocast_enabled(at::kCUDA));
    return put_operand(key, x.ptr()) && put_operand(key, weight.ptr()) &&
           put_operand(key, bias.ptr()) && put_operand(key, residual.ptr()) &&
           put_number(key, eps.ptr()) && put_number(key, offset.ptr()) &&
           put_shape(key, normalized_shape.ptr()) && put_flag(key, per_head.ptr()) &&
           put_flag(key, prenorm.ptr()) && put_dtype(key, residual_dtype.ptr()) &&
           put_dtype(key, out_dtype.ptr());
  }
};

const at::Tensor& tensor_or_undefined(py::handle t) {
  static const at::Tensor undefined;
  return t.is_none() ? undefined : THPVariable_Unpack(t.ptr());
}

// The call for arguments seen before, run: y, or (y, h) with prenorm; None where they were not
// seen (or an operand is not 16-byte aligned, or the call needs autograd and its backward is
// not attached yet): the Python path runs then.
py::object cached_call(py::handle op, py::handle x, py::handle weight, py::handle bias,
                       py::handle eps, py::handle normalized_shape, py::handle per_head,
                       py::handle offset, py::handle residual, py::handle prenorm,
                       py::handle residual_dtype, py::handle out_dtype) {
  CallArguments args{op, x, weight, bias, eps, normalized_shape, per_head, offset, residual,
                     prenorm, residual_dtype, out_dtype};
  std::string key;
  if (!args.key(key)) return py::none();
  auto cached = cached_calls().find(key);
  if (!cached) return py::none();
  const at::Tensor &xt = tensor_or_undefined(x), &w = tensor_or_undefined(weight),
                   &b = tensor_or_undefined(bias), &r = tensor_or_undefined(residual);
  bool grad = at::GradMode::is_enabled() &&
              (xt.requires_grad() || (w.defined() && w.requires_grad()) ||
               (b.defined() && b.requires_grad()) || (r.defined() && r.requires_grad()));
  auto out = grad ? autograd_forward(cached->call, xt, w, b, r, cached->eps, cached->offset)
                  : cached->call->run(xt, w, b, r, cached->eps, cached->offset);
  if (out.empty()) return py::none();
  if (cached->prenorm) return py::make_tuple(out[0], out[1]);
  return py::cast(out[0]);
}

// Remember the prepared call (its eps and offset as checked) for these arguments; false
// where they cannot be a key.
bool remember_call(py::handle op, py::handle x, py::handle weight, py::handle bias,
                   py::handle eps, py::handle normalized_shape, py::handle per_head,
                   py::handle offset, py::handle residual, py::handle prenorm,
                   py::handle residual_dtype, py::handle out_dtype,
                   const c10::intrusive_ptr<ForwardNative>& call, double checked_eps,
                   double checked_offset) {
  CallArguments args{op, x, weight, bias, eps, normalized_shape, per_head, offset, residual,
                     prenorm, residual_dtype, out_dtype};
  std::string key;
  if (!args.key(key)) return false;
  cached_calls().insert(key,
                        CachedCall{call, checked_eps, checked_offset, prenorm.ptr() == Py_True});
  return true;
}

// --- the custom ops' CUDA kernels ---------------------------------------------------------------

// tilenorm::norm_fwd and norm_bwd (tilenorm.pytorch.custom_ops) are what a graph compiled by
// torch.compile calls. Their Python implementation, a boxed Python kernel behind the
// dispatcher, costs several times a launch (bench/NOTES.md #43); these boxed C++ kernels for
// CUDA tensors take precedence over it (it is registered as CompositeExplicitAutograd) and
// run a prepared call seen before by the layouts and values of the op's arguments. The
// first call with new arguments, and any call the C++ path does not run (the reference
// path, copies, the CuTe DSL backward, unaligned operands), goes to the Python
// implementation (set_op_fallbacks), which also hands back the prepared call's C++ twin to
// remember.

struct OpFallbacks {
  PyObject* forward = nullptr;  // never released: the kernels may run until the process ends
  PyObject* backward = nullptr;
};
OpFallbacks& op_fallbacks() {
  static OpFallbacks fallbacks;
  return fallbacks;
}

void set_op_fallbacks(py::handle forward, py::handle backward) {
  Py_XINCREF(forward.ptr());
  Py_XINCREF(backward.ptr());
  op_fallbacks() = OpFallbacks{forward.ptr(), backward.ptr()};
}

template <typename Native>
CallCache<c10::intrusive_ptr<Native>>& op_calls() {
  static CallCache<c10::intrusive_ptr<Native>> calls;
  return calls;
}

// Every argument, tagged by its kind; false where one is of a kind the key does not take.
bool op_key(std::string& key, c10::ArrayRef<c10::IValue> args) {
  key.reserve(512);
  for (const c10::IValue& v : args) {
    if (v.isNone()) {
      put(key, -1);
    } else if (v.isTensor()) {
      put(key, -2);
      put_tensor(key, v.toTensor());
    } else if (v.isDouble()) {
      put(key, -3);
      put_double(key, v.toDouble());
    } else if (v.isBool()) {
      put(key, -4);
      put(key, v.toBool());
    } else if (v.isInt()) {
      put(key, -5);
      put(key, v.toInt());
    } else if (v.isSymInt() && v.toSymInt().maybe_as_int()) {
      put(key, -5);
      put(key, *v.toSymInt().maybe_as_int());
    } else {
      return false;
    }
  }
  return true;
}

const at::Tensor& optional_tensor(const c10::IValue& v) {
  static const at::Tensor undefined;
  return v.isNone() ? undefined : v.toTensor();
}

// An absent output: no elements, t's dtype and device (the ops' Python implementation's too).
at::Tensor absent_like(const at::Tensor& t) { return at::empty({0}, t.options()); }

bool is_dtype(const c10::TypePtr& type) {
  if (auto optional = type->cast<c10::OptionalType>()) return is_dtype(optional->getElementType());
  return type->kind() == c10::TypeKind::ScalarTypeType;
}

// An argument as Python sees it: a dtype where the schema says so (the stack holds an int;
// the argument's type() says int, its real_type() ScalarType).
py::object to_python(const c10::IValue& v, const c10::Argument& argument) {
  if (v.isInt() && is_dtype(argument.real_type())) {
    return py::reinterpret_borrow<py::object>(
        reinterpret_cast<PyObject*>(torch::getTHPDtype(static_cast<at::ScalarType>(v.toInt()))));
  }
  return torch::jit::toPyObject(v);
}

// Runs the Python implementation on the op's arguments (the stack's last `count`), replaces
// them with its outputs and remembers the C++ twin it hands back under `key` (none where it
// hands back None or the key is empty). Python objects live only while the GIL is held.
template <typename Native>
void run_fallback(PyObject* fallback, const c10::OperatorHandle& op, torch::jit::Stack* stack,
                  size_t count, const std::string& key) {
  TORCH_CHECK(fallback != nullptr, "tilenorm: the custom ops' Python implementation is not set");
  py::gil_scoped_acquire gil;
  auto args = torch::jit::last(*stack, count);
  const auto& arguments = op.schema().arguments();
  py::tuple py_args(count);
  for (size_t i = 0; i < count; ++i) py_args[i] = to_python(args[i], arguments[i]);
  py::tuple result = py::reinterpret_borrow<py::object>(fallback)(*py_args);
  py::tuple outputs = result[0];
  torch::jit::drop(*stack, count);
  for (const py::handle& t : outputs) stack->emplace_back(THPVariable_Unpack(t.ptr()));
  py::object native = result[1];
  if (!key.empty() && !native.is_none()) {
    op_calls<Native>().insert(key, native.cast<c10::intrusive_ptr<Native>>());
  }
}

// norm_fwd(x, weight, bias, residual, eps, offset, layer_norm, dims, per_head, out_dtype,
// residual_dtype) -> (y, h, mean, rstd); h and mean empty where absent.
void norm_fwd_cuda(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 11;
  auto args = torch::jit::last(*stack, kArgs);
  std::string key;
  if (!op_key(key, args)) key.clear();
  if (auto found = op_calls<ForwardNative>().find(key)) {
    const at::Tensor& x = args[0].toTensor();
    const at::Tensor &w = optional_tensor(args[1]), &b = optional_tensor(args[2]),
                     &r = optional_tensor(args[3]);
    auto out = (*found)->run(x, w, b, r, args[4].toDouble(), args[5].toDouble());
    if (!out.empty()) {
      at::Tensor h = r.defined() ? out[1].contiguous() : absent_like(x);
      at::Tensor mean = out[2].defined() ? out[2] : absent_like(out[3]);
      at::Tensor y = out[0].contiguous(), rstd = out[3];
      torch::jit::drop(*stack, kArgs);
      torch::jit::push(*stack, std::move(y), std::move(h), std::move(mean), std::move(rstd));
      return;
    }
  }
  run_fallback<ForwardNative>(op_fallbacks().forward, op, stack, kArgs, key);
}

// norm_bwd(dy, dres_in, h, weight, bias, mean, rstd, offset, dims, per_head, x_dtype,
// residual_dtype, dy2, dy3) -> (dx, dres, dweight, dbias); absent ones empty (dres too where
// it would be dx), none aliasing another.
void norm_bwd_cuda(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  constexpr size_t kArgs = 14;
  auto args = torch::jit::last(*stack, kArgs);
  std::string key;
  if (!op_key(key, args)) key.clear();
  if (auto found = op_calls<BackwardNative>().find(key)) {
    const at::Tensor &dy = args[0].toTensor(), &h = args[2].toTensor();
    auto g = (*found)->run(dy, optional_tensor(args[1]), h, optional_tensor(args[3]),
                           optional_tensor(args[4]), optional_tensor(args[5]),
                           args[6].toTensor(), args[7].toDouble(), optional_tensor(args[12]),
                           optional_tensor(args[13]));
    if (!g.empty()) {
      at::Tensor dx = g[0];
      at::Tensor dres = !g[1].defined() || g[1].is_same(dx) ? absent_like(dx) : g[1];
      at::Tensor dweight = g[2].defined() ? g[2] : absent_like(dx);
      at::Tensor dbias = g[3].defined() ? g[3] : absent_like(dx);
      torch::jit::drop(*stack, kArgs);
      torch::jit::push(*stack, std::move(dx), std::move(dres), std::move(dweight),
                       std::move(dbias));
      return;
    }
  }
  run_fallback<BackwardNative>(op_fallbacks().backward, op, stack, kArgs, key);
}

// --- the custom ops' autograd for CUDA tensors -----------------------------------------------

// torch.library.custom_op registers a Python autograd kernel at the Autograd alias key, and a
// compiled graph's every call passes it, grad mode on or off (bench/NOTES.md #43). These C++
// ones, registered at AutogradCUDA, take precedence for CUDA tensors; the Python one stays
// for other devices and where this module is not built. Same formula as
// tilenorm.pytorch.custom_ops._setup_context / _backward.

// The backward of one norm_fwd call: norm_bwd through the dispatcher, so that AOTAutograd
// traces it into a compiled graph's backward as it does the Python formula.
struct NormOpBackward : SavesOperands {
  double offset = 0.0;
  c10::IValue dims;  // SymInt: symbolic while traced with dynamic shapes
  bool per_head = false, has_residual = false;
  at::ScalarType x_dtype, y_dtype, residual_dtype;

  std::string name() const override { return "tilenorm::NormOpBackward"; }

  // Inputs: the gradients of (y, h, mean, rstd). Outputs, in the order of the next edges: the
  // gradients of x, weight, bias and residual.
  variable_list apply(variable_list&& grads) override {
    static const c10::OperatorHandle norm_bwd =
        c10::Dispatcher::singleton().findSchemaOrThrow("tilenorm::norm_bwd", "");
    NodePtr self = getptr();
    at::Tensor saved_h = h.unpack(self), w = weight.unpack(self), b = bias.unpack(self),
               m = mean.unpack(self);
    at::Tensor dy = grads[0].defined() ? grads[0]
                                       : at::zeros(saved_h.sizes(), saved_h.options().dtype(y_dtype));
    auto optional = [](const at::Tensor& t) { return t.defined() ? c10::IValue(t) : c10::IValue(); };
    torch::jit::Stack stack{dy,
                            has_residual ? optional(grads[1]) : c10::IValue(),
                            saved_h,
                            optional(w),
                            optional(b),
                            optional(m),
                            rstd.unpack(self),
                            offset,
                            dims,
                            per_head,
                            static_cast<int64_t>(x_dtype),
                            has_residual ? c10::IValue(static_cast<int64_t>(residual_dtype))
                                         : c10::IValue(),
                            c10::IValue(),
                            c10::IValue()};
    norm_bwd.callBoxed(&stack);
    auto out = [&](size_t i, bool present) { return present ? stack[i].toTensor() : at::Tensor(); };
    // norm_bwd leaves dres empty where it is dx (its outputs may not alias).
    const bool dres_is_dx = residual_dtype == x_dtype;
    return {out(0, true), out(2, w.defined()), out(3, b.defined()),
            out(dres_is_dx ? 0 : 1, has_residual)};
  }
};

// norm_fwd: below autograd at once where no gradient is wanted (a compiled graph's calls),
// else with a NormOpBackward on its outputs.
void norm_fwd_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                       torch::jit::Stack* stack) {
  constexpr size_t kArgs = 11;
  auto args = torch::jit::last(*stack, kArgs);
  at::Tensor x = args[0].toTensor(), weight = optional_tensor(args[1]),
             bias = optional_tensor(args[2]), residual = optional_tensor(args[3]);
  const bool wants_grad = torch::autograd::compute_requires_grad(x, weight, bias, residual);
  NodePtr node;
  if (wants_grad) {
    node = new_node<NormOpBackward>();
    auto* backward = static_cast<NormOpBackward*>(node.get());
    backward->set_next_edges(torch::autograd::collect_next_edges(x, weight, bias, residual));
    backward->weight = torch::autograd::SavedVariable(weight, false);
    backward->bias = torch::autograd::SavedVariable(bias, false);
    if (!residual.defined()) backward->h = torch::autograd::SavedVariable(x, false);
    backward->offset = args[5].toDouble();
    backward->dims = args[7];
    backward->per_head = args[8].toBool();
    backward->x_dtype = x.scalar_type();
    backward->has_residual = residual.defined();
    backward->residual_dtype = residual.defined() ? residual.scalar_type() : x.scalar_type();
  }
  const bool layer_norm = args[6].toBool();
  {
    at::AutoDispatchBelowADInplaceOrView below;
    op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
  }
  if (!wants_grad) return;
  for (size_t i = stack->size() - 4; i < stack->size(); ++i) {  // y, h, mean, rstd
    torch::autograd::create_gradient_edge((*stack)[i].toTensor(), node);
  }
  auto outputs = torch::jit::last(*stack, 4);
  auto* backward = static_cast<NormOpBackward*>(node.get());
  const at::Tensor &y = outputs[0].toTensor(), &h = outputs[1].toTensor();
  backward->y_dtype = y.scalar_type();
  if (residual.defined()) backward->h = torch::autograd::SavedVariable(h, true);
  if (layer_norm) backward->mean = torch::autograd::SavedVariable(outputs[2].toTensor(), true);
  backward->rstd = torch::autograd::SavedVariable(outputs[3].toTensor(), true);
}

void forget_calls() {
  cached_calls().clear();
  op_calls<ForwardNative>().clear();
  op_calls<BackwardNative>().clear();
}

}  // namespace

TORCH_LIBRARY_IMPL(tilenorm, CUDA, m) {
  m.impl("norm_fwd", torch::CppFunction::makeFromBoxedFunction<&norm_fwd_cuda>());
  m.impl("norm_bwd", torch::CppFunction::makeFromBoxedFunction<&norm_bwd_cuda>());
}

TORCH_LIBRARY_IMPL(tilenorm, AutogradCUDA, m) {
  m.impl("norm_fwd", torch::CppFunction::makeFromBoxedFunction<&norm_fwd_autograd>());
  // norm_bwd is not differentiated: torch's fallback for that, in C++.
  m.impl("norm_bwd", torch::autograd::autogradNotImplementedFallback());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<BackwardNative, c10::intrusive_ptr<BackwardNative>>(m, "BackwardNative");
  py::class_<ForwardNative, c10::intrusive_ptr<ForwardNative>>(m, "ForwardNative");
  m.def("make_backward", &make_backward);
  m.def("make_forward", &make_forward);
  m.def("attach_backward", &attach_backward);
  m.def("apply", &apply);
  m.def("forward", &forward);
  m.def("backward", &backward, py::arg("call"), py::arg("dy"), py::arg("dres_in"), py::arg("h"),
        py::arg("weight"), py::arg("bias"), py::arg("mean"), py::arg("rstd"), py::arg("offset"),
        py::arg("dy2") = py::none(), py::arg("dy3") = py::none());
  m.def("layout_key", &layout_key);
  m.def("cached_call", &cached_call);
  m.def("remember_call", &remember_call);
  m.def("forget_calls", &forget_calls);
  m.def("set_op_fallbacks", &set_op_fallbacks);
}
