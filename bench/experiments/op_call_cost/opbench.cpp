// The kernels of run.py's microbenchmark of a custom-op call's host cost (dispatch and argument
// handling): boxed kernels registered at the CPU keys the way tilenorm/pytorch/native_calls.cpp
// registers its CUDA ones, which do nothing but return outputs (no compute, no launches), so
// that what is timed is the call. Built by run.py with tilenorm's extension flags.
#include <torch/extension.h>

#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstring>
#include <ctime>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace {
namespace py = pybind11;

// What a kernel does before returning (set_mode), from nothing to tilenorm's per-call work:
// 0: returns preallocated outputs (set_static: the same tensors every call)
// 1: at::empty({0}) for every output
// 2: at::empty of real sizes (outputs 0 and 1 like the first tensor argument, the rest like the
//    first 1-D one, the weight)
// 3: tilenorm's per-call work: op_key over every argument + shared-lock map lookup, then mode 2
// 4: mode 3 with outputs 1 and 3 as at::empty({0}) (RMSNorm's backward: dres and dbias absent)
// 5: mode 4 with outputs 1 and 3 undefined (None in Python; timed through the fast_direct
//    entries only)
// 6: the lean ops: mode 3's key + lookup, output 0 like the first tensor, output 1 like the
//    weight
int g_mode = 0;
std::vector<at::Tensor> g_static;

// tilenorm's per-call work (native_calls.cpp): a byte key of every argument (a tensor's sizes,
// strides, dtype and device), looked up under a shared lock in the map of prepared calls.
void put(std::string& key, int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); }
void put_double(std::string& key, double v) {
  int64_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  put(key, bits);
}
void put_tensor(std::string& key, const at::Tensor& t) {
  put(key, t.dim());
  for (int64_t v : t.sizes()) put(key, v);
  for (int64_t v : t.strides()) put(key, v);
  put(key, static_cast<int64_t>(t.scalar_type()));
  put(key, static_cast<int64_t>(t.device().type()) << 16 | (t.device().index() & 0xffff));
}
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

struct Cache {
  std::shared_mutex mutex;
  std::unordered_map<std::string, int64_t> calls;
  bool find(const std::string& key, int64_t* out) {
    if (key.empty()) return false;
    std::shared_lock lock(mutex);
    auto found = calls.find(key);
    if (found == calls.end()) return false;
    *out = found->second;
    return true;
  }
  void insert(const std::string& key, int64_t v) {
    std::unique_lock lock(mutex);
    calls[key] = v;
  }
};
Cache& cache() {
  static Cache c;
  return c;
}

// The first tensor argument: the outputs' options, and the large outputs' sizes.
const at::Tensor* first_tensor(c10::ArrayRef<c10::IValue> args) {
  for (const auto& v : args) {
    if (v.isTensor()) return &v.toTensor();
  }
  return nullptr;
}

// Every op's CPU kernel: returns the schema's outputs as g_mode says.

void generic_kernel(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t n_args = op.schema().arguments().size();
  const size_t n_out = op.schema().returns().size();
  auto args = torch::jit::last(*stack, n_args);
  const int mode = g_mode;
  std::vector<at::Tensor> outs;
  outs.reserve(n_out);
  if (mode == 0) {
    for (size_t i = 0; i < n_out; ++i) outs.push_back(g_static[i]);
  } else if (mode == 1) {
    const at::Tensor* t = first_tensor(args);
    for (size_t i = 0; i < n_out; ++i) outs.push_back(at::empty({0}, t->options()));
  } else {
    if (mode >= 3) {
      std::string key;
      if (!op_key(key, args)) key.clear();
      int64_t v = 0;
      if (!cache().find(key, &v)) cache().insert(key, 1);
    }
    const at::Tensor* big = first_tensor(args);
    const at::Tensor* small = big;  // the first 1-D tensor argument (the weight)
    for (const auto& v : args) {
      if (v.isTensor() && v.toTensor().dim() == 1) {
        small = &v.toTensor();
        break;
      }
    }
    for (size_t i = 0; i < n_out; ++i) {
      if (mode == 6) {  // lean ops: (big-like, weight-like)
        outs.push_back(at::empty(i == 0 ? big->sizes() : small->sizes(), big->options()));
      } else if (mode == 5 && (i == 1 || i == 3)) {
        outs.emplace_back();
      } else if (mode == 4 && (i == 1 || i == 3)) {
        outs.push_back(at::empty({0}, big->options()));
      } else if (i == 0 || i == 1) {
        outs.push_back(at::empty(big->sizes(), big->options()));
      } else {
        outs.push_back(at::empty(small->sizes(), small->options()));
      }
    }
  }
  torch::jit::drop(*stack, n_args);
  for (auto& t : outs) stack->emplace_back(std::move(t));
}

// The shape of tilenorm's Autograd kernel for norm_fwd: check that no input wants a gradient
// (the compiled graph's case), then redispatch below autograd.
void redispatch_autograd(const c10::OperatorHandle& op, c10::DispatchKeySet keys,
                         torch::jit::Stack* stack) {
  const size_t n_args = op.schema().arguments().size();
  auto args = torch::jit::last(*stack, n_args);
  at::Tensor x = args[0].toTensor();
  at::Tensor w = args[1].isNone() ? at::Tensor() : args[1].toTensor();
  const bool wants_grad = torch::autograd::compute_requires_grad(x, w);
  TORCH_CHECK(!wants_grad, "opbench: no input may require grad");
  at::AutoDispatchBelowADInplaceOrView below;
  op.redispatchBoxed(keys & c10::after_autograd_keyset, stack);
}

// bwd14_ub's kernel: the same op unboxed, to compare with the boxed one (modes 0 and 1 only).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> unboxed_bwd(
    const at::Tensor& dy, const std::optional<at::Tensor>& dres_in, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    const std::optional<at::Tensor>& mean, const at::Tensor& rstd, double offset,
    c10::SymInt dims, bool per_head, at::ScalarType x_dtype,
    std::optional<at::ScalarType> residual_dtype, const std::optional<at::Tensor>& dy2,
    const std::optional<at::Tensor>& dy3) {
  if (g_mode == 0) return {g_static[0], g_static[1], g_static[2], g_static[3]};
  auto o = dy.options();
  return {at::empty({0}, o), at::empty({0}, o), at::empty({0}, o), at::empty({0}, o)};
}

void set_mode(int mode) { g_mode = mode; }
void set_static(std::vector<at::Tensor> ts) { g_static = std::move(ts); }

// --- C++-only timings ------------------------------------------------------------------------
// Thread CPU time, as run.py's Python timings: on a shared machine wall time would count other
// processes' slices.
int64_t thread_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

double ns_per(int64_t begin, int64_t end, int64_t n) { return double(end - begin) / n; }

// The norm_bwd stack of tilenorm (RMSNorm, no residual): dy, None, h, weight, None, None, rstd,
// 0.0, 1, False, dtype, None, None, None.
std::vector<c10::IValue> bwd_stack(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& w,
                                   const at::Tensor& rstd) {
  return {dy, c10::IValue(), h, w, c10::IValue(), c10::IValue(), rstd, 0.0,
          c10::IValue(c10::SymInt(1)), false, static_cast<int64_t>(dy.scalar_type()),
          c10::IValue(), c10::IValue(), c10::IValue()};
}

// ns per iteration of `what`: a piece of tilenorm's per-call work, or ("callboxed") a whole call
// of op `opname` through the dispatcher from C++ (no Python), its stack built each call.
double time_cpp(const std::string& what, int64_t iters, const at::Tensor& dy, const at::Tensor& h,
                const at::Tensor& w, const at::Tensor& rstd, const std::string& opname) {
  auto base = bwd_stack(dy, h, w, rstd);
  if (what == "key") {
    size_t sink = 0;
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      std::string key;
      op_key(key, base);
      sink += key.size();
    }
    auto b = thread_ns();
    if (sink == 1) py::print("");  // uses the result, so that the loop is not optimized away
    return ns_per(a, b, iters);
  }
  if (what == "lookup" || what == "key+lookup") {
    std::string key;
    op_key(key, base);
    // 35 entries in the map, about a model's worth of distinct calls
    for (int i = 0; i < 34; ++i) {
      std::string k = key;
      put(k, i + 1000);
      cache().insert(k, i);
    }
    cache().insert(key, 7);
    int64_t sink = 0, v = 0;
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      if (what == "key+lookup") {
        std::string k2;
        op_key(k2, base);
        cache().find(k2, &v);
      } else {
        cache().find(key, &v);
      }
      sink += v;
    }
    auto b = thread_ns();
    if (sink == 1) py::print("");
    return ns_per(a, b, iters);
  }
  if (what == "empty0") {
    auto opts = h.options();
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      at::Tensor t = at::empty({0}, opts);
    }
    return ns_per(a, thread_ns(), iters);
  }
  if (what == "empty") {
    auto opts = h.options();
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      at::Tensor t = at::empty(h.sizes(), opts);
    }
    return ns_per(a, thread_ns(), iters);
  }
  if (what == "empty_like") {
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      at::Tensor t = at::empty_like(h);
    }
    return ns_per(a, thread_ns(), iters);
  }
  if (what == "stack") {  // building the 14-IValue stack alone
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      auto s = bwd_stack(dy, h, w, rstd);
    }
    return ns_per(a, thread_ns(), iters);
  }
  if (what == "callboxed") {
    auto op = c10::Dispatcher::singleton().findSchemaOrThrow(opname.c_str(), "");
    const size_t n_args = op.schema().arguments().size();
    auto a = thread_ns();
    for (int64_t i = 0; i < iters; ++i) {
      torch::jit::Stack s;
      if (n_args == 14) {  // the norm_bwd-shaped ops
        s = bwd_stack(dy, h, w, rstd);
      } else {  // t4
        s = {dy, h, w, rstd};
      }
      op.callBoxed(&s);
    }
    return ns_per(a, thread_ns(), iters);
  }
  TORCH_CHECK(false, "unknown ", what);
}

// --- METH_FASTCALL entry points: Python objects straight to an IValue stack ------------------
// What a wrapper could call instead of the OpOverload: no argument parsing against the schema
// (a dtype becomes its ScalarType's int, missing trailing arguments None), then the dispatcher
// (kDispatcher) or the kernel directly; undefined outputs come back as None.
bool to_ivalue(PyObject* o, c10::IValue* out) {
  if (o == Py_None) {
    *out = c10::IValue();
  } else if (THPVariable_Check(o)) {
    *out = THPVariable_Unpack(o);
  } else if (PyBool_Check(o)) {
    *out = o == Py_True;
  } else if (PyFloat_CheckExact(o)) {
    *out = PyFloat_AS_DOUBLE(o);
  } else if (PyLong_CheckExact(o)) {
    *out = static_cast<int64_t>(PyLong_AsLongLong(o));
  } else if (THPDtype_Check(o)) {
    *out = static_cast<int64_t>(reinterpret_cast<THPDtype*>(o)->scalar_type);
  } else {
    return false;
  }
  return true;
}

template <bool kDispatcher, bool kReleaseGil, bool kFwd = false>
PyObject* fast_call(PyObject* /*self*/, PyObject* const* args, Py_ssize_t nargs) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow(
      kFwd ? "obpy::norm_fwd" : "obpy::norm_bwd", "");
  const size_t n_args = kFwd ? 11 : 14;
  if (static_cast<size_t>(nargs) > n_args) {
    PyErr_SetString(PyExc_TypeError, "fast_call: too many arguments");
    return nullptr;
  }
  try {
    torch::jit::Stack stack;
    stack.reserve(n_args);
    for (Py_ssize_t i = 0; i < nargs; ++i) {
      c10::IValue v;
      if (!to_ivalue(args[i], &v)) {
        PyErr_SetString(PyExc_TypeError, "fast_call: unsupported argument");
        return nullptr;
      }
      stack.push_back(std::move(v));
    }
    while (stack.size() < n_args) stack.emplace_back();
    if constexpr (kDispatcher) {
      if constexpr (kReleaseGil) {
        pybind11::gil_scoped_release no_gil;
        op.callBoxed(&stack);
      } else {
        op.callBoxed(&stack);
      }
    } else {
      generic_kernel(op, &stack);
    }
    PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(stack.size()));
    for (size_t i = 0; i < stack.size(); ++i) {
      if (stack[i].isTensor()) {
        PyTuple_SET_ITEM(out, i, THPVariable_Wrap(std::move(stack[i]).toTensor()));
      } else {
        Py_INCREF(Py_None);
        PyTuple_SET_ITEM(out, i, Py_None);
      }
    }
    return out;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

template <bool kDispatcher, bool kReleaseGil, bool kFwd = false>
PyMethodDef fast_def(const char* name) {
  return {name, reinterpret_cast<PyCFunction>(
                    reinterpret_cast<void (*)()>(&fast_call<kDispatcher, kReleaseGil, kFwd>)),
          METH_FASTCALL, nullptr};
}

PyMethodDef fast_defs[] = {fast_def<true, false>("fast_dispatch"),
                           fast_def<true, true>("fast_dispatch_nogil"),
                           fast_def<false, false>("fast_direct"),
                           fast_def<true, false, true>("fast_dispatch_fwd"),
                           fast_def<false, false, true>("fast_direct_fwd"),
                           {nullptr, nullptr, 0, nullptr}};

}  // namespace

// Ops of the "ob" namespace, all with the kernels above:
//   bwd14*: tilenorm's norm_bwd schema, with no Autograd kernel (bwd14: the global autograd
//     fallback), the not-implemented fallback as tilenorm's (_nif), a fallthrough (_ft), a
//     redispatching kernel (_rd), or an unboxed kernel (_ub); bwd14_2 / bwd14_1 return 2 / 1
//     of the outputs;
//   fwd11, fwd11_rd: norm_fwd's schema, without / with tilenorm's redispatching Autograd kernel;
//   t4, t4_1, t1: tensors only; lean_fwd, lean_bwd: one configuration's minimal schemas;
//   a_<type>(Tensor a, <type> b): what one argument of each type costs.
TORCH_LIBRARY(ob, m) {
  const char* bwd_args =
      "(Tensor dy, Tensor? dres_in, Tensor h, Tensor? weight, Tensor? bias, Tensor? mean, "
      "Tensor rstd, float offset, SymInt dims, bool per_head, ScalarType x_dtype, "
      "ScalarType? residual_dtype, Tensor? dy2=None, Tensor? dy3=None)";
  const char* fwd_args =
      "(Tensor x, Tensor? weight, Tensor? bias, Tensor? residual, float eps, float offset, "
      "bool layer_norm, SymInt dims, bool per_head, ScalarType? out_dtype, "
      "ScalarType? residual_dtype)";
  const std::string four = " -> (Tensor, Tensor, Tensor, Tensor)";
  auto def = [&m](const std::string& schema) { m.def(schema.c_str()); };
  for (const char* suffix : {"", "_nif", "_ft", "_rd", "_ub"}) {
    def(std::string("bwd14") + suffix + bwd_args + four);
  }
  def(std::string("bwd14_2") + bwd_args + " -> (Tensor, Tensor)");
  def(std::string("bwd14_1") + bwd_args + " -> Tensor");
  def(std::string("fwd11") + fwd_args + four);
  def(std::string("fwd11_rd") + fwd_args + four);
  m.def("t4(Tensor a, Tensor b, Tensor c, Tensor d) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("t4_1(Tensor a, Tensor b, Tensor c, Tensor d) -> Tensor");
  m.def("t1(Tensor a) -> Tensor");
  m.def("lean_fwd(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("lean_bwd(Tensor dy, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  for (const char* spec : {"float", "SymInt", "int", "bool", "ScalarType", "ScalarType?",
                           "Tensor?", "float?"}) {
    std::string name = std::string("a_") + spec;
    if (name.back() == '?') name.back() = 'Q';
    def(name + "(Tensor a, " + spec + " b) -> Tensor");
  }
  m.def("a_ScalarTypeQDNone(Tensor a, ScalarType? b=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(ob, CPU, m) {
  for (const char* name : {"bwd14", "bwd14_nif", "bwd14_ft", "bwd14_rd", "bwd14_2", "bwd14_1",
                           "fwd11", "fwd11_rd", "t4", "t4_1", "t1", "a_float", "a_SymInt",
                           "a_int", "a_bool", "a_ScalarType", "a_ScalarTypeQ", "a_TensorQ",
                           "a_floatQ", "a_ScalarTypeQDNone", "lean_fwd", "lean_bwd"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&generic_kernel>());
  }
  m.impl("bwd14_ub", &unboxed_bwd);
}

TORCH_LIBRARY_IMPL(ob, AutogradCPU, m) {
  m.impl("bwd14_ub", torch::autograd::autogradNotImplementedFallback());
  m.impl("bwd14_nif", torch::autograd::autogradNotImplementedFallback());
  m.impl("bwd14_ft", torch::CppFunction::makeFallthrough());
  m.impl("bwd14_rd", torch::CppFunction::makeFromBoxedFunction<&redispatch_autograd>());
  m.impl("fwd11_rd", torch::CppFunction::makeFromBoxedFunction<&redispatch_autograd>());
  m.impl("lean_fwd", torch::CppFunction::makeFromBoxedFunction<&redispatch_autograd>());
  m.impl("lean_bwd", torch::autograd::autogradNotImplementedFallback());
}

// Twins of tilenorm's registrations, for the ops run.py defines with torch.library.custom_op
// (namespace obpy, tilenorm's schemas), at the CPU keys instead of the CUDA ones.
TORCH_LIBRARY_IMPL(obpy, CPU, m) {
  m.impl("norm_fwd", torch::CppFunction::makeFromBoxedFunction<&generic_kernel>());
  m.impl("norm_bwd", torch::CppFunction::makeFromBoxedFunction<&generic_kernel>());
}

TORCH_LIBRARY_IMPL(obpy, AutogradCPU, m) {
  m.impl("norm_fwd", torch::CppFunction::makeFromBoxedFunction<&redispatch_autograd>());
  m.impl("norm_bwd", torch::autograd::autogradNotImplementedFallback());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("set_mode", &set_mode);
  m.def("set_static", &set_static);
  m.def("time_cpp", &time_cpp);
  PyModule_AddFunctions(m.ptr(), fast_defs);
}
