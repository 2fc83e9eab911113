#include "rig/train/inference.h"

namespace rig {

std::string ComputeTarget::str() const {
  return fmt::format("{}, {}", device.str(), dtype == DType::BF16 ? "bf16" : "f32");
}

ComputeTarget resolve_compute(const std::string& device, const std::string& dtype,
                              const std::string& what) {
  ComputeTarget t;
  if (dtype != "auto" && dtype != "f32" && dtype != "fp32" && dtype != "bf16")
    bad_input("{}: --dtype '{}' is not one of auto, f32, bf16", what, dtype);
  t.device = resolve_device(device, what);
  if (dtype == "bf16" && !t.device.is_cuda())
    bad_input("{}: --dtype bf16 needs a CUDA device; the CPU backend computes in f32", what);
  t.dtype = dtype == "bf16" || (dtype == "auto" && t.device.is_cuda()) ? DType::BF16 : DType::F32;
  return t;
}

void place_for_inference(LlamaModel& m, const ComputeTarget& t, bool keep_trainable) {
  if (!keep_trainable)
    for (auto& p : m.params()) p.trainable = false;
  m.set_compute_dtype(t.dtype);  // on the host: bf16 matrices cross the bus in bf16
  m.to_device(t.device);
  m.materialize_4bit(t.device);  // a random model's deferred 4-bit codes (none when loaded)
}

}  // namespace rig
