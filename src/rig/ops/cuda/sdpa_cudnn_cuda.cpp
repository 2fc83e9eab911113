// cuDNN fused attention through the backend descriptors (no cudnn-frontend, which is not packaged).
//
// The graphs are the "composite" SDPA patterns that cuDNN recognises and runs as one fused flash
// kernel (the plan reports finalizeMode SDPA_FWD / SDPA_BWD): matmul, scale, causal select from
// generated row/column indices, max / exp / sum reductions, and the P·V product. The dedicated
// SDPA operation descriptors have no causal attribute before cuDNN 9.21, so they are not used.
//
// rig's tensors are [B,T,H,D]; cuDNN's logical dims are {B,H,T,D}, so every tensor is described
// with permuted strides and read in place. Kᵀ (and Vᵀ in backward) are K's own buffer with the last
// two dims and strides swapped. Grouped-query heads broadcast in the matmuls; backward reduces the
// full-head dK/dV partials over each group.
//
// Plans are built once per (device, shape, variant) and kept for the thread's life: building costs
// 50 ms to 1 s. A shape cuDNN declines is remembered too, with its reason, so the caller falls back
// without asking again.
#include "rig/ops/cuda/sdpa_cudnn.h"

#ifdef RIG_WITH_CUDNN
#include <cmath>
#include <limits>

#include "rig/core/cuda_check.h"
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/sdpa_cudnn_graph.h"
#endif

namespace rig::ops::cuda::sdpa_cudnn {

#ifndef RIG_WITH_CUDNN

int runtime_version() {
  return 0;
}
bool forward(const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&, std::string* why) {
  *why = "rig was built without cuDNN";
  return false;
}
bool backward(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
              const Tensor&, Tensor&, Tensor&, Tensor&, bool, std::string* why) {
  *why = "rig was built without cuDNN";
  return false;
}

#else

using namespace detail;

namespace {

std::unique_ptr<Graph> forward_graph(cudnnHandle_t h, const Shape& x) {
  auto g = std::make_unique<Graph>();
  const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  const Dims sd{x.B, x.Hq, x.T, x.T}, ss{x.Hq * x.T * x.T, x.T * x.T, x.T, 1};
  const Dims rd{x.B, x.Hq, x.T, 1}, rs{x.Hq * x.T, x.T, 1, 1};
  Desc Q = g->tensor(kQ, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc Kt = g->tensor(kK, bf, bhdt(x, x.Hk), bhdt_strides(x, x.Hk), false);
  Desc V = g->tensor(kV, bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false);
  Desc O = g->tensor(kO, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc stats = g->tensor(kStats, f32, rd, rs, false);
  Desc scale = g->scalar(kScale), neg_inf = g->scalar(kNegInf);

  Desc S = g->virt(f32, sd, ss);
  g->matmul(Q, Kt, S);
  Desc S2 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, S, scale, nullptr, S2);
  Desc S3 = g->causal(S2, neg_inf, sd, ss);
  g->softmax_times_v(S3, V, O, stats, x);
  g->plan(h);
  return g;
}

std::unique_ptr<Graph> backward_graph(cudnnHandle_t h, const Shape& x, bool deterministic) {
  auto g = std::make_unique<Graph>();
  const auto bf = CUDNN_DATA_BFLOAT16, f32 = CUDNN_DATA_FLOAT;
  const Dims sd{x.B, x.Hq, x.T, x.T}, ss{x.Hq * x.T * x.T, x.T * x.T, x.T, 1};
  const Dims ts{x.Hq * x.T * x.T, x.T * x.T, 1, x.T};  // the transposed [T,T] view
  const Dims rd{x.B, x.Hq, x.T, 1}, rs{x.Hq * x.T, x.T, 1, 1};
  const Dims full = bhtd(x, x.Hq), full_s{x.Hq * x.T * x.D, x.T * x.D, x.D, 1};
  const bool gqa = x.Hq != x.Hk;
  Desc Q = g->tensor(kQ, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc Kt = g->tensor(kK, bf, bhdt(x, x.Hk), bhdt_strides(x, x.Hk), false);
  Desc Vt = g->tensor(kV, bf, bhdt(x, x.Hk), bhdt_strides(x, x.Hk), false);
  Desc O = g->tensor(kO, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc dO = g->tensor(kDO, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc stats = g->tensor(kStats, f32, rd, rs, false);
  Desc dQ = g->tensor(kDQ, bf, bhtd(x, x.Hq), bhtd_strides(x, x.Hq), false);
  Desc dK = g->tensor(kDK, bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false);
  Desc dV = g->tensor(kDV, bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk), false);
  Desc scale = g->scalar(kScale), neg_inf = g->scalar(kNegInf), one = g->scalar(kOne);
  // softmax_sum = rowsum(dO * O): a real fp32 buffer the caller provides.
  Desc softmax_sum = g->tensor(kSoftmaxSum, f32, rd, rs, false);
  Desc dOO = g->virt(f32, full, {x.Hq * x.T * x.D, x.T * x.D, x.Hq * x.D, 1});
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dO, O, nullptr, dOO);
  Desc rsum = g->virt(f32, rd, rs);
  g->reduce(CUDNN_REDUCE_TENSOR_ADD, dOO, rsum);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, rsum, one, nullptr, softmax_sum);
  // P = exp(scale * Q Kᵀ (causal) - stats)
  Desc S = g->virt(f32, sd, ss);
  g->matmul(Q, Kt, S);
  Desc S2 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, S, scale, nullptr, S2);
  Desc S3 = g->causal(S2, neg_inf, sd, ss);
  Desc S4 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_SUB, f32, S3, stats, nullptr, S4);
  Desc P = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_EXP, f32, S4, nullptr, nullptr, P);
  // dV = Pᵀ dO (summed over each kv head's query heads)
  Desc Pt = g->virt(bf, sd, ts);
  g->reshape(P, Pt);
  if (!gqa) {
    g->matmul(Pt, dO, dV);
  } else {
    Desc dVf = g->virt(bf, full, full_s);
    g->matmul(Pt, dO, dVf);
    g->reduce(CUDNN_REDUCE_TENSOR_ADD, dVf, dV);
  }
  // dS = P * (dO Vᵀ - softmax_sum) * scale
  Desc dP = g->virt(f32, sd, ss);
  g->matmul(dO, Vt, dP);
  Desc dP2 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_SUB, f32, dP, softmax_sum, nullptr, dP2);
  Desc dP3 = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dP2, P, nullptr, dP3);
  Desc dS = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_MUL, f32, dP3, scale, nullptr, dS);
  // dK = dSᵀ Q
  Desc dSt = g->virt(bf, sd, ts);
  g->reshape(dS, dSt);
  if (!gqa) {
    g->matmul(dSt, Q, dK);
  } else {
    Desc dKf = g->virt(bf, full, full_s);
    g->matmul(dSt, Q, dKf);
    g->reduce(CUDNN_REDUCE_TENSOR_ADD, dKf, dK);
  }
  // dQ = dS K. Written directly, cuDNN picks its deterministic algorithm (an s×s workspace);
  // through an fp32 accumulator it picks the faster one whose summation order varies.
  Desc K = g->virt(bf, bhtd(x, x.Hk), bhtd_strides(x, x.Hk));
  g->reshape(Kt, K);
  if (deterministic) {
    g->matmul(dS, K, dQ);
  } else {
    Desc acc = g->tensor(kDQAccum, f32, full, full_s, false);
    g->matmul(dS, K, acc);
    g->pointwise(CUDNN_POINTWISE_IDENTITY, f32, acc, nullptr, nullptr, dQ);
  }
  g->plan(h);
  return g;
}

Shape shape_of(const Tensor& q, const Tensor& k) {
  return Shape{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)};
}

// What forward (variant 0) and backward (1) share: the checks, then the plan for the call's
// shape. Null with *why when cuDNN cannot take the call.
Graph* prepare(const Tensor& q, const Tensor& k, std::initializer_list<const Tensor*> io,
               int variant, bool deterministic, std::string* why) {
  const int dev = q.device().index;
  const Shape x = shape_of(q, k);
  if (!bf16_aligned(q, io, why) || !supported(x.D, x.T, dev, variant == 1, why)) return nullptr;
  return cached_plan({dev, variant, deterministic, x.B, x.T, x.Hq, x.Hk, x.D}, dev,
                     [&](cudnnHandle_t h) {
                       return variant == 0 ? forward_graph(h, x)
                                           : backward_graph(h, x, deterministic);
                     },
                     why);
}

}  // namespace

// ---- shared with the packed-segment graphs ---------------------------------------------------

namespace detail {
namespace {
// One handle and one plan cache per (thread, device): plans are not shared across threads.
struct Cache {
  struct Entry {
    std::unique_ptr<Graph> graph;  // null: declined, with the reason
    std::string why;
  };
  std::map<int, cudnnHandle_t> handles;
  std::map<std::vector<int64_t>, Entry> plans;
};
Cache& cache() {
  // Handles are never destroyed: a thread_local destructor may run after the CUDA context is gone.
  static thread_local auto* c = new Cache();
  return *c;
}
}  // namespace

cudnnHandle_t handle_for(int dev) {
  auto& h = cache().handles[dev];
  if (!h) {
    const cudnnStatus_t s = cudnnCreate(&h);
    if (s != CUDNN_STATUS_SUCCESS) {
      h = nullptr;
      throw Declined{fmt::format("cudnnCreate: {}", last_error(s))};
    }
  }
  return h;
}

cudnnHandle_t bound_handle(int dev) {
  cudnnHandle_t h = handle_for(dev);
  cudaStream_t s = stream_for(dev);
  if (cudnnSetStream(h, s == cudaStreamLegacy ? nullptr : s) != CUDNN_STATUS_SUCCESS)
    fail("cuDNN attention: cudnnSetStream failed");
  return h;
}

Graph* cached_plan(const std::vector<int64_t>& key, int dev,
                   const std::function<std::unique_ptr<Graph>(cudnnHandle_t)>& build,
                   std::string* why) {
  auto& plans = cache().plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    Cache::Entry e;
    try {
      e.graph = build(handle_for(dev));
    } catch (const Declined& d) {
      e.why = d.why;
    }
    it = plans.emplace(key, std::move(e)).first;
  }
  if (!it->second.graph) *why = it->second.why;
  return it->second.graph.get();
}

bool supported(int64_t D, int64_t T, int dev, bool backward, std::string* why) {
  const int ver = runtime_version();
  if (ver < 90000) {
    *why = fmt::format("cuDNN runtime {} is older than 9.0", ver);
    return false;
  }
  int major = 0;
  RIG_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
  if (major < 8) {
    *why = "cuDNN's fused attention needs compute capability 8.0 or newer";
    return false;
  }
  const int64_t dmax = (major == 8 && backward) ? 128 : 256;
  if (D % 8 != 0 || D > dmax) {
    *why = fmt::format("head_dim {} (cuDNN needs a multiple of 8 up to {} here)", D, dmax);
    return false;
  }
  if (backward && T == 1) {
    *why = "cuDNN's backward does not support sequence length 1";
    return false;
  }
  return true;
}

bool bf16_aligned(const Tensor& q, std::initializer_list<const Tensor*> io, std::string* why) {
  if (q.dtype() != DType::BF16) {
    *why = "cuDNN's fused attention runs bf16 only";
    return false;
  }
  for (const Tensor* t : io)
    if (reinterpret_cast<uintptr_t>(t->raw()) % 16 != 0) {
      *why = "a tensor is not 16-byte aligned";
      return false;
    }
  return true;
}

Tensor workspace(int64_t bytes, int dev) {
  return Tensor::empty({std::max<int64_t>(bytes, 1)}, DType::U8, Device::cuda(dev),
                       "cuDNN attention workspace");
}

}  // namespace detail

int runtime_version() {
  return int(cudnnGetVersion());
}

bool forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor& lse,
             std::string* why) {
  const int dev = q.device().index;
  DeviceGuard guard(dev);
  Graph* g = prepare(q, k, {&q, &k, &v, &out}, 0, false, why);
  if (!g) return false;
  const Shape x = shape_of(q, k);
  float scale = 1.0f / std::sqrt(float(x.D)), neg_inf = -std::numeric_limits<float>::infinity();
  Tensor ws = workspace(g->workspace(), dev);
  g->execute(bound_handle(dev), {kQ, kK, kV, kO, kStats, kScale, kNegInf},
             {q.raw(), k.raw(), v.raw(), out.raw(), lse.raw(), &scale, &neg_inf}, ws.raw());
  return true;
}

bool backward(const Tensor& dout, const Tensor& q, const Tensor& k, const Tensor& v,
              const Tensor& out, const Tensor& lse, Tensor& dq, Tensor& dk, Tensor& dv,
              bool deterministic, std::string* why) {
  const int dev = q.device().index;
  DeviceGuard guard(dev);
  Graph* g = prepare(q, k, {&dout, &q, &k, &v, &out, &dq, &dk, &dv}, 1, deterministic, why);
  if (!g) return false;
  const Shape x = shape_of(q, k);
  float scale = 1.0f / std::sqrt(float(x.D)), neg_inf = -std::numeric_limits<float>::infinity(),
        one = 1.0f;
  Tensor softmax_sum =
      Tensor::empty(lse.shape(), DType::F32, Device::cuda(dev), "cuDNN attention softmax sum");
  std::vector<int64_t> uids{kQ,  kK,  kV,     kO,      kDO,  kStats,     kDQ,
                            kDK, kDV, kScale, kNegInf, kOne, kSoftmaxSum};
  std::vector<void*> ptrs{q.raw(),   k.raw(),  v.raw(),          out.raw(), dout.raw(),
                          lse.raw(), dq.raw(), dk.raw(),         dv.raw(),  &scale,
                          &neg_inf,  &one,     softmax_sum.raw()};
  Tensor acc;
  if (!deterministic) {
    acc = Tensor::empty({x.B, x.Hq, x.T, x.D}, DType::F32, Device::cuda(dev),
                        "cuDNN attention dq accumulator");
    uids.push_back(kDQAccum);
    ptrs.push_back(acc.raw());
    // Runtimes before 9.6 accumulate into it without clearing it first.
    if (runtime_version() < 90600)
      RIG_CUDA_CHECK(cudaMemsetAsync(acc.raw(), 0, size_t(acc.numel()) * 4, stream_for(dev)));
  }
  Tensor ws = workspace(g->workspace(), dev);
  g->execute(bound_handle(dev), uids, ptrs, ws.raw());
  return true;
}

#endif  // RIG_WITH_CUDNN

}  // namespace rig::ops::cuda::sdpa_cudnn
