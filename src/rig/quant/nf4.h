// bitsandbytes 4-bit blockwise quantization (NF4, and FP4 for reading), with double quantization
// of the block scales, bit for bit as bitsandbytes 0.50 computes and serializes it.
//
// Layout of one quantized weight W [out, in] (what transformers writes for a Linear4bit):
//  - W flattened row-major, cut into blocks of `blocksize` consecutive elements (the last block
//    may be partial; blocks run across row boundaries). absmax[b] = max |x| over block b.
//  - each element becomes the 4-bit index of the code value nearest to x / absmax[b]
//    (midpoint bucketing); two indices a byte, element 2i in the high nibble; an odd element
//    count pads the last low nibble with the code of 0.0. `weight`: U8 [(numel + 1) / 2, 1].
//  - double quantization: offset = mean(absmax) (float32, as torch sums); absmax - offset is
//    quantized blockwise in blocks of 256 with bitsandbytes' signed dynamic 8-bit map:
//    `weight.absmax` U8 codes, `weight.nested_absmax` F32 one per 256 blocks,
//    `weight.nested_quant_map` F32 [256]; the offset lives in the quant-state JSON.
//    Without it `weight.absmax` is F32 [n_blocks].
//  - decode: absmax[b] = f32(f32(nested_map[q[b]] * nested_absmax[b / 256]) + offset), then
//    w = f32(code[nibble] * absmax[block]), rounded once to the output dtype.
//  - `weight.quant_state.bitsandbytes__nf4`: U8 bytes of the JSON `json.dumps` writes, e.g.
//    {"quant_type": "nf4", "blocksize": 64, "dtype": "bfloat16", "shape": [64, 64],
//     "nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": 0.0549...}
#pragma once
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rig/core/tensor.h"

namespace rig {
class WeightFiles;
}

namespace rig::quant {

enum class QuantType : uint8_t { NF4, FP4 };

const char* quant_type_name(QuantType t);  // "nf4", "fp4"
// "nf4" / "fp4"; false for anything else.
bool parse_quant_type(const std::string& s, QuantType* out);

// bitsandbytes' 16-value tables (functional.get_4bit_type), index = nibble.
const std::array<float, 16>& code_table(QuantType t);
// bitsandbytes' functional.create_dynamic_map(signed, max_exponent_bits=7, total_bits=8): 256
// sorted values in [-1, 1] (signed; double quantization, 8-bit Adam's first moment) or [0, 1]
// (unsigned; 8-bit Adam's second moment), generated the way bitsandbytes does (float32
// linspace, means, powers of ten), not copied from a table.
std::vector<float> create_dynamic_map(bool is_signed = true);

// torch.Tensor.mean() of a contiguous float32 vector on the CPU, bit for bit for fewer than 32768
// elements (one thread): torch's cascade sum with `vector_width` float lanes (8 on AVX2 builds,
// 16 on AVX-512), then one float division. Longer inputs are summed the same way in one pass.
float torch_mean_f32(const float* x, int64_t n, int vector_width = 8);

// Blockwise quantization with a sorted code (bitsandbytes' default backend): per block absmax,
// x * f32(1 / absmax) for full blocks, x / absmax for the partial last block, clamp to [-1, 1],
// index = number of midpoints below the value. Writes n indices and ceil(n / bs) absmax values.
void quantize_blockwise(const float* x, int64_t n, const float* sorted_code, int code_size,
                        int64_t blocksize, uint8_t* q, float* absmax);

struct QuantizedWeight {
  QuantType type = QuantType::NF4;
  int64_t blocksize = 64;
  DType dtype = DType::BF16;  // the original weight's dtype (the JSON's "dtype")
  Shape shape;                // the original weight's shape
  Tensor packed;              // U8 [(numel + 1) / 2, 1]
  Tensor absmax;              // U8 [n_blocks] with double quantization, else F32 [n_blocks]
  Tensor quant_map;           // F32 [16]
  bool nested = false;        // double quantization
  int64_t nested_blocksize = 256;
  Tensor nested_absmax;     // F32 [ceil(n_blocks / 256)]
  Tensor nested_quant_map;  // F32 [256]
  float nested_offset = 0;

  int64_t numel() const { return shape_numel(shape); }
  int64_t n_blocks() const { return (numel() + blocksize - 1) / blocksize; }
  Device device() const { return packed.device(); }
  // Bytes of every tensor above (what the weight costs in memory).
  size_t nbytes() const;
  QuantizedWeight to(Device dev) const;
};

// Quantizes a float weight (F32, BF16 or F16, on the CPU) as bitsandbytes' quantize_4bit does.
QuantizedWeight quantize_4bit(const Tensor& w, QuantType type = QuantType::NF4,
                              int64_t blocksize = 64, bool double_quant = true);

// The float32 scale of every block (decoded from the double quantization when nested). CPU.
std::vector<float> effective_absmax(const QuantizedWeight& q);

// out = the weight, numel equal to q's: f32(code[nibble] * absmax), rounded to q.dtype (what
// bitsandbytes' dequantize_4bit returns), then converted to out's dtype (F32, BF16 or F16). On the
// CPU, or on CUDA (out F32 or BF16) by one kernel that decodes the double-quantized absmax inline.
void dequantize_4bit(const QuantizedWeight& q, Tensor& out);
// The same without the rounding to q.dtype: the float32 product bitsandbytes computes first.
void dequantize_4bit_f32(const QuantizedWeight& q, Tensor& out);

// The quant-state JSON exactly as bitsandbytes' QuantState.as_dict(packed=True) serializes it.
std::string quant_state_json(const QuantizedWeight& q);
// "quant_state.bitsandbytes__nf4" (or __fp4).
std::string quant_state_suffix(QuantType t);

// The tensors transformers saves for a quantized Linear whose weight key is `key`
// ("model.layers.0.self_attn.q_proj.weight"): key, key.absmax, key.quant_map,
// [key.nested_absmax, key.nested_quant_map,] key.quant_state.bitsandbytes__nf4.
std::vector<std::pair<std::string, Tensor>> state_dict(const std::string& key,
                                                       const QuantizedWeight& q);

// Whether `key` is stored quantized (a quant-state tensor accompanies it).
bool is_quantized(const WeightFiles& w, const std::string& key);
// Reads and checks a quantized weight (owned CPU copies). `expect_shape` (when not empty) is the
// shape the architecture implies. Errors name the file and the tensor. `tensors` false: the
// scalars only (the tensors checked, not read).
QuantizedWeight load_quantized(const WeightFiles& w, const std::string& key,
                               const Shape& expect_shape = {}, bool tensors = true);

// Quantization settings of a bitsandbytes 4-bit model (config.json's quantization_config).
struct QuantConfig {
  QuantType type = QuantType::NF4;
  int64_t blocksize = 64;
  bool double_quant = true;
  std::string compute_dtype = "bfloat16";
  std::string storage = "uint8";
};
// quantization_config as transformers 5 writes it for BitsAndBytesConfig(load_in_4bit=True, ...).
nlohmann::json quantization_config_json(const QuantConfig& c);
// Parses config.json's quantization_config; nullopt when there is none. Errors name `source`.
std::optional<QuantConfig> parse_quantization_config(const nlohmann::json& cfg,
                                                     const std::string& source);

}  // namespace rig::quant
