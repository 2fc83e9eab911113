// What nf4.cpp (the arithmetic) and nf4_io.cpp (the files) share. Internal to the quant module.
#pragma once
#include "rig/core/tensor.h"

namespace rig::quant {

inline Tensor on_cpu(const Tensor& t) {
  return t.device().is_cpu() ? t : t.to(Device::cpu(), "quant state");
}

}  // namespace rig::quant
