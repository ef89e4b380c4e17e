// autopar's native stream interpreter: runs a captured aten graph's planned streams without
// Python, each stream on one thread of the calling thread's OpenMP team.
//
// Why OpenMP and spinning, not worker threads and locks: on the 2-core VMs autopar is
// measured on, waking a sleeping thread through a futex costs 30-35 us each way (a condition
// variable round trip 69 us, Python's queue and event 58 us; an atomic flag polled by a
// spinning thread 0.3 us; benchmarks/native_fork.py). PyTorch's own intra-op parallelism is
// the calling thread's libgomp team, whose threads spin for a while after each parallel op
// (GOMP_SPINCOUNT), so a parallel region opened here right after the user's 2-thread ops
// starts on a team that is already awake: a fork costs about a microsecond.
//
// Inside the region every op runs single-threaded: each stream's thread sets its OpenMP
// thread count to 1 (see run()), at::parallel_for runs inline in an OpenMP parallel region,
// MKL and oneDNN see one thread, and Inductor's kernels open nested regions of one thread. So a plan whose streams have one
// intra-op thread each is what this runs; the Python side (autopar.codegen.native) only
// offers such plans, and a one-stream program runs on the calling thread outside any
// region, with all of the caller's intra-op threads.
//
// A program is a list of instructions per stream, each a boxed call of one operator through
// the dispatcher (the exact OpOverload of the FX node: no overload resolution), reading and
// writing value slots. Cross-stream edges are events: the producer's instruction stores 1
// with release order after its outputs are in their slots, the consumer spins (acquire)
// before its instruction. Every slot has one writer; a slot is cleared early only by its
// last reader when all its readers run on the producer's stream (the Python side decides).
//
// Thread-local state (grad mode, dispatch-key sets, autocast, the saved-tensor hooks ...)
// is the caller's on every stream (at::ThreadLocalStateGuard, as at::launch does), so a
// backward graph's ops run under the same no-grad mode as on the calling thread.
//
// Errors: the first exception in any stream sets the abort flag; spinning streams stop,
// and the caller raises the op's error naming the node key ("g0.fw/addmm_3: <message>"):
// torch's IndexError, ValueError, TypeError and NotImplementedError keep their type (as in
// eager: code that catches IndexError must see one), anything else is a RuntimeError.

#include <torch/extension.h>
#include <torch/csrc/jit/python/pybind_utils.h>

#include "no_double_backward.h"

#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/ScalarOps.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

enum ArgKind : int {
  kSlot = 0,      // a value slot
  kConst = 1,     // a constant, converted once with the schema argument's type
  kSlotList = 2,  // a list of slots (Tensor[] / Tensor?[]); -1 stands for None
  kDefault = 3,   // the schema's default value
};

struct Arg {
  int kind = kSlot;
  int slot = -1;
  c10::IValue value;
  std::vector<int> slots;
  bool optional_elements = false;  // Tensor?[]
};

struct Instr {
  std::string key;  // "<tag>/<node name>": named in errors
  bool getitem = false;
  int getitem_index = 0;
  c10::optional<c10::OperatorHandle> op;
  std::vector<Arg> args;
  int out = -1;            // the output slot: the value, a tuple of several, None for none
  size_t n_returns = 0;
  std::vector<int> waits;  // events to wait for before running
  int signal = -1;         // event to set after running
  std::vector<int> frees;  // slots to clear after running
};

struct Aborted {};

// The C++ types torch's Python bindings turn into Python exceptions other than RuntimeError
// (c10::IndexError -> IndexError, ...): an op's error is re-raised as the same type.
enum class ErrorKind { kRuntime, kIndex, kValue, kType, kNotImplemented };

ErrorKind kind_of(const c10::Error& e) {
  if (dynamic_cast<const c10::IndexError*>(&e)) return ErrorKind::kIndex;
  if (dynamic_cast<const c10::ValueError*>(&e)) return ErrorKind::kValue;
  if (dynamic_cast<const c10::TypeError*>(&e)) return ErrorKind::kType;
  if (dynamic_cast<const c10::NotImplementedError*>(&e)) return ErrorKind::kNotImplemented;
  return ErrorKind::kRuntime;
}

[[noreturn]] void raise_as(ErrorKind kind, const std::string& msg) {
  const auto here = c10::SourceLocation::current();
  switch (kind) {
    case ErrorKind::kIndex: throw c10::IndexError(here, msg);
    case ErrorKind::kValue: throw c10::ValueError(here, msg);
    case ErrorKind::kType: throw c10::TypeError(here, msg);
    case ErrorKind::kNotImplemented: throw c10::NotImplementedError(here, msg);
    default: throw std::runtime_error(msg);
  }
}

class Program {
 public:
  Program(py::list streams, int n_slots, int n_events, std::vector<int> inputs,
          std::vector<int> outputs, std::vector<std::pair<int, int>> serial_order)
      : n_slots_(n_slots), n_events_(n_events), inputs_(std::move(inputs)),
        outputs_(std::move(outputs)), serial_(std::move(serial_order)) {
    for (auto s : streams) {
      std::vector<Instr> code;
      for (auto item : py::cast<py::list>(s)) code.push_back(parse(py::cast<py::tuple>(item)));
      streams_.push_back(std::move(code));
    }
  }

  int n_streams() const { return static_cast<int>(streams_.size()); }
  int last_threads() const { return last_threads_; }

  int n_inputs() const { return static_cast<int>(inputs_.size()); }
  int n_outputs() const { return static_cast<int>(outputs_.size()); }

  // From Python: the inputs as Python objects, the outputs as a list (None for none).
  py::list run(py::args args) {
    if (static_cast<size_t>(py::len(args)) != inputs_.size())
      throw std::runtime_error("native program: expected " + std::to_string(inputs_.size()) +
                               " inputs, got " + std::to_string(py::len(args)));
    std::vector<c10::IValue> ins(inputs_.size());
    for (size_t i = 0; i < inputs_.size(); ++i) {
      PyObject* a = PyTuple_GET_ITEM(args.ptr(), i);
      if (THPVariable_Check(a)) {
        ins[i] = THPVariable_Unpack(a);
      } else if (a != Py_None) {
        ins[i] = torch::jit::toIValue(py::handle(a), c10::AnyType::get());
      }
    }
    std::vector<c10::IValue> outs;
    {
      py::gil_scoped_release no_gil;
      outs = run_values(std::move(ins));
    }
    py::list out;
    for (auto& v : outs) out.append(v.isNone() ? py::none() : torch::jit::toPyObject(v));
    return out;
  }

  // The program on values (None for none); called without the GIL (run() releases it, the
  // autograd engine runs DirectFunction's backward without it).
  std::vector<c10::IValue> run_values(std::vector<c10::IValue> ins) {
    if (ins.size() != inputs_.size())
      throw std::runtime_error("native program: expected " + std::to_string(inputs_.size()) +
                               " inputs, got " + std::to_string(ins.size()));
    std::vector<c10::IValue> slots(n_slots_);
    for (size_t i = 0; i < inputs_.size(); ++i) slots[inputs_[i]] = std::move(ins[i]);
    // One atomic flag per event and the abort flag; padded apart (false sharing between the
    // two spinning cores would slow every wait).
    struct alignas(64) Flag { std::atomic<int> v{0}; };
    std::unique_ptr<Flag[]> events(new Flag[std::max(n_events_, 1)]);
    Flag abort;
    std::mutex err_mu;
    std::string error;
    ErrorKind error_kind = ErrorKind::kRuntime;

    auto fail = [&](const Instr& in, const char* what, ErrorKind kind) {
      std::lock_guard<std::mutex> g(err_mu);
      if (error.empty()) {
        error = in.key + ": " + what;
        error_kind = kind;
      }
      abort.v.store(1, std::memory_order_release);
    };
    auto wait_for = [&](int e) {
      int spins = 0;
      while (!events[e].v.load(std::memory_order_acquire)) {
        if (abort.v.load(std::memory_order_relaxed)) throw Aborted();
        // spin briefly, then let the other stream's thread have the core (a 2-core box
        // with a neighbour process may have descheduled it)
        if (++spins < 4000) {
#if defined(__x86_64__) || defined(__i386__)
          __builtin_ia32_pause();
#endif
        } else {
          std::this_thread::yield();
        }
      }
    };
    auto run_instr = [&](Instr& in, torch::jit::Stack& stack) {
      for (int e : in.waits) wait_for(e);
      try {
        execute(in, slots, stack);
      } catch (const Aborted&) {
        throw;
      } catch (const c10::Error& ex) {
        // without the C++ backtrace, as torch's bindings show an op's error
        fail(in, ex.what_without_backtrace(), kind_of(ex));
        throw Aborted();
      } catch (const std::exception& ex) {
        fail(in, ex.what(), ErrorKind::kRuntime);
        throw Aborted();
      }
      if (in.signal >= 0) events[in.signal].v.store(1, std::memory_order_release);
    };
    auto run_stream = [&](int s) {
      torch::jit::Stack stack;
      try {
        for (auto& in : streams_[s]) run_instr(in, stack);
      } catch (const Aborted&) {
      }
    };

    at::ThreadLocalState tls;  // the caller's: grad mode, dispatch keys, autocast, ...
    int threads = 1;
    {
      const int n = n_streams();
      if (n == 1) {
        run_stream(0);
      } else if (at::get_num_threads() < n) {
        // The caller allows fewer threads than the program has streams
        // (torch.set_num_threads(1)): never use more cores than that; run the plan's order.
        torch::jit::Stack stack;
        try {
          for (auto [s, i] : serial_) run_instr(streams_[s][i], stack);
        } catch (const Aborted&) {
        }
      } else {
        std::atomic<int> granted{0};
#pragma omp parallel num_threads(n)
        {
#pragma omp single
          granted.store(omp_get_num_threads());
          // (the implicit barrier after `single` publishes `granted` to the whole team)
          if (granted.load() == n) {
            // One thread per stream, and every library must know it: oneDNN bakes the
            // thread count into a primitive when it creates it (and caches it by that
            // count), then runs its per-thread parts with barriers between them; a
            // primitive made for 2 threads and run inside this region (where oneDNN runs
            // them one after another) waits forever at its first barrier (Inception's
            // convolution backward did). at::get_num_threads() before the setting: it runs
            // ATen's lazy per-thread init, which on a thread's first at::parallel_for would
            // otherwise set the count back to torch.set_num_threads' value mid-call
            // (tests/test_native.py, test_convolution_backward_on_a_second_stream...). The
            // setting is this task's ICV only: the caller's is untouched.
            at::get_num_threads();
            omp_set_num_threads(1);
            at::ThreadLocalStateGuard guard(tls);
            run_stream(omp_get_thread_num());
          }
        }
        threads = granted.load();
        if (threads != n) {
          // Fewer threads than streams (a nested call, OMP_THREAD_LIMIT): the streams'
          // instructions in the plan's order are a valid serial order.
          torch::jit::Stack stack;
          try {
            for (auto [s, i] : serial_) run_instr(streams_[s][i], stack);
          } catch (const Aborted&) {
          }
        }
      }
    }
    last_threads_ = threads;
    if (!error.empty()) raise_as(error_kind, error);
    std::vector<c10::IValue> out;
    out.reserve(outputs_.size());
    for (int o : outputs_) out.push_back(o < 0 ? c10::IValue() : slots[o]);
    return out;
  }

  // Seconds of the calls made through DirectFunction (Python's monitor times its own calls),
  // kept until taken (at most kMaxTimes: a monitor that never takes them loses the oldest).
  void note_seconds(double s) {
    std::lock_guard<std::mutex> g(times_mu_);
    if (times_.size() >= kMaxTimes) times_.erase(times_.begin());
    times_.push_back(s);
  }
  std::vector<double> take_seconds() {
    std::lock_guard<std::mutex> g(times_mu_);
    std::vector<double> out;
    out.swap(times_);
    return out;
  }

 private:
  static Instr parse(const py::tuple& t) {
    // (key, qualified op name or "getitem", overload, args, out, waits, signal, frees)
    Instr in;
    in.key = py::cast<std::string>(t[0]);
    auto name = py::cast<std::string>(t[1]);
    auto overload = py::cast<std::string>(t[2]);
    auto args = py::cast<py::list>(t[3]);
    in.out = py::cast<int>(t[4]);
    in.waits = py::cast<std::vector<int>>(t[5]);
    in.signal = py::cast<int>(t[6]);
    in.frees = py::cast<std::vector<int>>(t[7]);
    if (name == "getitem") {
      in.getitem = true;
      in.getitem_index = py::cast<int>(py::cast<py::tuple>(args[1])[1]);
      Arg a;
      a.slot = py::cast<int>(py::cast<py::tuple>(args[0])[1]);
      in.args.push_back(std::move(a));
      return in;
    }
    auto op = c10::Dispatcher::singleton().findSchema({name, overload});
    if (!op) throw std::runtime_error(in.key + ": no operator " + name + "." + overload);
    const auto& schema = op->schema();
    if (py::len(args) != schema.arguments().size())
      throw std::runtime_error(in.key + ": " + std::to_string(py::len(args)) +
                               " arguments for " + schema.name() + ", which takes " +
                               std::to_string(schema.arguments().size()));
    size_t i = 0;
    for (auto item : args) {
      auto pair = py::cast<py::tuple>(item);
      Arg a;
      a.kind = py::cast<int>(pair[0]);
      const auto& sarg = schema.arguments()[i++];
      if (a.kind == kSlot) {
        a.slot = py::cast<int>(pair[1]);
      } else if (a.kind == kConst) {
        a.value = constant(pair[1], sarg.type());
      } else if (a.kind == kSlotList) {
        a.slots = py::cast<std::vector<int>>(pair[1]);
        a.optional_elements = sarg.type()->str().find('?') != std::string::npos;
      } else if (a.kind == kDefault) {
        if (!sarg.default_value())
          throw std::runtime_error(in.key + ": argument " + sarg.name() + " has no default");
        a.value = *sarg.default_value();
        a.kind = kConst;
      } else {
        throw std::runtime_error(in.key + ": bad argument kind");
      }
      in.args.push_back(std::move(a));
    }
    in.n_returns = schema.returns().size();
    in.op = *op;
    return in;
  }

  // A constant for a schema argument of type `type`. A Python number where the schema
  // takes a Tensor (FX keeps `aten.mul.Tensor(x, 2)` as traced) becomes what Python's
  // argument parser makes of it: a 0-dim CPU tensor marked as a wrapped number, which
  // type promotion treats as a Python scalar (float32 * 2 stays float32).
  static c10::IValue constant(const py::handle& v, const c10::TypePtr& type) {
    auto kind = type->kind();
    if (kind == c10::TypeKind::OptionalType) kind = type->expectRef<c10::OptionalType>()
                                                        .getElementType()->kind();
    bool number = PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr()) || PyBool_Check(v.ptr());
    if (kind == c10::TypeKind::TensorType && number) {
      at::Scalar s = PyBool_Check(v.ptr())    ? at::Scalar(v.ptr() == Py_True)
                     : PyFloat_Check(v.ptr()) ? at::Scalar(PyFloat_AsDouble(v.ptr()))
                                              : at::Scalar(static_cast<int64_t>(
                                                    PyLong_AsLongLong(v.ptr())));
      at::Tensor t = c10::scalar_to_tensor(s);
      t.unsafeGetTensorImpl()->set_wrapped_number(true);
      return t;
    }
    return torch::jit::toIValue(v, type);
  }

  static void execute(Instr& in, std::vector<c10::IValue>& slots, torch::jit::Stack& stack) {
    if (in.getitem) {
      const auto& v = slots[in.args[0].slot];
      slots[in.out] = v.isTuple() ? v.toTupleRef().elements().at(in.getitem_index)
                                  : v.toList().get(in.getitem_index);
    } else {
      stack.clear();
      for (const auto& a : in.args) {
        if (a.kind == kSlot) {
          stack.push_back(slots[a.slot]);
        } else if (a.kind == kConst) {
          stack.push_back(a.value);
        } else if (a.optional_elements) {
          c10::List<c10::optional<at::Tensor>> l;
          for (int s : a.slots) l.push_back(s < 0 ? c10::nullopt
                                                  : c10::optional<at::Tensor>(slots[s].toTensor()));
          stack.emplace_back(std::move(l));
        } else {
          c10::List<at::Tensor> l;
          for (int s : a.slots) l.push_back(slots[s].toTensor());
          stack.emplace_back(std::move(l));
        }
      }
      in.op->callBoxed(&stack);
      if (in.n_returns == 1) {
        slots[in.out] = std::move(stack[0]);
      } else if (in.n_returns > 1) {
        slots[in.out] = c10::ivalue::Tuple::create(std::move(stack));
      }
      stack.clear();
    }
    for (int f : in.frees) slots[f] = c10::IValue();
  }

  int n_slots_, n_events_;
  std::vector<int> inputs_, outputs_;
  std::vector<std::pair<int, int>> serial_;
  std::vector<std::vector<Instr>> streams_;
  int last_threads_ = 0;
  static constexpr size_t kMaxTimes = 4096;
  std::mutex times_mu_;
  std::vector<double> times_;
};

// -- DirectFunction: a training graph's two native programs as one C++ autograd function ----
//
// What autopar.capture.direct_autograd's Python autograd.Function does, without Python
// between the programs and autograd: the forward program's outputs past the user's are
// saved for the backward (views detached first, so an in-place change of their base raises
// autograd's version error), and the backward program gets the saved tensors and the
// contiguous gradients of the outputs that take part in it. (A graph with an output that
// needs no gradient keeps the Python function: compiled autograd cannot take a C++
// function that marks one non-differentiable.) Compiled autograd calls it as it is. Saved
// tensors are freed after the backward unless retain_graph (the engine's
// release_variables). Under create_graph=True the results are connected to the graph
// through NoDoubleBackward (no_double_backward.h), whose backward raises AOTAutograd's
// double-backward error.
// Python creates no tensor object for the saved tensors or the gradients it does not see:
// on the 2-core box that saved 100-130 us of a 2.5 ms towers step (2026-12-07).
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A backward program is named in a node's saved data by its address, an integer that
// compiled autograd can hash (it collects every node's saved data into its cache key). The
// programs a node may run stay alive here for the process: a node outlives the model that
// made it when the user keeps an output, and a program is a few kilobytes, made once per
// plan (re-plans are bounded by AdaptOptions.max_replans).
std::mutex g_programs_mu;
std::unordered_map<Program*, std::shared_ptr<Program>> g_programs;

int64_t program_id(const std::shared_ptr<Program>& p) {
  std::lock_guard<std::mutex> g(g_programs_mu);
  g_programs.emplace(p.get(), p);
  return reinterpret_cast<int64_t>(p.get());
}

std::shared_ptr<Program> program_of(int64_t id) {
  std::lock_guard<std::mutex> g(g_programs_mu);
  return g_programs.at(reinterpret_cast<Program*>(id));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

at::Tensor as_tensor(const c10::IValue& v) { return v.isTensor() ? v.toTensor() : at::Tensor(); }

struct DirectFunction : public torch::autograd::Function<DirectFunction> {
  static constexpr bool is_traceable = false;  // compiled autograd calls it as it is
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs,
                               std::shared_ptr<Program> fw, std::shared_ptr<Program> bw,
                               int64_t n_out, std::vector<int64_t> grad_at) {
    std::vector<c10::IValue> ins(inputs.begin(), inputs.end());
    auto t0 = std::chrono::steady_clock::now();
    auto outs = fw->run_values(std::move(ins));
    fw->note_seconds(seconds_since(t0));
    variable_list user, saved;
    for (int64_t i = 0; i < n_out; ++i) user.push_back(outs[i].toTensor());
    for (size_t i = n_out; i < outs.size(); ++i) {
      auto t = outs[i].toTensor();
      saved.push_back(t.is_view() ? t.detach() : t);
    }
    ctx->save_for_backward(std::move(saved));
    ctx->saved_data["bw"] = program_id(bw);
    ctx->saved_data["grad_at"] = c10::IValue(grad_at);
    ctx->saved_data["n_in"] = static_cast<int64_t>(inputs.size());
    return user;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto bw = program_of(ctx->saved_data["bw"].toInt());
    auto saved = ctx->get_saved_variables();  // raises autograd's error after an in-place change
    std::vector<c10::IValue> ins(saved.begin(), saved.end());
    for (auto i : ctx->saved_data["grad_at"].toIntVector())
      ins.emplace_back(grads[i].defined() ? c10::IValue(grads[i].contiguous()) : c10::IValue());
    auto res = autopar_native::backward_results([&]() {
      auto t0 = std::chrono::steady_clock::now();
      auto outs = bw->run_values(std::move(ins));
      bw->note_seconds(seconds_since(t0));
      variable_list grads_in;
      for (auto& v : outs) grads_in.push_back(as_tensor(v));
      return grads_in;
    });
    res.resize(ctx->saved_data["n_in"].toInt());
    res.resize(res.size() + 4);  // fw, bw, n_out, grad_at: no gradients
    return res;
  }
};

// DirectFunction.apply from Python: the user outputs of the forward program (a list).
variable_list direct_apply(std::vector<at::Tensor> inputs, std::shared_ptr<Program> fw,
                           std::shared_ptr<Program> bw, int64_t n_out,
                           std::vector<int64_t> grad_at) {
  py::gil_scoped_release no_gil;
  return DirectFunction::apply(at::TensorList(inputs), std::move(fw), std::move(bw), n_out,
                               std::move(grad_at));
}

}  // namespace

void register_split(py::module& m);  // split.cpp: the native batch-split runner

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "autopar's native stream interpreter (see interp.cpp's header)";
  py::class_<Program, std::shared_ptr<Program>>(m, "Program")
      .def(py::init<py::list, int, int, std::vector<int>, std::vector<int>,
                    std::vector<std::pair<int, int>>>())
      .def("run", &Program::run)
      .def("take_seconds", &Program::take_seconds)
      .def_property_readonly("n_streams", &Program::n_streams)
      .def_property_readonly("n_inputs", &Program::n_inputs)
      .def_property_readonly("n_outputs", &Program::n_outputs)
      .def_property_readonly("last_threads", &Program::last_threads);
  m.def("direct_apply", &direct_apply,
        "A training graph's forward and backward native programs as one C++ autograd "
        "function: the forward's user outputs (see DirectFunction in interp.cpp)");
  m.def("max_threads", []() { return omp_get_max_threads(); });
  register_split(m);
}
