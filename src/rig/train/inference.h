// Where the tools around a run compute (rig eval, generate, merge, debug forward-backward): one
// reading of --device and --dtype for all of them, resolved as a training config's `device:` and
// `precision:` are, and the model placed there for inference.
#pragma once
#include <string>

#include "rig/core/tensor.h"
#include "rig/model/llama.h"

namespace rig {

struct ComputeTarget {
  Device device;
  DType dtype = DType::F32;  // the compute dtype: F32, or BF16 (CUDA only)
  std::string str() const;   // "cuda:0, bf16"
};

// device: "auto" (cuda:0 when a GPU is visible, else the CPU), "cpu", "cuda", "cuda:N", as
// resolve_device (an unavailable CUDA device is an InputError naming `what`). dtype: "auto" (bf16
// on CUDA, as `precision: auto` trains; f32 on the CPU), "f32" (or "fp32"), "bf16"; bf16 on the
// CPU is an InputError naming `what`.
ComputeTarget resolve_compute(const std::string& device, const std::string& dtype,
                              const std::string& what);

// Moves a loaded model (adapter attached) to the target for inference: every parameter frozen,
// so that under bf16 the matrices are kept in bf16 only (no float32 master copy: an 8B model
// takes 16 GB on the GPU, not 48), cast on the host before they cross the bus; 4-bit (QLoRA)
// weights stay 4-bit and are decoded just before each product. With keep_trainable (debug
// forward-backward) the trainable parameters keep their float32 values for their gradients.
void place_for_inference(LlamaModel& m, const ComputeTarget& t, bool keep_trainable = false);

}  // namespace rig
