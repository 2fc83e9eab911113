// Host wrappers of generation's kernels (attention_decode.cu: the key/value-cache attention and
// the greedy argmax): shape, device and dtype checks that name the argument, then one launch on
// the device's stream.
#include <utility>

#include "rig/ops/cuda/attention_decode.h"
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"

namespace rig::ops::cuda {

void attention_decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, int64_t past,
                      Tensor& out) {
  const char* op = "attention_decode";
  const int dev = q.device().index;
  for (auto [t, n] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}})
    check_on(*t, dev, op, n);
  RIG_CHECK(q.ndim() == 3 && k_cache.ndim() == 3 && out.shape() == q.shape() &&
                v_cache.shape() == k_cache.shape(),
            "{}: q {}, out {}, caches {} and {}: expected q/out [n,Hq,D], caches [max_len,Hk,D]",
            op, shape_str(q.shape()), shape_str(out.shape()), shape_str(k_cache.shape()),
            shape_str(v_cache.shape()));
  const int64_t n = q.dim(0), Hq = q.dim(1), D = q.dim(2), Hk = k_cache.dim(1);
  RIG_CHECK(k_cache.dim(2) == D && Hk > 0 && Hq % Hk == 0,
            "{}: q {} does not fit caches {} (same head dim, kv heads dividing query heads)", op,
            shape_str(q.shape()), shape_str(k_cache.shape()));
  RIG_CHECK(D <= k::attention_decode_max_head_dim(), "{}: head dim {} above the kernel's {}", op, D,
            k::attention_decode_max_head_dim());
  RIG_CHECK(past >= 0 && past + n <= k_cache.dim(0), "{}: rows [{}, {}) past the cache's {} rows",
            op, past, past + n, k_cache.dim(0));
  const k::T t = ktype(q, op, "q");
  for (auto [x, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}, {&out, "out"}})
    RIG_CHECK(x->dtype() == q.dtype(), "{}: {} is {} but q is {}", op, name, dtype_name(x->dtype()),
              dtype_name(q.dtype()));
  DeviceGuard g(dev);
  const k::DecodeDims d{n, past, int(Hq), int(Hk), int(D)};
  check_status(k::attention_decode_fwd(t, q.raw(), k_cache.raw(), v_cache.raw(), out.raw(), d,
                                       stream_for(dev)),
               op);
}

void argmax(const Tensor& x, int64_t limit, Tensor& out) {
  const char* op = "argmax";
  const int dev = x.device().index;
  check_on(out, dev, op, "out");
  RIG_CHECK(x.ndim() == 2, "{}: x {} is not [rows, V]", op, shape_str(x.shape()));
  const int64_t rows = x.dim(0), V = x.dim(1);
  RIG_CHECK(limit >= 1 && limit <= V, "{}: limit {} outside [1, {}]", op, limit, V);
  RIG_CHECK(out.dtype() == DType::I64 && out.numel() == rows,
            "{}: out must be int64 with {} elements, got {} {}", op, rows, dtype_name(out.dtype()),
            shape_str(out.shape()));
  const k::T t = ktype(x, op, "x");
  DeviceGuard g(dev);
  check_status(k::argmax_rows(t, x.raw(), rows, V, limit, out.data<int64_t>(), stream_for(dev)),
               op);
}

}  // namespace rig::ops::cuda
