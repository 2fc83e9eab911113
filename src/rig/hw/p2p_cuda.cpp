// CUDA builds only: asks the runtime about peer access and times cudaMemcpyPeer between every
// ordered pair of GPUs.
#include <cuda_runtime.h>
#include <fmt/format.h>

#include <cstdio>

#include "rig/hw/p2p.h"

namespace rig::hw {

namespace {

bool parse_bus(const std::string& s, unsigned v[4]) {
  return std::sscanf(s.c_str(), "%x:%x:%x.%x", &v[0], &v[1], &v[2], &v[3]) == 4;
}

bool same_bus(const std::string& a, const std::string& b) {
  unsigned x[4], y[4];
  return parse_bus(a, x) && parse_bus(b, y) && x[0] == y[0] && x[1] == y[1] && x[2] == y[2] &&
         x[3] == y[3];
}

}  // namespace

P2PMatrix measure_p2p(const std::vector<std::string>& bus_ids) {
  P2PMatrix m;
  size_t n = bus_ids.size();
  m.can_access.assign(n, std::vector<int>(n, -1));
  m.gbps.assign(n, std::vector<double>(n, 0.0));
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    cudaGetLastError();
    m.note = "not measured (the CUDA runtime sees no GPU)";
    return m;
  }
  // CUDA's order (fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID) may differ from NVML's.
  std::vector<int> cuda_of(n, -1);
  for (int d = 0; d < count; ++d) {
    char bus[32] = {};
    if (cudaDeviceGetPCIBusId(bus, sizeof bus, d) != cudaSuccess) continue;
    for (size_t i = 0; i < n; ++i)
      if (same_bus(bus, bus_ids[i])) cuda_of[i] = d;
  }
  constexpr size_t kBytes = size_t(64) << 20;
  constexpr int kReps = 5;
  std::vector<void*> buf(n, nullptr);
  for (size_t i = 0; i < n; ++i) {
    if (cuda_of[i] < 0) continue;
    cudaSetDevice(cuda_of[i]);
    if (cudaMalloc(&buf[i], kBytes) != cudaSuccess) buf[i] = nullptr;
  }
  for (size_t i = 0; i < n; ++i) {
    for (size_t j = 0; j < n; ++j) {
      if (i == j || cuda_of[i] < 0 || cuda_of[j] < 0) continue;
      int ok = 0;
      if (cudaDeviceCanAccessPeer(&ok, cuda_of[i], cuda_of[j]) == cudaSuccess)
        m.can_access[i][j] = ok;
      if (!buf[i] || !buf[j]) continue;
      cudaSetDevice(cuda_of[i]);
      if (ok) {
        cudaError_t e = cudaDeviceEnablePeerAccess(cuda_of[j], 0);
        if (e != cudaSuccess && e != cudaErrorPeerAccessAlreadyEnabled) m.can_access[i][j] = 0;
      }
      cudaStream_t st;
      cudaEvent_t t0, t1;
      cudaStreamCreate(&st);
      cudaEventCreate(&t0);
      cudaEventCreate(&t1);
      // One warm-up copy, then timed ones; without peer access the runtime stages through host.
      cudaMemcpyPeerAsync(buf[j], cuda_of[j], buf[i], cuda_of[i], kBytes, st);
      cudaEventRecord(t0, st);
      for (int r = 0; r < kReps; ++r)
        cudaMemcpyPeerAsync(buf[j], cuda_of[j], buf[i], cuda_of[i], kBytes, st);
      cudaEventRecord(t1, st);
      float ms = 0;
      if (cudaEventSynchronize(t1) == cudaSuccess &&
          cudaEventElapsedTime(&ms, t0, t1) == cudaSuccess && ms > 0)
        m.gbps[i][j] = double(kBytes) * kReps / (ms * 1e-3) / 1e9;
      cudaEventDestroy(t0);
      cudaEventDestroy(t1);
      cudaStreamDestroy(st);
      if (ok) cudaDeviceDisablePeerAccess(cuda_of[j]);
      cudaGetLastError();  // a failed pair must not poison the next one
    }
  }
  for (size_t i = 0; i < n; ++i)
    if (buf[i]) {
      cudaSetDevice(cuda_of[i]);
      cudaFree(buf[i]);
    }
  m.measured = true;
  m.note = fmt::format("cudaMemcpyPeerAsync, {} MiB x {}", kBytes >> 20, kReps);
  return m;
}

}  // namespace rig::hw
