// What the distributed layer needs to know of the host and its GPUs, beside core/tensor.h.
#pragma once
#include <cstddef>
#include <memory>

namespace rig {

int cuda_device_count();  // 0 in a build without CUDA or on a machine without a GPU
// Host memory for staging copies to and from GPUs: page-locked when a GPU is visible (copies run
// at full speed and need no bounce buffer), plain otherwise. Freed with the last reference.
std::shared_ptr<void> pinned_host_block(size_t bytes);

}  // namespace rig
