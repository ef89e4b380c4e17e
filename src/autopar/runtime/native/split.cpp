// The batch-split executor's native runner: a Dynamo graph's two half batches run at once,
// each through the same Inductor C++-wrapper program (autopar.runtime.split_tier), as one
// C++ autograd function whose forward and backward each open a two-thread OpenMP region.
//
// Why: the Python runner (split_tier.SplitRunner) hands the second half to a Python worker
// thread through a queue, and each half goes through its own Python autograd function, with
// fresh leaves for every input and Python gradient sums. On the bench's Inception model (2
// cores, 2026-12-07, benchmarks/native_split.py, three processes each) a forward and
// backward took 8.82-9.42 ms through it and 7.40-7.64 ms through this runner, where the
// two halves one after the other at one thread took 14.5-15.4 ms (half: 7.45 ms).
//
// How a call runs. Inductor's C++ wrapper compiles a graph into a library whose entry,
// inductor_entry_impl(inputs, outputs), takes and returns tensor handles (at::Tensor
// pointers: aoti_torch/utils.h). It is what the Python binding calls, found here by its
// symbol in the library Python already loaded. The entry releases the GIL for the whole
// graph and takes it back at the end (py::gil_scoped_release_simple), so each thread holds
// the GIL for a few microseconds around its call (PyGILState). Stamps of one process: the
// second thread entered the region 4-8 us after the first and held the GIL 10-20 us later.
//
// Memory: the backward entry owns its inputs and frees each saved tensor after its last use
// (see take_saved), as through the Python binding.
//
// Autograd: the halves' forward outputs past the graph's are kept for the backward (views
// detached; an in-place change raises autograd's version error). The user outputs are the
// halves' concatenated; in the backward each half gets its rows of the gradients, the
// batched inputs' gradients are concatenated and the others (the parameters) summed, so the
// engine accumulates each parameter's gradient once. With retain_graph=True the saved
// tensors stay for a second backward, except where the compiled backward donates buffers
// (writes into saved tensors): there it raises AOTAutograd's error, as DirectGraph does. A
// second backward without it says the tensors were freed. Under create_graph=True
// the results are connected to the graph through NoDoubleBackward (no_double_backward.h),
// whose backward raises AOTAutograd's double-backward error.

#include <torch/extension.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <torch/csrc/autograd/graph_task.h>

#include "no_double_backward.h"

#include <ATen/ThreadLocalState.h>
#include <dlfcn.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using EntryFn = void (*)(AtenTensorHandle*, AtenTensorHandle*);

// The C++ name of the entry every C++-wrapper library defines (torch 2.13's
// cpp_wrapper_cpu.py: `void inductor_entry_impl(AtenTensorHandle*, AtenTensorHandle*)`).
const char* const kEntrySymbol = "_Z19inductor_entry_implPP16AtenTensorOpaqueS1_";
// How long the second thread waits, when it arrives before the first has taken the GIL,
// after the first took it and before asking for it itself (the first holds it a few
// microseconds more): asking at once would put the second to sleep on the GIL's condition
// variable, a 30-60 us futex wake-up on the 2-core box (interp.cpp's header). A precaution
// costing at most this much of the second half's start; not measured apart.
constexpr int kStaggerUs = 30;

struct Entry {
  EntryFn fn = nullptr;
  int n_in = 0;
  int n_out = 0;
  std::string path;
};

// The entry of the C++-wrapper library at `path`, which Python loaded (and keeps loaded:
// Inductor's cache holds its module for the process).
Entry entry_in(const std::string& path, int64_t n_in, int64_t n_out) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
  TORCH_CHECK(lib != nullptr, "autopar native split: ", path, " is not loaded");
  void* sym = dlsym(lib, kEntrySymbol);
  dlclose(lib);  // RTLD_NOLOAD took a reference: Python's stays
  TORCH_CHECK(sym != nullptr, "autopar native split: no Inductor entry in ", path);
  return Entry{reinterpret_cast<EntryFn>(sym), static_cast<int>(n_in), static_cast<int>(n_out),
               path};
}

// The entry on `ins`, which it owns from here: it frees each input after its last use, as
// the Python binding lets it (its wrapper clears the argument list), so a backward's saved
// tensors go as the backward runs rather than at its end.
std::vector<at::Tensor> call_entry(const Entry& e, std::vector<at::Tensor> ins) {
  TORCH_CHECK(static_cast<int>(ins.size()) == e.n_in, "autopar native split: expected ",
              e.n_in, " inputs, got ", ins.size());
  std::vector<AtenTensorHandle> in(ins.size()), out(e.n_out, nullptr);
  for (size_t i = 0; i < ins.size(); ++i)
    in[i] = torch::aot_inductor::new_tensor_handle(std::move(ins[i]));  // stolen by the entry
  ins.clear();
  e.fn(in.data(), out.data());
  std::vector<at::Tensor> res(e.n_out);
  for (int i = 0; i < e.n_out; ++i) {
    if (out[i] == nullptr) continue;  // a None output (an input that gets no gradient)
    at::Tensor* t = torch::aot_inductor::tensor_handle_to_tensor_pointer(out[i]);
    res[i] = std::move(*t);
    delete t;
  }
  return res;
}

// The GIL around one entry call on a thread of the region, through the thread's own Python
// thread state (PyGILState: a team thread gets one for the call; one kept for the thread's
// life would outlive it when the team is released, streams.release_idle_omp_team).
struct GilFor {
  PyGILState_STATE state;
  GilFor() : state(PyGILState_Ensure()) {}
  ~GilFor() { PyGILState_Release(state); }
};

// The entry on both halves at once: the calling thread runs `a`, the other thread of a
// two-thread region `b` (both in turn where the region gets one thread: nested in another).
// Called with or without the GIL; every op runs single-threaded (as interp.cpp's streams).
std::pair<std::vector<at::Tensor>, std::vector<at::Tensor>> run_halves(
    const Entry& e, std::vector<at::Tensor> a, std::vector<at::Tensor> b) {
  std::vector<at::Tensor> out[2];
  std::exception_ptr error[2];
  std::atomic<int> started{0};
  const auto caller = std::this_thread::get_id();
  const at::ThreadLocalState tls;
  PyThreadState* held = PyGILState_Check() ? PyEval_SaveThread() : nullptr;
#pragma omp parallel num_threads(2)
  {
    at::ThreadLocalStateGuard guard(tls);
    omp_set_num_threads(1);
    const int n = omp_get_num_threads();
    for (int k = omp_get_thread_num(); k < 2; k += n) {
      const bool own = std::this_thread::get_id() == caller;
      if (!own && started.load(std::memory_order_acquire) == 0) {
        while (started.load(std::memory_order_acquire) == 0) {
        }
        auto t0 = std::chrono::steady_clock::now();
        while (std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(kStaggerUs)) {
        }
      }
      try {
        GilFor gil;
        started.store(1, std::memory_order_release);
        out[k] = call_entry(e, std::move(k == 0 ? a : b));
      } catch (...) {
        started.store(1, std::memory_order_release);
        error[k] = std::current_exception();
      }
    }
  }
  if (held != nullptr) PyEval_RestoreThread(held);
  for (auto& x : error)
    if (x) std::rethrow_exception(x);
  return {std::move(out[0]), std::move(out[1])};
}

// One half's rows of every input: the batched ones (`picked`) cut along dim 0 (views).
std::vector<at::Tensor> rows_of(at::TensorList xs, const std::vector<bool>& picked,
                                int64_t lo, int64_t hi) {
  std::vector<at::Tensor> out;
  out.reserve(xs.size());
  for (size_t i = 0; i < xs.size(); ++i)
    out.push_back(picked[i] ? xs[i].slice(0, lo, hi) : xs[i]);
  return out;
}

// The inputs' gradients: the halves' concatenated for the batched inputs, summed otherwise.
variable_list join_grads(std::vector<at::Tensor> g0, std::vector<at::Tensor> g1,
                         const std::vector<bool>& picked) {
  variable_list res(picked.size());
  for (size_t i = 0; i < picked.size(); ++i) {
    auto &a = g0[i], &b = g1[i];
    if (!a.defined() && !b.defined()) continue;
    if (picked[i]) {
      res[i] = at::cat({a.defined() ? a : at::zeros_like(b), b.defined() ? b : at::zeros_like(a)});
    } else {
      res[i] = !a.defined() ? b : !b.defined() ? a : a + b;
    }
  }
  return res;
}

struct Split {
  Entry fw, bw;
  int64_t half, rows;
  std::vector<bool> picked;
  std::vector<int64_t> grad_at;
  std::string donated;  // AOTAutograd's error where the backward donates buffers, else empty
};

// A split is named by an integer in a node's saved data (compiled autograd hashes saved
// data) and lives for the process: a node outlives the model that made it when the user
// keeps an output, and a split is made once per compile of the split executor.
std::mutex g_splits_mu;
std::unordered_map<int64_t, std::shared_ptr<Split>> g_splits;

std::shared_ptr<Split> split_of(int64_t id) {
  std::lock_guard<std::mutex> g(g_splits_mu);
  return g_splits.at(id);
}

variable_list backward_halves(const Split& s, variable_list saved, const variable_list& grads) {
  const size_t n_saved = saved.size() / 2;
  std::vector<at::Tensor> in[2];
  for (int k = 0; k < 2; ++k) {
    in[k].assign(std::make_move_iterator(saved.begin() + k * n_saved),
                 std::make_move_iterator(saved.begin() + (k + 1) * n_saved));
    const int64_t lo = k == 0 ? 0 : s.half, hi = k == 0 ? s.half : s.rows;
    for (auto i : s.grad_at) {
      TORCH_CHECK(grads[i].defined(), "autopar native split: a gradient is missing");
      in[k].push_back(grads[i].slice(0, lo, hi).contiguous());
    }
  }
  saved.clear();
  auto got = run_halves(s.bw, std::move(in[0]), std::move(in[1]));
  return join_grads(std::move(got.first), std::move(got.second), s.picked);
}

// The saved tensors, checked as autograd checks its own (an in-place change since the
// forward raises its error) and, unless retain_graph, taken out of the node: the backward
// entry then frees each after its last use. (save_for_backward would hold them all until
// the node's release after the backward: on the Inception halves that made each step's
// peak memory fresh pages again, 0.4-2.3 thousand page faults and 0.5-1.5 ms a step in one
// process in two, 2026-12-07. The Python runner's halves free them early as well.)
variable_list take_saved(AutogradContext* ctx) {
  auto& slot = ctx->saved_data["saved"];
  TORCH_CHECK(slot.isTensorList(), "autopar native split: the saved tensors were freed by a "
              "backward already; use retain_graph=True to backward twice");
  auto versions = ctx->saved_data["versions"].toIntVector();
  auto list = slot.toTensorList();
  variable_list saved(list.begin(), list.end());
  for (size_t i = 0; i < saved.size(); ++i) {
    TORCH_CHECK(static_cast<int64_t>(saved[i]._version()) == versions[i],
                "one of the variables needed for gradient computation has been modified by an "
                "inplace operation: [", saved[i].toString(), " ", saved[i].sizes(), "] is at "
                "version ", saved[i]._version(), "; expected version ", versions[i],
                " instead (autopar: a tensor saved by the split executor's forward)");
  }
  if (!torch::autograd::get_current_graph_task_keep_graph()) slot = c10::IValue();
  return saved;
}

struct SplitFunction : public torch::autograd::Function<SplitFunction> {
  static constexpr bool is_traceable = false;  // compiled autograd calls it as it is
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, int64_t split_id,
                               int64_t n_out) {
    auto s = split_of(split_id);
    auto got = run_halves(s->fw, rows_of(inputs, s->picked, 0, s->half),
                          rows_of(inputs, s->picked, s->half, s->rows));
    auto &a = got.first, &b = got.second;
    variable_list user;
    c10::List<at::Tensor> saved;
    std::vector<int64_t> versions;
    for (int64_t i = 0; i < n_out; ++i) user.push_back(at::cat({a[i], b[i]}));
    for (auto* half : {&a, &b})
      for (size_t i = n_out; i < half->size(); ++i) {
        auto& t = (*half)[i];
        saved.push_back(t.is_view() ? t.detach() : t);
        versions.push_back(static_cast<int64_t>(t._version()));
      }
    ctx->saved_data["saved"] = std::move(saved);
    ctx->saved_data["versions"] = c10::IValue(versions);
    ctx->saved_data["split"] = split_id;
    ctx->saved_data["n_in"] = static_cast<int64_t>(inputs.size());
    return user;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto s = split_of(ctx->saved_data["split"].toInt());
    // A backward with donated buffers writes into saved tensors: a second one would read
    // what the first overwrote, so retain_graph=True raises as in AOTAutograd.
    TORCH_CHECK(s->donated.empty() || !torch::autograd::get_current_graph_task_keep_graph(),
                s->donated);
    variable_list saved = take_saved(ctx);
    auto res = autopar_native::backward_results(
        [&]() { return backward_halves(*s, std::move(saved), grads); });
    res.resize(ctx->saved_data["n_in"].toInt());
    res.resize(res.size() + 2);  // split_id, n_out: no gradients
    return res;
  }
};

using EntrySpec = std::tuple<std::string, int64_t, int64_t>;  // (library, inputs, outputs)

int64_t split_program(const EntrySpec& fw, const EntrySpec& bw, std::vector<bool> picked,
                      int64_t rows, std::vector<int64_t> grad_at, std::string donated) {
  auto s = std::make_shared<Split>(Split{std::apply(entry_in, fw), std::apply(entry_in, bw),
                                         rows / 2, rows, std::move(picked), std::move(grad_at),
                                         std::move(donated)});
  std::lock_guard<std::mutex> g(g_splits_mu);
  auto id = reinterpret_cast<int64_t>(s.get());
  g_splits[id] = std::move(s);
  return id;
}

variable_list split_apply(std::vector<at::Tensor> inputs, int64_t split_id, int64_t n_out) {
  py::gil_scoped_release no_gil;
  return SplitFunction::apply(at::TensorList(inputs), split_id, n_out);
}

}  // namespace

void register_split(py::module& m) {
  m.def("split_program", &split_program,
        "A batch split of a training graph: its forward and backward C++-wrapper libraries "
        "(path, inputs, outputs), the batched "
        "inputs, the rows, the outputs that take gradients, the error for retain_graph=True "
        "(empty: none); its id");
  m.def("split_apply", &split_apply,
        "The split's forward on both halves at once as one C++ autograd function: the user "
        "outputs (see split.cpp)");
}
