// A native autograd function's backward under create_graph=True (interp.cpp's
// DirectFunction, split.cpp's SplitFunction): its results are connected to the graph, and
// differentiating them raises the error AOTAutograd raises, as capture.direct_autograd's
// Python _NoDoubleBackward does.
#pragma once

#include <torch/extension.h>

#include <functional>
#include <utility>
#include <vector>

namespace autopar_native {

inline constexpr const char* kDoubleBackward =
    "torch.compile with aot_autograd does not currently support double backward (autopar: a "
    "compiled graph's backward cannot be differentiated again; run that part eagerly)";

// run()'s defined results as the function's outputs (an output must be defined: `defined`
// records which were, for connected() to put the undefined ones back).
struct NoDoubleBackward : public torch::autograd::Function<NoDoubleBackward> {
  static constexpr bool is_traceable = false;  // compiled autograd calls it as it is
  static torch::autograd::variable_list forward(
      torch::autograd::AutogradContext*, at::Tensor anchor,
      std::function<torch::autograd::variable_list()> run, std::vector<bool>* defined) {
    torch::autograd::variable_list res;
    for (auto& t : run()) {
      defined->push_back(t.defined());
      if (t.defined()) res.push_back(std::move(t));
    }
    return res;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list) {
    TORCH_CHECK(false, kDoubleBackward);
  }
};

// A backward's gradients, from run(): as they are, or under create_graph=True (grad mode on
// in the backward) connected to the graph through NoDoubleBackward. A leaf that requires
// grad gives them a grad_fn even where nothing else does, as in AOTAutograd.
inline torch::autograd::variable_list backward_results(
    std::function<torch::autograd::variable_list()> run) {
  if (!at::GradMode::is_enabled()) return run();
  auto anchor = at::empty({0}).set_requires_grad(true);
  std::vector<bool> defined;
  auto got = NoDoubleBackward::apply(anchor, std::move(run), &defined);
  torch::autograd::variable_list res;
  size_t k = 0;
  for (bool d : defined) res.push_back(d ? got[k++] : at::Tensor());
  return res;
}

}  // namespace autopar_native
