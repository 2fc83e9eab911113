// Host wrapper of the 4-bit dequantization kernel (nf4.cu): checks where each tensor of the
// quantized weight lives and what it holds, then one launch.
#include "rig/ops/cuda/context.h"
#include "rig/ops/cuda/cuda_ops.h"
#include "rig/quant/nf4.h"

namespace rig::ops::cuda {

void dequantize_4bit(const quant::QuantizedWeight& q, Tensor& out) {
  const char* op = "dequantize_4bit";
  const int dev = out.device().index;
  check_on(out, dev, op, "out");
  check_on(q.packed, dev, op, "the packed weight");
  check_on(q.absmax, dev, op, "absmax");
  check_on(q.quant_map, dev, op, "quant_map");
  check_dtype(q.packed, DType::U8, op, "the packed weight");
  check_dtype(q.quant_map, DType::F32, op, "quant_map");
  RIG_CHECK(q.quant_map.numel() == 16, "{}: quant_map has {} values", op, q.quant_map.numel());
  RIG_CHECK(out.numel() == q.numel(), "{}: out {} for a weight {}", op, shape_str(out.shape()),
            shape_str(q.shape));
  RIG_CHECK(q.packed.numel() == (q.numel() + 1) / 2, "{}: {} packed bytes for {} weights", op,
            q.packed.numel(), q.numel());
  RIG_CHECK(q.absmax.numel() == q.n_blocks(), "{}: {} scales for {} blocks", op, q.absmax.numel(),
            q.n_blocks());
  k::Nf4Args a{};
  a.packed = q.packed.data<uint8_t>();
  a.absmax = q.absmax.raw();
  a.code = q.quant_map.f32();
  a.n = q.numel();
  a.blocksize = q.blocksize;
  a.nested = q.nested ? 1 : 0;
  a.round_to = q.dtype == DType::BF16 ? 1 : q.dtype == DType::F16 ? 2 : 0;
  if (q.nested) {
    check_dtype(q.absmax, DType::U8, op, "absmax (double-quantized)");
    check_on(q.nested_absmax, dev, op, "nested_absmax");
    check_on(q.nested_quant_map, dev, op, "nested_quant_map");
    check_dtype(q.nested_absmax, DType::F32, op, "nested_absmax");
    check_dtype(q.nested_quant_map, DType::F32, op, "nested_quant_map");
    RIG_CHECK(q.nested_quant_map.numel() == 256, "{}: nested_quant_map has {} values", op,
              q.nested_quant_map.numel());
    RIG_CHECK(
        q.nested_absmax.numel() == (q.n_blocks() + q.nested_blocksize - 1) / q.nested_blocksize,
        "{}: {} nested scales for {} blocks", op, q.nested_absmax.numel(), q.n_blocks());
    a.nested_absmax = q.nested_absmax.f32();
    a.nested_map = q.nested_quant_map.f32();
    a.offset = q.nested_offset;
    a.nested_blocksize = q.nested_blocksize;
  } else {
    check_dtype(q.absmax, DType::F32, op, "absmax");
    a.nested_blocksize = 1;
  }
  DeviceGuard g(dev);
  const cudaError_t e = k::dequantize_4bit(a, ktype(out, op, "out"), out.raw(), stream_for(dev));
  if (e != cudaSuccess) fail("{}: CUDA kernel launch failed: {}", op, cudaGetErrorString(e));
}

}  // namespace rig::ops::cuda
