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
#include <cudnn.h>

#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <tuple>
#include <vector>

#include "rig/core/cuda_check.h"
#include "rig/ops/cuda/context.h"
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

namespace {

using Desc = cudnnBackendDescriptor_t;
using Dims = std::vector<int64_t>;

// A cuDNN failure while describing or planning a graph: the shape is not supported.
struct Declined {
  std::string why;
};

std::string last_error(cudnnStatus_t s) {
  char msg[1024] = {0};
  cudnnGetLastErrorString(msg, sizeof msg);
  return fmt::format("{}{}{}", cudnnGetErrorString(s), msg[0] ? ": " : "", msg);
}

void ok(cudnnStatus_t s, const char* what) {
  if (s != CUDNN_STATUS_SUCCESS) throw Declined{fmt::format("{}: {}", what, last_error(s))};
}

enum Uid : int64_t {
  kQ = 1,
  kK,
  kV,
  kO,
  kStats,
  kScale,
  kNegInf,
  kDO,
  kDQ,
  kDK,
  kDV,
  kOne,
  kSoftmaxSum,
  kDQAccum,
};

// Owns every descriptor of one graph; the plan references them, so they live as long as it.
class Graph {
 public:
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() {
    for (auto it = owned_.rbegin(); it != owned_.rend(); ++it) cudnnBackendDestroyDescriptor(*it);
  }

  Desc make(cudnnBackendDescriptorType_t t) {
    Desc d = nullptr;
    ok(cudnnBackendCreateDescriptor(t, &d), "create descriptor");
    owned_.push_back(d);
    return d;
  }
  static void set(Desc d, cudnnBackendAttributeName_t n, cudnnBackendAttributeType_t t, int64_t c,
                  const void* v) {
    ok(cudnnBackendSetAttribute(d, n, t, c, v), "set attribute");
  }
  static void set(Desc d, cudnnBackendAttributeName_t n, Desc v) {
    set(d, n, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v);
  }

  Desc tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, const Dims& strides, bool virt,
              bool by_value = false) {
    Desc t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, int64_t(dims.size()), dims.data());
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, int64_t(strides.size()), strides.data());
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    ok(cudnnBackendFinalize(t), "tensor");
    return t;
  }
  Desc virt(cudnnDataType_t dt, const Dims& dims, const Dims& strides) {
    return tensor(next_virtual_++, dt, dims, strides, true);
  }
  // A float scalar passed by value from the host at execution.
  Desc scalar(int64_t uid) {
    const Dims one{1, 1, 1, 1};
    return tensor(uid, CUDNN_DATA_FLOAT, one, one, false, true);
  }

  // y = mode(x[, b][, t]); GEN_INDEX takes an axis.
  void pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, Desc x, Desc b, Desc t, Desc y,
                 int64_t axis = -1) {
    Desc p = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    set(p, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    set(p, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (mode == CUDNN_POINTWISE_GEN_INDEX)
      set(p, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    ok(cudnnBackendFinalize(p), "pointwise");
    Desc op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, p);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    const float one = 1.0f;
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA1, CUDNN_TYPE_FLOAT, 1, &one);
    set(op, CUDNN_ATTR_OPERATION_POINTWISE_ALPHA2, CUDNN_TYPE_FLOAT, 1, &one);
    ok(cudnnBackendFinalize(op), "pointwise op");
    ops_.push_back(op);
  }
  // c = a @ b over the last two dims; leading dims broadcast (grouped-query heads).
  void matmul(Desc a, Desc b, Desc c) {
    Desc m = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    ok(cudnnBackendFinalize(m), "matmul");
    Desc op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, m);
    ok(cudnnBackendFinalize(op), "matmul op");
    ops_.push_back(op);
  }
  // Reduces x over every dim where y has extent 1 (or a divisor of x's: query heads -> kv heads).
  void reduce(cudnnReduceTensorOp_t r, Desc x, Desc y) {
    Desc m = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(m, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &r);
    set(m, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    ok(cudnnBackendFinalize(m), "reduction");
    Desc op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, m);
    ok(cudnnBackendFinalize(op), "reduction op");
    ops_.push_back(op);
  }
  // A relabelling of the same elements (used as a transpose: dims and strides swapped).
  void reshape(Desc x, Desc y) {
    Desc op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    ok(cudnnBackendFinalize(op), "reshape op");
    ops_.push_back(op);
  }

  // score where row >= col, else -inf (top-left causal diagonal).
  Desc causal(Desc score, Desc neg_inf, const Dims& sd, const Dims& ss) {
    Desc row = virt(CUDNN_DATA_INT32, sd, ss), col = virt(CUDNN_DATA_INT32, sd, ss);
    Desc keep = virt(CUDNN_DATA_BOOLEAN, sd, ss), out = virt(CUDNN_DATA_FLOAT, sd, ss);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, score, nullptr, nullptr, row, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_FLOAT, score, nullptr, nullptr, col, 3);
    pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, neg_inf, keep, out);
    return out;
  }

  // Operation graph -> heuristics (mode A, then the fallback list) -> the first config whose
  // plan finalizes. Throws Declined when none does.
  void plan(cudnnHandle_t h) {
    Desc og = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    set(og, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, int64_t(ops_.size()),
        ops_.data());
    set(og, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
    ok(cudnnBackendFinalize(og), "operation graph");
    std::string tried;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      Desc heur = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, og);
      set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      ok(cudnnBackendFinalize(heur), "engine heuristics");
      int64_t n = 0;
      ok(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                  CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &n, nullptr),
         "heuristics results");
      std::vector<Desc> cfgs;
      for (int64_t i = 0; i < n; ++i) cfgs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
      int64_t got = 0;
      if (n > 0)
        ok(cudnnBackendGetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                    CUDNN_TYPE_BACKEND_DESCRIPTOR, n, &got, cfgs.data()),
           "heuristics results");
      for (int64_t i = 0; i < got; ++i) {
        Desc p = nullptr;
        ok(cudnnBackendCreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &p), "plan");
        set(p, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &h);
        set(p, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, cfgs[size_t(i)]);
        const cudnnStatus_t s = cudnnBackendFinalize(p);
        if (s == CUDNN_STATUS_SUCCESS) {
          owned_.push_back(p);
          plan_ = p;
          int64_t c = 0;
          ok(cudnnBackendGetAttribute(p, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64,
                                      1, &c, &workspace_),
             "workspace size");
          return;
        }
        tried += fmt::format("; config {}: {}", i, last_error(s));
        cudnnBackendDestroyDescriptor(p);
      }
    }
    throw Declined{"no cuDNN engine supports this attention graph" + tried};
  }

  // Runs the plan; uids and pointers pair up (host pointers for by-value scalars).
  void execute(cudnnHandle_t h, const std::vector<int64_t>& uids, const std::vector<void*>& ptrs,
               void* workspace) const {
    Desc vp = nullptr;
    RIG_CHECK(cudnnBackendCreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp) ==
                  CUDNN_STATUS_SUCCESS,
              "cuDNN attention: cannot create a variant pack");
    std::unique_ptr<void, void (*)(void*)> guard(
        vp, [](void* d) { cudnnBackendDestroyDescriptor(static_cast<Desc>(d)); });
    auto must = [](cudnnStatus_t s, const char* what) {
      if (s != CUDNN_STATUS_SUCCESS) fail("cuDNN attention {}: {}", what, last_error(s));
    };
    must(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64,
                                  int64_t(uids.size()), uids.data()),
         "variant pack");
    must(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR,
                                  int64_t(ptrs.size()), ptrs.data()),
         "variant pack");
    must(cudnnBackendSetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1,
                                  &workspace),
         "variant pack");
    must(cudnnBackendFinalize(vp), "variant pack");
    must(cudnnBackendExecute(h, plan_, vp), "execute");
  }

  int64_t workspace() const { return workspace_; }

 private:
  std::vector<Desc> owned_, ops_;
  Desc plan_ = nullptr;
  int64_t workspace_ = 0;
  int64_t next_virtual_ = 1000;
};

struct Shape {
  int64_t B, T, Hq, Hk, D;
  auto tie() const { return std::tie(B, T, Hq, Hk, D); }
};

// cuDNN's {B,H,T,D} view of a contiguous [B,T,H,D] tensor, and its Kᵀ-style transpose.
Dims bhtd(const Shape& s, int64_t H) {
  return {s.B, H, s.T, s.D};
}
Dims bhtd_strides(const Shape& s, int64_t H) {
  return {s.T * H * s.D, s.D, H * s.D, 1};
}
Dims bhdt(const Shape& s, int64_t H) {
  return {s.B, H, s.D, s.T};
}
Dims bhdt_strides(const Shape& s, int64_t H) {
  return {s.T * H * s.D, s.D, 1, H * s.D};
}

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
  Desc M = g->virt(f32, rd, rs);
  g->reduce(CUDNN_REDUCE_TENSOR_MAX, S3, M);
  Desc Z = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_SUB, f32, S3, M, nullptr, Z);
  Desc E = g->virt(f32, sd, ss);
  g->pointwise(CUDNN_POINTWISE_EXP, f32, Z, nullptr, nullptr, E);
  Desc L = g->virt(f32, rd, rs);
  g->reduce(CUDNN_REDUCE_TENSOR_ADD, E, L);
  Desc logL = g->virt(f32, rd, rs);
  g->pointwise(CUDNN_POINTWISE_LOG, f32, L, nullptr, nullptr, logL);
  g->pointwise(CUDNN_POINTWISE_ADD, f32, M, logL, nullptr, stats);  // natural-log LSE
  Desc P = g->virt(bf, sd, ss);  // the P·V product takes P in the I/O type
  g->pointwise(CUDNN_POINTWISE_DIV, f32, E, L, nullptr, P);
  g->matmul(P, V, O);
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

// One handle and one plan cache per (thread, device): plans are not shared across threads.
struct Cache {
  struct Entry {
    std::unique_ptr<Graph> graph;  // null: declined, with the reason
    std::string why;
  };
  std::map<int, cudnnHandle_t> handles;
  std::map<std::tuple<int, int, bool, int64_t, int64_t, int64_t, int64_t, int64_t>, Entry> plans;
};
Cache& cache() {
  // Handles are never destroyed: a thread_local destructor may run after the CUDA context is gone.
  static thread_local auto* c = new Cache();
  return *c;
}

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

// Version, GPU and shape limits known before any graph is built (cuDNN's support matrix).
bool supported(const Shape& x, int dev, bool backward, std::string* why) {
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
  if (x.D % 8 != 0 || x.D > dmax) {
    *why = fmt::format("head_dim {} (cuDNN needs a multiple of 8 up to {} here)", x.D, dmax);
    return false;
  }
  if (backward && x.T == 1) {
    *why = "cuDNN's backward does not support sequence length 1";
    return false;
  }
  return true;
}

bool aligned(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.raw()) % 16 == 0;
}

// The plan for (shape, variant), built on first use; null with *why when cuDNN declines.
Graph* plan_for(const Shape& x, int dev, int variant, bool deterministic, std::string* why) {
  auto key = std::tuple{dev, variant, deterministic, x.B, x.T, x.Hq, x.Hk, x.D};
  auto& plans = cache().plans;
  auto it = plans.find(key);
  if (it == plans.end()) {
    Cache::Entry e;
    try {
      cudnnHandle_t h = handle_for(dev);
      e.graph = variant == 0 ? forward_graph(h, x) : backward_graph(h, x, deterministic);
    } catch (const Declined& d) {
      e.why = d.why;
    }
    it = plans.emplace(key, std::move(e)).first;
  }
  if (!it->second.graph) *why = it->second.why;
  return it->second.graph.get();
}

Tensor workspace(int64_t bytes, int dev) {
  return Tensor::empty({std::max<int64_t>(bytes, 1)}, DType::U8, Device::cuda(dev),
                       "cuDNN attention workspace");
}

Shape shape_of(const Tensor& q, const Tensor& k) {
  return Shape{q.dim(0), q.dim(1), q.dim(2), k.dim(2), q.dim(3)};
}

// What forward (variant 0) and backward (1) share: the checks, the plan for the call's shape and
// the handle bound to rig's stream. Null with *why when cuDNN cannot take the call.
Graph* prepare(const Tensor& q, const Tensor& k, std::initializer_list<const Tensor*> io,
               int variant, bool deterministic, std::string* why) {
  const int dev = q.device().index;
  const Shape x = shape_of(q, k);
  if (q.dtype() != DType::BF16) {
    *why = "cuDNN's fused attention runs bf16 only";
    return nullptr;
  }
  if (!supported(x, dev, variant == 1, why)) return nullptr;
  for (const Tensor* t : io)
    if (!aligned(*t)) {
      *why = "a tensor is not 16-byte aligned";
      return nullptr;
    }
  Graph* g = plan_for(x, dev, variant, deterministic, why);
  if (!g) return nullptr;
  cudaStream_t s = stream_for(dev);
  if (cudnnSetStream(cache().handles[dev], s == cudaStreamLegacy ? nullptr : s) !=
      CUDNN_STATUS_SUCCESS)
    fail("cuDNN attention: cudnnSetStream failed");
  return g;
}

}  // namespace

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
  g->execute(cache().handles[dev], {kQ, kK, kV, kO, kStats, kScale, kNegInf},
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
  g->execute(cache().handles[dev], uids, ptrs, ws.raw());
  return true;
}

#endif  // RIG_WITH_CUDNN

}  // namespace rig::ops::cuda::sdpa_cudnn
