// Token embedding: a row gather forward; a backward that sorts the rows by id and sums each id's
// rows in their original order before adding them to the table once (no atomics: bitwise
// repeatable, whatever the batch).
#include <cub/device/device_radix_sort.cuh>

#include "rig/ops/cuda/common.cuh"

namespace rig::ops::cuda::k {

namespace {

template <typename Tt, typename O>
__global__ void embedding_fwd_kernel(const int64_t* ids, const Tt* table, int64_t vocab, int64_t h,
                                     O* out, DeviceError* err) {
  const int64_t r = blockIdx.x;
  const int64_t id = ids[r];
  const bool ok = id >= 0 && id < vocab;
  if (!ok && threadIdx.x == 0) rig_device_error(err, kBadTokenId, r, id, vocab);
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x)
    st(out, r * h + j, ok ? ld(table, id * h + j) : 0.0f);
}

template <typename D, typename Tt>
__global__ void embedding_bwd_runs_kernel(const int64_t* sorted_ids, const int* sorted_rows,
                                          int64_t rows, const D* dout, Tt* dtable, int64_t vocab,
                                          int64_t h) {
  const int64_t i = blockIdx.x;
  const int64_t id = sorted_ids[i];
  if (i > 0 && sorted_ids[i - 1] == id) return;  // not the first row of its id
  if (id < 0 || id >= vocab) return;             // reported by the forward
  for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
    float acc = 0;
    for (int64_t k = i; k < rows && sorted_ids[k] == id; ++k)
      acc += ld(dout, int64_t(sorted_rows[k]) * h + j);
    st(dtable, id * h + j, ld(dtable, id * h + j) + acc);
  }
}

__global__ void iota_kernel(int* v, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n;
       i += int64_t(gridDim.x) * blockDim.x)
    v[i] = int(i);
}

// The scratch layout: sorted ids, row indices before and after the sort, CUB's temporary space.
struct BwdScratch {
  int64_t* sorted_ids;
  int *rows_in, *rows_out;
  void* temp;
  size_t temp_bytes;
};
size_t align256(size_t b) {
  return (b + 255) / 256 * 256;
}
size_t cub_temp_bytes(int64_t rows) {
  size_t t = 0;
  cub::DeviceRadixSort::SortPairs(nullptr, t, static_cast<const int64_t*>(nullptr),
                                  static_cast<int64_t*>(nullptr), static_cast<const int*>(nullptr),
                                  static_cast<int*>(nullptr), int(rows));
  return t;
}
BwdScratch carve(void* scratch, int64_t rows) {
  char* p = static_cast<char*>(scratch);
  BwdScratch s;
  s.sorted_ids = reinterpret_cast<int64_t*>(p);
  p += align256(sizeof(int64_t) * size_t(rows));
  s.rows_in = reinterpret_cast<int*>(p);
  p += align256(sizeof(int) * size_t(rows));
  s.rows_out = reinterpret_cast<int*>(p);
  p += align256(sizeof(int) * size_t(rows));
  s.temp = p;
  s.temp_bytes = cub_temp_bytes(rows);
  return s;
}

}  // namespace

cudaError_t embedding_fwd(const int64_t* ids, int64_t rows, T tt, const void* table, int64_t vocab,
                          int64_t h, T to, void* out, DeviceError* err, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  RIG_K_DISPATCH(tt, Tt, RIG_K_DISPATCH(to, O, (embedding_fwd_kernel<Tt, O><<<unsigned(rows), 256, 0, s>>>(
                                                    ids, static_cast<const Tt*>(table), vocab, h, static_cast<O*>(out), err))));
  return cudaGetLastError();
}

size_t embedding_bwd_scratch_bytes(int64_t rows) {
  return align256(sizeof(int64_t) * size_t(rows)) + 2 * align256(sizeof(int) * size_t(rows)) +
         cub_temp_bytes(rows);
}

cudaError_t embedding_bwd(const int64_t* ids, int64_t rows, T td, const void* dout, T tt,
                          void* dtable, int64_t vocab, int64_t h, void* scratch, cudaStream_t s) {
  if (rows == 0) return cudaSuccess;
  BwdScratch b = carve(scratch, rows);
  iota_kernel<<<grid_for(rows, 256), 256, 0, s>>>(b.rows_in, rows);
  cudaError_t e =
      cub::DeviceRadixSort::SortPairs(b.temp, b.temp_bytes, ids, b.sorted_ids, b.rows_in,
                                      b.rows_out, int(rows), 0, int(sizeof(int64_t) * 8), s);
  if (e != cudaSuccess) return e;
  RIG_K_DISPATCH(td, D,
                 RIG_K_DISPATCH(tt, Tt,
                                (embedding_bwd_runs_kernel<D, Tt><<<unsigned(rows), 256, 0, s>>>(
                                    b.sorted_ids, b.rows_out, rows, static_cast<const D*>(dout),
                                    static_cast<Tt*>(dtable), vocab, h))));
  return cudaGetLastError();
}

}  // namespace rig::ops::cuda::k
