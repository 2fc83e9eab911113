#include "rig/quant/nf4.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include "rig/quant/nf4_impl.h"

#ifdef RIG_WITH_CUDA
#include "rig/ops/cuda/cuda_ops.h"
#endif

// Every float operation here must round on its own as torch's do: a fused multiply-add of
// `nested_map[q] * nested_absmax + offset` would differ from bitsandbytes in the last bit.
// CMakeLists.txt compiles this file with -ffp-contract=off; the one intended FMA is explicit.
// (nf4_io.cpp reads and writes the weights as bitsandbytes and transformers store them.)

namespace rig::quant {

namespace {

// bitsandbytes functional.get_4bit_type("nf4"): the values hard-coded there.
constexpr std::array<float, 16> kNF4 = {-1.0f,
                                        -0.6961928009986877f,
                                        -0.5250730514526367f,
                                        -0.39491748809814453f,
                                        -0.28444138169288635f,
                                        -0.18477343022823334f,
                                        -0.09105003625154495f,
                                        0.0f,
                                        0.07958029955625534f,
                                        0.16093020141124725f,
                                        0.24611230194568634f,
                                        0.33791524171829224f,
                                        0.44070982933044434f,
                                        0.5626170039176941f,
                                        0.7229568362236023f,
                                        1.0f};

// get_4bit_type("fp4"): [0, 0.0625, 8, 12, 4, 6, 2, 3, -0, -0.0625, -8, -12, -4, -6, -2, -3] / 12
// in float32; the "-0" is a Python int, so index 8 is +0.0.
std::array<float, 16> make_fp4() {
  const float raw[16] = {0, 0.0625f, 8, 12, 4, 6, 2, 3, 0, -0.0625f, -8, -12, -4, -6, -2, -3};
  std::array<float, 16> t{};
  for (int i = 0; i < 16; ++i) t[size_t(i)] = raw[i] / 12.0f;
  return t;
}

// Positions of the code values in ascending order (stable: FP4's two zeros keep index 0 first,
// so an exact zero quantizes to nibble 0 as bitsandbytes' quantizer emits).
std::array<int, 16> sort_order(const std::array<float, 16>& code) {
  std::array<int, 16> o{};
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(),
                   [&](int a, int b) { return code[size_t(a)] < code[size_t(b)]; });
  return o;
}

int ceil_log2(int64_t x) {
  if (x <= 2) return 1;
  int b = 0;
  uint64_t v = uint64_t(x) - 1;
  while (v) {
    ++b;
    v >>= 1;
  }
  return b;
}

template <int L>
using Lanes = std::array<float, L>;

template <int L>
inline void lanes_add(Lanes<L>& a, const Lanes<L>& b) {
  for (int i = 0; i < L; ++i) a[size_t(i)] += b[size_t(i)];
}

// aten/src/ATen/native/cpu/SumKernel.cpp multi_row_sum<acc, nrows = 4>: `size` rows of four
// elements, summed in a 4-level cascade of 16-row steps.
template <int L, class Load>
std::array<Lanes<L>, 4> multi_row_sum(const Load& load, int64_t size) {
  constexpr int kLevels = 4;
  const int64_t level_power = std::max<int64_t>(4, ceil_log2(size) / kLevels);
  const int64_t level_step = int64_t(1) << level_power;
  const int64_t level_mask = level_step - 1;
  Lanes<L> acc[kLevels][4] = {};
  int64_t i = 0;
  for (; i + level_step <= size;) {
    for (int64_t j = 0; j < level_step; ++j, ++i)
      for (int k = 0; k < 4; ++k) lanes_add<L>(acc[0][k], load(i * 4 + k));
    for (int j = 1; j < kLevels; ++j) {
      for (int k = 0; k < 4; ++k) {
        lanes_add<L>(acc[j][k], acc[j - 1][k]);
        acc[j - 1][k] = Lanes<L>{};
      }
      if ((i & (level_mask << (j * level_power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int k = 0; k < 4; ++k) lanes_add<L>(acc[0][k], load(i * 4 + k));
  for (int j = 1; j < kLevels; ++j)
    for (int k = 0; k < 4; ++k) lanes_add<L>(acc[0][k], acc[j][k]);
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

// row_sum: four interleaved partial sums, the tail into the first, then folded in order.
template <int L, class Load>
Lanes<L> row_sum(const Load& load, int64_t size) {
  const int64_t size_ilp = size / 4;
  auto p = multi_row_sum<L>(load, size_ilp);
  for (int64_t i = size_ilp * 4; i < size; ++i) lanes_add<L>(p[0], load(i));
  for (int k = 1; k < 4; ++k) lanes_add<L>(p[0], p[size_t(k)]);
  return p[0];
}

template <int W>
float torch_sum(const float* x, int64_t n) {
  if (n < W) {  // scalar_inner_sum
    return row_sum<1>([&](int64_t i) { return Lanes<1>{x[i]}; }, n)[0];
  }
  // vectorized_inner_sum: W-wide vectors, the scalar tail, then the lanes in order.
  const int64_t vec_size = n / W;
  Lanes<W> v = row_sum<W>(
      [&](int64_t i) {
        Lanes<W> l;
        std::memcpy(l.data(), x + i * W, sizeof(float) * W);
        return l;
      },
      vec_size);
  float acc = 0;
  for (int64_t k = vec_size * W; k < n; ++k) acc += x[k];
  for (int k = 0; k < W; ++k) acc += v[size_t(k)];
  return acc;
}

// torch.linspace(0.1, 1, steps) in float32 on the CPU: start + step * i for the first half,
// end - step * (steps - 1 - i) for the rest, each a fused multiply-add as the compiled kernel
// does (checked against bitsandbytes' map: without the fusion 42 of the 256 values differ).
std::vector<float> linspace_01_1(int64_t steps) {
  const float start = 0.1f, end = 1.0f;
  const float step = (end - start) / float(steps - 1);
  const int64_t halfway = steps / 2;
  std::vector<float> v(static_cast<size_t>(steps));
  for (int64_t i = 0; i < steps; ++i)
    v[size_t(i)] = i < halfway ? std::fmaf(step, float(i), start)
                               : std::fmaf(-step, float(steps - i - 1), end);
  return v;
}

Tensor f32_tensor(const float* v, int64_t n, const char* what) {
  Tensor t = Tensor::empty({n}, DType::F32, Device::cpu(), what);
  if (n) std::memcpy(t.raw(), v, size_t(n) * 4);
  return t;
}

}  // namespace

const char* quant_type_name(QuantType t) {
  return t == QuantType::NF4 ? "nf4" : "fp4";
}

bool parse_quant_type(const std::string& s, QuantType* out) {
  if (s == "nf4")
    *out = QuantType::NF4;
  else if (s == "fp4")
    *out = QuantType::FP4;
  else
    return false;
  return true;
}

const std::array<float, 16>& code_table(QuantType t) {
  static const std::array<float, 16> fp4 = make_fp4();
  return t == QuantType::NF4 ? kNF4 : fp4;
}

std::vector<float> create_dynamic_map(bool is_signed) {
  // max_exponent_bits=7, total_bits=8: for i in 0..6, the means of linspace(0.1, 1, k + 1) scaled
  // by 10^(i - 6), with k = 2^i and both signs (signed) or k = 2^(i+1) (unsigned); then 0 and
  // 1.0; sorted.
  std::vector<double> data;
  for (int i = 0; i < 7; ++i) {
    const auto b = linspace_01_1((int64_t(1) << (is_signed ? i : i + 1)) + 1);
    // Python: 10 ** (i - 6) (a float for i < 6, the int 1 at i = 6) times a float32 tensor.
    const float scale = i == 6 ? 1.0f : float(std::pow(10.0, double(i - 6)));
    std::vector<float> means;
    for (size_t k = 0; k + 1 < b.size(); ++k) means.push_back((b[k] + b[k + 1]) / 2.0f);
    for (float m : means) data.push_back(double(scale * m));
    if (is_signed)
      for (float m : means) data.push_back(double(-scale * m));
  }
  data.push_back(0.0);
  data.push_back(1.0);
  while (data.size() < 256) data.push_back(0.0);
  std::sort(data.begin(), data.end());
  return std::vector<float>(data.begin(), data.end());
}

float torch_mean_f32(const float* x, int64_t n, int vector_width) {
  RIG_CHECK(n > 0, "mean of an empty vector");
  float s = 0;
  switch (vector_width) {
    case 8:
      s = torch_sum<8>(x, n);
      break;
    case 16:
      s = torch_sum<16>(x, n);
      break;
    default:
      fail("torch_mean_f32: vector width {} (8 or 16)", vector_width);
  }
  return s / float(n);
}

void quantize_blockwise(const float* x, int64_t n, const float* code, int code_size,
                        int64_t blocksize, uint8_t* q, float* absmax) {
  RIG_CHECK(blocksize > 0 && code_size >= 2, "quantize_blockwise: blocksize {}, code of {}",
            blocksize, code_size);
  std::vector<float> bounds(static_cast<size_t>(code_size - 1));
  for (int i = 0; i + 1 < code_size; ++i) bounds[size_t(i)] = (code[i] + code[i + 1]) / 2.0f;
  const int64_t blocks = (n + blocksize - 1) / blocksize;
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t s = b * blocksize, e = std::min(n, s + blocksize);
    float am = 0;
    for (int64_t i = s; i < e; ++i) am = std::max(am, std::fabs(x[i]));
    const bool full = e - s == blocksize;
    // The scale is clamped to 1e-38 (an all-zero block scales by 1e38); a full block stores its
    // absmax unclamped, the partial last block the clamped value (bitsandbytes' default backend).
    const float amc = std::max(am, 1e-38f);
    absmax[b] = full ? am : amc;
    const float r = 1.0f / amc;
    for (int64_t i = s; i < e; ++i) {
      float v = full ? x[i] * r : x[i] / amc;
      v = std::min(std::max(v, -1.0f), 1.0f);
      q[i] = uint8_t(std::lower_bound(bounds.begin(), bounds.end(), v) - bounds.begin());
    }
  }
}

size_t QuantizedWeight::nbytes() const {
  size_t n = 0;
  for (const Tensor* t : {&packed, &absmax, &quant_map, &nested_absmax, &nested_quant_map})
    if (t->defined()) n += t->nbytes();
  return n;
}

QuantizedWeight QuantizedWeight::to(Device dev) const {
  QuantizedWeight q = *this;
  for (Tensor* t : {&q.packed, &q.absmax, &q.quant_map, &q.nested_absmax, &q.nested_quant_map})
    if (t->defined() && t->device() != dev) *t = t->to(dev, "nf4 weight");
  return q;
}

QuantizedWeight quantize_4bit(const Tensor& w, QuantType type, int64_t blocksize,
                              bool double_quant) {
  RIG_CHECK(w.device().is_cpu(), "quantize_4bit: the weight must be on the CPU");
  RIG_CHECK(w.dtype() == DType::F32 || w.dtype() == DType::BF16 || w.dtype() == DType::F16,
            "quantize_4bit: weight dtype {} (F32, BF16 or F16)", dtype_name(w.dtype()));
  RIG_CHECK(blocksize > 0, "quantize_4bit: blocksize {}", blocksize);
  QuantizedWeight q;
  q.type = type;
  q.blocksize = blocksize;
  q.dtype = w.dtype();
  q.shape = w.shape();
  const int64_t n = w.numel(), nb = q.n_blocks();
  Tensor xf = w.dtype() == DType::F32 ? w : w.to_dtype(DType::F32);

  const auto& code = code_table(type);
  const auto order = sort_order(code);
  float sorted[16];
  for (int i = 0; i < 16; ++i) sorted[i] = code[size_t(order[size_t(i)])];
  std::vector<uint8_t> idx(static_cast<size_t>(n + 1));
  std::vector<float> am(static_cast<size_t>(nb));
  quantize_blockwise(xf.f32(), n, sorted, 16, blocksize, idx.data(), am.data());
  for (int64_t i = 0; i < n; ++i) idx[size_t(i)] = uint8_t(order[idx[size_t(i)]]);
  if (n % 2) {  // the pad nibble: bitsandbytes pads the scaled values with one 0.0
    float zero = 0.0f, dummy;
    uint8_t z;
    quantize_blockwise(&zero, 1, sorted, 16, 1, &z, &dummy);
    idx[size_t(n)] = uint8_t(order[z]);
  }
  q.packed = Tensor::empty({(n + 1) / 2, 1}, DType::U8, Device::cpu(), "nf4 weight");
  uint8_t* p = q.packed.data<uint8_t>();
  for (int64_t i = 0; i < (n + 1) / 2; ++i)
    p[i] = uint8_t(idx[size_t(2 * i)] << 4 | idx[size_t(2 * i + 1)]);
  q.quant_map = f32_tensor(code.data(), 16, "nf4 quant_map");

  if (!double_quant) {
    q.absmax = f32_tensor(am.data(), nb, "nf4 absmax");
    return q;
  }
  q.nested = true;
  q.nested_blocksize = 256;
  q.nested_offset = torch_mean_f32(am.data(), nb);
  std::vector<float> centred(static_cast<size_t>(nb));
  for (int64_t j = 0; j < nb; ++j) centred[size_t(j)] = am[size_t(j)] - q.nested_offset;
  const std::vector<float> dyn = create_dynamic_map();
  const int64_t nn = (nb + 255) / 256;
  q.absmax = Tensor::empty({nb}, DType::U8, Device::cpu(), "nf4 absmax");
  std::vector<float> nabs(static_cast<size_t>(nn));
  quantize_blockwise(centred.data(), nb, dyn.data(), 256, 256, q.absmax.data<uint8_t>(),
                     nabs.data());
  q.nested_absmax = f32_tensor(nabs.data(), nn, "nf4 nested_absmax");
  q.nested_quant_map = f32_tensor(dyn.data(), 256, "nf4 nested_quant_map");
  return q;
}

std::vector<float> effective_absmax(const QuantizedWeight& q) {
  const int64_t nb = q.n_blocks();
  std::vector<float> out(static_cast<size_t>(nb));
  if (!q.nested) {
    Tensor a = on_cpu(q.absmax);
    std::memcpy(out.data(), a.raw(), size_t(nb) * 4);
    return out;
  }
  Tensor codes = on_cpu(q.absmax), nabs = on_cpu(q.nested_absmax),
         nmap = on_cpu(q.nested_quant_map);
  const uint8_t* c = codes.data<uint8_t>();
  const float *na = nabs.f32(), *nm = nmap.f32();
  for (int64_t j = 0; j < nb; ++j) {
    const float scaled = nm[c[j]] * na[j / q.nested_blocksize];
    out[size_t(j)] = scaled + q.nested_offset;  // added after the nested dequantization
  }
  return out;
}

namespace {

float round_as(DType t, float v) {
  if (t == DType::BF16) return bf16_to_f32(f32_to_bf16(v));
  if (t == DType::F16) return f16_to_f32(f32_to_f16(v));
  return v;
}

void dequantize_cpu(const QuantizedWeight& q, Tensor& out, bool round_to_dtype) {
  const int64_t n = q.numel(), bs = q.blocksize, nb = q.n_blocks();
  const std::vector<float> am = effective_absmax(q);
  Tensor packed = on_cpu(q.packed), qmap = on_cpu(q.quant_map);
  const uint8_t* p = packed.data<uint8_t>();
  float code[16];
  std::memcpy(code, qmap.raw(), sizeof(code));
  const DType od = out.dtype();
  RIG_CHECK(od == DType::F32 || od == DType::BF16 || od == DType::F16,
            "dequantize_4bit: output dtype {} (F32, BF16 or F16)", dtype_name(od));
  void* dst = out.raw();
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t b = 0; b < nb; ++b) {
    const float a = am[size_t(b)];
    const int64_t e = std::min(n, (b + 1) * bs);
    for (int64_t i = b * bs; i < e; ++i) {
      const uint8_t byte = p[i >> 1];
      float v = code[(i & 1) ? (byte & 15) : (byte >> 4)] * a;
      if (round_to_dtype) v = round_as(q.dtype, v);
      if (od == DType::F32)
        static_cast<float*>(dst)[i] = v;
      else if (od == DType::BF16)
        static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v);
      else
        static_cast<uint16_t*>(dst)[i] = f32_to_f16(v);
    }
  }
}

void check_out(const QuantizedWeight& q, const Tensor& out) {
  RIG_CHECK(out.defined() && out.numel() == q.numel(), "dequantize_4bit: output {} for a weight {}",
            out.defined() ? shape_str(out.shape()) : "undefined", shape_str(q.shape));
  RIG_CHECK(out.device() == q.device(), "dequantize_4bit: output on {} but the weight is on {}",
            out.device().str(), q.device().str());
}

}  // namespace

void dequantize_4bit(const QuantizedWeight& q, Tensor& out) {
  check_out(q, out);
#ifdef RIG_WITH_CUDA
  if (out.device().is_cuda()) return ops::cuda::dequantize_4bit(q, out);
#endif
  dequantize_cpu(q, out, true);
}

void dequantize_4bit_f32(const QuantizedWeight& q, Tensor& out) {
  check_out(q, out);
  RIG_CHECK(out.device().is_cpu(), "dequantize_4bit_f32 runs on the CPU");
  dequantize_cpu(q, out, false);
}

}  // namespace rig::quant
