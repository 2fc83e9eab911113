// gemm through cuBLASLt, float32 compute (CUBLAS_COMPUTE_32F: true fp32 for F32 inputs, no TF32;
// fp32 accumulation for BF16 inputs). Row-major C = alpha op(A) op(B) + beta C is computed as the
// column-major C^T = op(B)^T op(A)^T, so no data moves. One handle and one workspace per device;
// the heuristic's choice is cached per shape, dtypes, transposes and pointer alignment.
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "rig/core/allocator.h"
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"

namespace rig::ops::cuda {

namespace {

constexpr size_t kWorkspace = size_t(32) << 20;
constexpr int kTuneCandidates = 8;

// The first product of each shape times cuBLASLt's top candidates and keeps the fastest (one
// synchronisation per new shape) instead of taking the heuristic's first answer: 1.6% of a 1B
// full fine-tuning step on the H200. Off in deterministic mode, where every process must pick the
// same algorithm, and with RIG_GEMM_AUTOTUNE=0.
bool autotune() {
  static const bool env_off = [] {
    const char* v = std::getenv("RIG_GEMM_AUTOTUNE");
    return v && std::string(v) == "0";
  }();
  return !env_off && !deterministic();
}

struct LtDevice {
  cublasLtHandle_t handle = nullptr;
  Tensor workspace;  // from the device's caching allocator, so it counts against the budget
};

struct AlgoKey {
  int dev;
  int64_t m, n, k;
  bool ta, tb;
  int tab, tc;
  uint32_t align_a, align_b, align_c;
  bool beta_zero;
  int bias_type;  // -1: no bias epilogue
  auto tie() const {
    return std::tie(dev, m, n, k, ta, tb, tab, tc, align_a, align_b, align_c, beta_zero, bias_type);
  }
  bool operator<(const AlgoKey& o) const { return tie() < o.tie(); }
};

std::mutex g_mu;
// Never destroyed: handles and workspaces must outlive other static objects at exit.
std::vector<LtDevice>& devices() {
  static auto* d = new std::vector<LtDevice>();
  return *d;
}
// nullopt: cuBLASLt offered no algorithm (only possible with an epilogue; the caller falls back).
std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>>& algos() {
  static auto* a = new std::map<AlgoKey, std::optional<cublasLtMatmulAlgo_t>>();
  return *a;
}
int64_t g_bias_fallbacks = 0;

LtDevice& lt_device(int dev) {
  auto& ds = devices();
  if (size_t(dev) >= ds.size()) ds.resize(size_t(dev) + 1);
  LtDevice& d = ds[size_t(dev)];
  if (!d.handle) {
    RIG_CUBLAS_CHECK(cublasLtCreate(&d.handle));
    d.workspace = Tensor::empty({int64_t(kWorkspace)}, DType::U8, Device::cuda(dev),
                                "cuBLASLt workspace");
  }
  return d;
}

uint32_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  uint32_t al = 256;
  while (al > 1 && (a % al) != 0) al /= 2;
  return al;
}

cudaDataType_t cuda_type(DType t) { return t == DType::F32 ? CUDA_R_32F : CUDA_R_16BF; }

// RAII holders so a failing check does not leak descriptors.
struct OpDesc {
  cublasLtMatmulDesc_t d = nullptr;
  ~OpDesc() { if (d) cublasLtMatmulDescDestroy(d); }
};
struct Layout {
  cublasLtMatrixLayout_t d = nullptr;
  ~Layout() { if (d) cublasLtMatrixLayoutDestroy(d); }
};
struct Pref {
  cublasLtMatmulPreference_t d = nullptr;
  ~Pref() { if (d) cublasLtMatmulPreferenceDestroy(d); }
};

struct Dims {
  int64_t m, n, k;
};

// Checks devices, shapes and dtypes of C = op(A) op(B) (+ src, + bias); returns m, n, k.
Dims check_args(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& c,
                const Tensor* bias, const Tensor* src) {
  const char* op = "gemm";
  const int dev = c.device().index;
  check_on(a, dev, op, "A");
  check_on(b, dev, op, "B");
  RIG_CHECK(a.ndim() == 2 && b.ndim() == 2 && c.ndim() == 2, "gemm needs 2-D tensors");
  const int64_t m = ta ? a.dim(1) : a.dim(0), k = ta ? a.dim(0) : a.dim(1);
  const int64_t kb = tb ? b.dim(1) : b.dim(0), n = tb ? b.dim(0) : b.dim(1);
  RIG_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes {}{} x {}{} -> {}",
            shape_str(a.shape()), ta ? "^T" : "", shape_str(b.shape()), tb ? "^T" : "",
            shape_str(c.shape()));
  ktype(a, op, "A");
  ktype(c, op, "C");
  RIG_CHECK(a.dtype() == b.dtype(), "gemm: A is {} but B is {}; cast one first",
            dtype_name(a.dtype()), dtype_name(b.dtype()));
  RIG_CHECK(!(a.dtype() == DType::F32 && c.dtype() != DType::F32),
            "gemm: F32 inputs need an F32 output, got {}", dtype_name(c.dtype()));
  if (src) {
    check_on(*src, dev, op, "src");
    RIG_CHECK(src->shape() == c.shape() && src->dtype() == c.dtype(),
              "gemm_plus: src is {} {} but out is {} {}", dtype_name(src->dtype()),
              shape_str(src->shape()), dtype_name(c.dtype()), shape_str(c.shape()));
  }
  if (bias) {
    check_on(*bias, dev, op, "bias");
    ktype(*bias, op, "bias");
    RIG_CHECK(bias->numel() == n, "gemm: bias {} for {} columns", shape_str(bias->shape()), n);
  }
  return {m, n, k};
}

// The operation descriptor: cuBLAS's first operand is B (its memory is op(B)^T's source), its
// second is A; the bias epilogue when asked.
void describe(OpDesc& desc, bool ta, bool tb, const Tensor* bias) {
  RIG_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.d, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t opa = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
  const cublasOperation_t opb = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  RIG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof(opa)));
  RIG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof(opb)));
  if (!bias) return;
  // Column-major D is C^T: its rows are C's columns, which is where the epilogue adds bias[i].
  const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
  const void* ptr = bias->raw();
  const cudaDataType_t bt = cuda_type(bias->dtype());
  RIG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
  RIG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &ptr, sizeof(ptr)));
  RIG_CUBLAS_CHECK(
      cublasLtMatmulDescSetAttribute(desc.d, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
}

// One product as cuBLASLt sees it: descriptors, operands and where D goes.
struct Product {
  LtDevice& ld;
  OpDesc desc;
  Layout la, lb, lc;  // column-major views of B, A and C
  const Tensor &a, &b;
  Tensor& c;
  float alpha, beta;
  int dev;
  cublasStatus_t run(const cublasLtMatmulAlgo_t& algo, void* d) const {
    return cublasLtMatmul(ld.handle, desc.d, &alpha, b.raw(), la.d, a.raw(), lb.d, &beta, c.raw(),
                          lc.d, d, lc.d, &algo, ld.workspace.raw(), kWorkspace, stream_for(dev));
  }
};

// Times each candidate and returns the fastest's index. With beta = 0, C's contents are about to
// be replaced, so the candidates write there; otherwise C is read and they write a scratch.
int fastest(const Product& p, const cublasLtMatmulHeuristicResult_t* res, int found) {
  Tensor scratch_d = p.beta == 0.0f ? p.c
                                    : Tensor::empty(p.c.shape(), p.c.dtype(), p.c.device(),
                                                    "gemm autotune output");
  cudaEvent_t e0, e1;
  RIG_CUDA_CHECK(cudaEventCreate(&e0));
  RIG_CUDA_CHECK(cudaEventCreate(&e1));
  // Three rounds over all candidates, each keeping its best: clocks still ramping up during the
  // first round then favour no candidate. (With one round, two runs of the same 1B step picked
  // different algorithms for a product, and its speed differed by 15%.)
  std::vector<float> best(size_t(found), INFINITY);  // stays infinite: cannot run here
  std::vector<bool> runs(size_t(found), false);
  for (int i = 0; i < found; ++i)
    runs[size_t(i)] = p.run(res[i].algo, scratch_d.raw()) == CUBLAS_STATUS_SUCCESS;
  for (int round = 0; round < 3; ++round)
    for (int i = 0; i < found; ++i) {
      if (!runs[size_t(i)]) continue;
      RIG_CUDA_CHECK(cudaEventRecord(e0, stream_for(p.dev)));
      for (int r = 0; r < 2; ++r) (void)p.run(res[i].algo, scratch_d.raw());
      RIG_CUDA_CHECK(cudaEventRecord(e1, stream_for(p.dev)));
      RIG_CUDA_CHECK(cudaEventSynchronize(e1));
      float ms = 0;
      RIG_CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
      best[size_t(i)] = std::min(best[size_t(i)], ms);
    }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  return int(std::min_element(best.begin(), best.end()) - best.begin());
}

// The algorithm for a new key: the heuristic's answer, or the fastest of its candidates.
// nullopt when it has none for the bias epilogue (the caller falls back).
std::optional<cublasLtMatmulAlgo_t> choose(const Product& p, const AlgoKey& key, bool bias) {
  Pref pref;
  RIG_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref.d));
  const size_t ws = kWorkspace;
  RIG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref.d, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  // Views (slice_rows) can be less aligned than fresh allocations: tell the heuristic.
  for (auto [attr, al] : {std::pair{CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_a},
                          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_b},
                          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c},
                          {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c}})
    RIG_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref.d, attr, &al, sizeof(al)));
  const int want = autotune() ? kTuneCandidates : 1;
  cublasLtMatmulHeuristicResult_t res[kTuneCandidates]{};
  int found = 0;
  const cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(
      p.ld.handle, p.desc.d, p.la.d, p.lb.d, p.lc.d, p.lc.d, pref.d, want, res, &found);
  if (bias && (st != CUBLAS_STATUS_SUCCESS || found == 0)) return std::nullopt;
  RIG_CUBLAS_CHECK(st);
  RIG_CHECK(found > 0, "gemm: cuBLASLt has no algorithm for {}{} x {}{} -> {} ({} x {} -> {})",
            shape_str(p.a.shape()), key.ta ? "^T" : "", shape_str(p.b.shape()), key.tb ? "^T" : "",
            shape_str(p.c.shape()), dtype_name(p.a.dtype()), dtype_name(p.b.dtype()),
            dtype_name(p.c.dtype()));
  return res[found > 1 ? fastest(p, res, found) : 0].algo;
}

// C = alpha op(A) op(B) + beta src (+ bias per column of C through the bias epilogue); src is C
// itself unless given. Returns false when cuBLASLt has no algorithm for the bias epilogue, having
// done nothing.
bool matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta,
            const Tensor* bias, const Tensor* src = nullptr) {
  const auto [m, n, k] = check_args(a, ta, b, tb, c, bias, src);
  if (m == 0 || n == 0) return true;
  if (k == 0) {
    if (src && beta != 0) c.copy_from(*src);
    if (beta == 0) c.zero_(); else scale_(c, beta);
    if (bias) add_bias(c, *bias);
    return true;
  }

  const int dev = c.device().index;
  DeviceGuard guard(dev);
  if (src && src->raw() != c.raw() && beta != 0) {
    // cuBLASLt's kernels with C != D ran ~20% slower than in place on the H200 (the residual
    // products of a 1B step: 537 against 680 TF/s); a copy first costs far less.
    RIG_CUDA_CHECK(cudaMemcpyAsync(c.raw(), src->raw(), c.nbytes(), cudaMemcpyDeviceToDevice,
                                   stream_for(dev)));
  }
  std::lock_guard<std::mutex> lock(g_mu);
  const cudaDataType_t tab = cuda_type(a.dtype()), tc = cuda_type(c.dtype());
  Product p{lt_device(dev), {}, {}, {}, {}, a, b, c, alpha, beta, dev};
  describe(p.desc, ta, tb, bias);
  RIG_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.la.d, tab, uint64_t(b.dim(1)), uint64_t(b.dim(0)), b.dim(1)));
  RIG_CUBLAS_CHECK(
      cublasLtMatrixLayoutCreate(&p.lb.d, tab, uint64_t(a.dim(1)), uint64_t(a.dim(0)), a.dim(1)));
  RIG_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.lc.d, tc, uint64_t(n), uint64_t(m), n));

  const AlgoKey key{dev,
                    m,
                    n,
                    k,
                    ta,
                    tb,
                    int(tab),
                    int(tc),
                    alignment(b.raw()),
                    alignment(a.raw()),
                    alignment(c.raw()),
                    beta == 0.0f,
                    bias ? int(cuda_type(bias->dtype())) : -1};
  auto it = algos().find(key);
  if (it == algos().end()) it = algos().emplace(key, choose(p, key, bias != nullptr)).first;
  if (!it->second) return false;
  RIG_CUBLAS_CHECK(p.run(*it->second, c.raw()));
  return true;
}

}  // namespace

void gemm(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, float alpha, float beta) {
  matmul(a, ta, b, tb, c, alpha, beta, nullptr);
}

void gemm_plus(const Tensor& a, bool ta, const Tensor& b, bool tb, const Tensor& src, Tensor& out,
               float alpha, float beta) {
  matmul(a, ta, b, tb, out, alpha, beta, nullptr, &src);
}

void gemm_bias(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, const Tensor& bias) {
  if (matmul(a, ta, b, tb, c, 1.0f, 0.0f, &bias)) return;
  {
    std::lock_guard<std::mutex> lock(g_mu);
    ++g_bias_fallbacks;
  }
  matmul(a, ta, b, tb, c, 1.0f, 0.0f, nullptr);
  add_bias(c, bias);
}

int64_t gemm_bias_fallbacks() {
  std::lock_guard<std::mutex> lock(g_mu);
  return g_bias_fallbacks;
}

}  // namespace rig::ops::cuda
