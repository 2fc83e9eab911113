// The backend-descriptor graph builder behind cuDNN's fused attention, shared by the dense
// (sdpa_cudnn_cuda.cpp) and packed-segment (sdpa_cudnn_packed_cuda.cpp) graphs, and the per-thread
// handle and plan cache both use. Internal to those two files.
#pragma once
#ifdef RIG_WITH_CUDNN
#include <cudnn.h>

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "rig/core/error.h"
#include "rig/core/tensor.h"

namespace rig::ops::cuda::sdpa_cudnn::detail {

using Desc = cudnnBackendDescriptor_t;
using Dims = std::vector<int64_t>;

// A cuDNN failure while describing or planning a graph: the shape is not supported.
struct Declined {
  std::string why;
};

inline std::string last_error(cudnnStatus_t s) {
  char msg[1024] = {0};
  cudnnGetLastErrorString(msg, sizeof msg);
  return fmt::format("{}{}{}", cudnnGetErrorString(s), msg[0] ? ": " : "", msg);
}

inline void ok(cudnnStatus_t s, const char* what) {
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
  // Packed segments as ragged batches (sdpa_cudnn_packed_cuda.cpp).
  kSeqLen,
  kSeqLenKV,
  kQOffsets,
  kKVOffsets,
  kStatsOffsets,
  kLowest,
  kDKFull,
  kDVFull,
};

// B batch entries of T rows (packed rows: ragged entries of up to T rows); H heads of D.
struct Shape {
  int64_t B, T, Hq, Hk, D;
};

// cuDNN's {B,H,T,D} view of a contiguous [B,T,H,D] tensor, and its Kᵀ-style transpose.
inline Dims bhtd(const Shape& s, int64_t H) {
  return {s.B, H, s.T, s.D};
}
inline Dims bhtd_strides(const Shape& s, int64_t H) {
  return {s.T * H * s.D, s.D, H * s.D, 1};
}
inline Dims bhdt(const Shape& s, int64_t H) {
  return {s.B, H, s.D, s.T};
}
inline Dims bhdt_strides(const Shape& s, int64_t H) {
  return {s.T * H * s.D, s.D, 1, H * s.D};
}

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

  // ragged: an INT32 {b+1,1,1,1} tensor of element offsets, one per batch entry (packed rows).
  Desc tensor(int64_t uid, cudnnDataType_t dt, const Dims& dims, const Dims& strides, bool virt,
              bool by_value = false, Desc ragged = nullptr) {
    Desc t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t align = 16;
    set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &dt);
    set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, int64_t(dims.size()), dims.data());
    set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, int64_t(strides.size()), strides.data());
    set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &align);
    set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &virt);
    if (by_value) set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    if (ragged) set(t, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, ragged);
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
  // c = a @ b over the last two dims; leading dims broadcast (grouped-query heads). m/n/k: per-batch
  // lengths (INT32 {b,1,1,1}) that override the padded extents of packed rows.
  void matmul(Desc a, Desc b, Desc c, Desc m_len = nullptr, Desc n_len = nullptr,
              Desc k_len = nullptr) {
    Desc m = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t f32 = CUDNN_DATA_FLOAT;
    set(m, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &f32);
    ok(cudnnBackendFinalize(m), "matmul");
    Desc op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, m);
    if (m_len) set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, m_len);
    if (n_len) set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, n_len);
    if (k_len) set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, k_len);
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

  // score where row < len_q and col < len_kv, else lowest (the padded tail of a packed row's batch
  // entry; lowest, not -inf, so that a row with no valid key stays finite).
  Desc padding(Desc score, Desc len_q, Desc len_kv, Desc lowest, const Dims& sd, const Dims& ss) {
    Desc row = virt(CUDNN_DATA_INT32, sd, ss), col = virt(CUDNN_DATA_INT32, sd, ss);
    Desc row_ok = virt(CUDNN_DATA_BOOLEAN, sd, ss), col_ok = virt(CUDNN_DATA_BOOLEAN, sd, ss);
    Desc keep = virt(CUDNN_DATA_BOOLEAN, sd, ss), out = virt(CUDNN_DATA_FLOAT, sd, ss);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, row, 2);
    pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, col, 3);
    pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, len_q, nullptr, row_ok);
    pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, len_kv, nullptr, col_ok);
    pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep);
    pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, lowest, keep, out);
    return out;
  }

  // O = softmax(scores)·V, and stats = the rows' natural-log LSE. len_q/len_kv: packed rows'
  // per-entry lengths (the P·V product's M and K).
  void softmax_times_v(Desc scores, Desc V, Desc O, Desc stats, const Shape& x,
                       Desc len_q = nullptr, Desc len_kv = nullptr) {
    const auto f32 = CUDNN_DATA_FLOAT;
    const Dims sd{x.B, x.Hq, x.T, x.T}, ss{x.Hq * x.T * x.T, x.T * x.T, x.T, 1};
    const Dims rd{x.B, x.Hq, x.T, 1}, rs{x.Hq * x.T, x.T, 1, 1};
    Desc M = virt(f32, rd, rs), Z = virt(f32, sd, ss), E = virt(f32, sd, ss);
    reduce(CUDNN_REDUCE_TENSOR_MAX, scores, M);
    pointwise(CUDNN_POINTWISE_SUB, f32, scores, M, nullptr, Z);
    pointwise(CUDNN_POINTWISE_EXP, f32, Z, nullptr, nullptr, E);
    Desc L = virt(f32, rd, rs), logL = virt(f32, rd, rs);
    reduce(CUDNN_REDUCE_TENSOR_ADD, E, L);
    pointwise(CUDNN_POINTWISE_LOG, f32, L, nullptr, nullptr, logL);
    pointwise(CUDNN_POINTWISE_ADD, f32, M, logL, nullptr, stats);
    Desc P = virt(CUDNN_DATA_BFLOAT16, sd, ss);  // the P·V product takes P in the I/O type
    pointwise(CUDNN_POINTWISE_DIV, f32, E, L, nullptr, P);
    matmul(P, V, O, len_q, nullptr, len_kv);
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

// The handle for (this thread, dev), created on first use.
cudnnHandle_t handle_for(int dev);
// The handle for dev, bound to rig's stream for dev.
cudnnHandle_t bound_handle(int dev);
// The plan under key, built by build(handle) on first use and kept for the thread's life; a
// declined build is kept too. Null with *why when cuDNN declined it.
Graph* cached_plan(const std::vector<int64_t>& key, int dev,
                   const std::function<std::unique_ptr<Graph>(cudnnHandle_t)>& build,
                   std::string* why);
// The runtime/GPU/head-dim limits both graphs share (cuDNN's support matrix).
bool supported(int64_t D, int64_t T, int dev, bool backward, std::string* why);
// q is bf16 and every tensor of io starts on 16 bytes (else *why).
bool bf16_aligned(const Tensor& q, std::initializer_list<const Tensor*> io, std::string* why);
Tensor workspace(int64_t bytes, int dev);

}  // namespace rig::ops::cuda::sdpa_cudnn::detail
#endif  // RIG_WITH_CUDNN
