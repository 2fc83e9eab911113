// Helpers for the Hugging Face reference fixtures in tests/data/hf (scripts/make_hf_fixtures.py),
// shared by the CPU tests (tests/unit) and the GPU tests (tests/gpu).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/model/llama.h"
#include "rig/optim/adamw.h"

namespace rig::test {

// The optimizer settings a reference.json section records.
inline OptimizerConfig optimizer_from(const nlohmann::json& cfg) {
  OptimizerConfig oc;
  oc.lr = cfg["lr"];
  oc.beta1 = cfg["betas"][0];
  oc.beta2 = cfg["betas"][1];
  oc.eps = cfg["eps"];
  oc.weight_decay = cfg["weight_decay"];
  oc.max_grad_norm = cfg["clip_grad_norm"];
  return oc;
}

// Replays the 300-step run of the fixture folder `dir` (hf/tiny-llama3/: its batches, optimizer
// and 20-step warm-up) on `m`. After each step `keep_going(step, relative difference from
// transformers' loss, loss, transformers' loss)` reports a failure if it sees one and says
// whether to go on. Returns the worst relative difference of the steps run. `variant`, when given,
// supplies the optimizer's 8-bit settings; `state_bytes` receives its state's size at the end.
inline double replay_loss_curve(
    LlamaModel& m, const std::string& dir,
    const std::function<bool(int64_t step, double rel, double loss, double want)>& keep_going,
    const OptimizerConfig* variant = nullptr, size_t* state_bytes = nullptr) {
  const auto ref = nlohmann::json::parse(read_file(dir + "loss_curve.json"));
  const Tensor tokens = SafeTensorsFile::open(dir + "loss_curve_data.safetensors").get("tokens");
  OptimizerConfig oc = optimizer_from(ref["optimizer"]);
  if (variant) {
    oc.eight_bit = variant->eight_bit;
    oc.min_8bit_size = variant->min_8bit_size;
  }
  AdamW opt(oc);
  const int64_t steps = ref["steps"], B = ref["batch"], T = ref["seq"], row = tokens.dim(2);
  double worst = 0;
  for (int64_t s = 0; s < steps; ++s) {
    TokenBatch b{Tensor::empty({B, T}, DType::I64), Tensor::empty({B, T}, DType::I64), {}, {}};
    for (int64_t i = 0; i < B; ++i)
      for (int64_t t = 0; t < T; ++t)
        b.input_ids.data<int64_t>()[i * T + t] = b.labels.data<int64_t>()[i * T + t] =
            tokens.data<int64_t>()[(s * B + i) * row + t];
    m.zero_grad();
    const double loss = m.step(b, StepOptions{}).loss();
    // The fixture's warm-up: lr * min(1, (step + 1) / 20).
    opt.clip_and_step(m.params(), oc.lr * std::min(1.0f, float(s + 1) / 20.0f));
    m.refresh_compute_weights();  // bf16 copies of the weights on the GPU; nothing in float32
    const double want = ref["losses"][size_t(s)];
    const double rel = std::fabs(loss - want) / want;
    worst = std::max(worst, rel);
    if (!keep_going(s, rel, loss, want)) break;
  }
  if (state_bytes) *state_bytes = opt.state_bytes();
  return worst;
}

}  // namespace rig::test
