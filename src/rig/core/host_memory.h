// What the distributed layer needs to know of the host and its GPUs, beside core/tensor.h.
#pragma once
#include <cstddef>
#include <memory>

namespace rig {

int cuda_device_count();  // 0 in a build without CUDA or on a machine without a GPU
size_t cuda_total_memory(int index);  // the GPU's memory in bytes; 0 without CUDA
// Host memory for staging copies to and from GPUs: page-locked when a GPU is visible (copies run
// at full speed and need no bounce buffer), plain otherwise. Freed with the last reference.
std::shared_ptr<void> pinned_host_block(size_t bytes);
// Page-locks memory allocated elsewhere (a shared-memory segment) for fast copies to and from
// GPUs; false where that is not possible (no GPU, or the driver refuses).
bool pin_host_range(void* p, size_t bytes);
void unpin_host_range(void* p);

// Device memory that other processes on this host map (CUDA IPC): how ranks sharing a GPU
// exchange tensors without the round trip through host memory. A handle is 64 opaque bytes.
// ipc_alloc and ipc_open return false / nullptr where that is not possible (no CUDA, or the
// driver refuses).
bool ipc_alloc(int device, size_t bytes, void** p, char handle[64]);
void ipc_free(int device, void* p);
void* ipc_open(int device, const char handle[64]);
void ipc_close(int device, void* p);
// Waits for the work queued on the stream the ops run on (the legacy default stream).
void device_stream_sync(int device);

}  // namespace rig
