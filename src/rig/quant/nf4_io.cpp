#include <cstring>

#include "rig/io/safetensors.h"
#include "rig/quant/nf4.h"
#include "rig/quant/nf4_impl.h"

// bitsandbytes' 4-bit weights as files hold them: the quant-state JSON, the tensors transformers
// saves, reading and checking them back, and config.json's quantization_config. (nf4.cpp holds
// the arithmetic.)

namespace rig::quant {

using json = nlohmann::json;

namespace {

std::string dtype_json_name(DType t) {
  switch (t) {
    case DType::F32:
      return "float32";
    case DType::BF16:
      return "bfloat16";
    case DType::F16:
      return "float16";
    default:
      fail("quant state: weight dtype {} has no bitsandbytes name", dtype_name(t));
  }
}

bool dtype_from_json_name(const std::string& s, DType* out) {
  if (s == "float32")
    *out = DType::F32;
  else if (s == "bfloat16")
    *out = DType::BF16;
  else if (s == "float16")
    *out = DType::F16;
  else
    return false;
  return true;
}

// Python's repr of a float (what json.dumps writes): the shortest round-trip digits, a ".0" on
// integral values, exponent form below 1e-4 and from 1e16.
std::string py_float_repr(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d > 0 ? "Infinity" : "-Infinity";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

}  // namespace

std::string quant_state_suffix(QuantType t) {
  return std::string("quant_state.bitsandbytes__") + quant_type_name(t);
}

std::string quant_state_json(const QuantizedWeight& q) {
  // json.dumps of QuantState.as_dict's non-tensor entries, in its key order.
  std::string s = fmt::format(
      R"({{"quant_type": "{}", "blocksize": {}, "dtype": "{}", "shape": [{}])",
      quant_type_name(q.type), q.blocksize, dtype_json_name(q.dtype), fmt::join(q.shape, ", "));
  if (q.nested)
    s += fmt::format(R"(, "nested_blocksize": {}, "nested_dtype": "float32", "nested_offset": {})",
                     q.nested_blocksize, py_float_repr(double(q.nested_offset)));
  return s + "}";
}

std::vector<std::pair<std::string, Tensor>> state_dict(const std::string& key,
                                                       const QuantizedWeight& q) {
  std::vector<std::pair<std::string, Tensor>> out;
  out.emplace_back(key, on_cpu(q.packed));
  out.emplace_back(key + ".absmax", on_cpu(q.absmax));
  out.emplace_back(key + ".quant_map", on_cpu(q.quant_map));
  if (q.nested) {
    out.emplace_back(key + ".nested_absmax", on_cpu(q.nested_absmax));
    out.emplace_back(key + ".nested_quant_map", on_cpu(q.nested_quant_map));
  }
  const std::string js = quant_state_json(q);
  Tensor t = Tensor::empty({int64_t(js.size())}, DType::U8, Device::cpu(), "quant state");
  std::memcpy(t.raw(), js.data(), js.size());
  out.emplace_back(key + "." + quant_state_suffix(q.type), t);
  return out;
}

bool is_quantized(const WeightFiles& w, const std::string& key) {
  return w.has(key + "." + quant_state_suffix(QuantType::NF4)) ||
         w.has(key + "." + quant_state_suffix(QuantType::FP4));
}

namespace {

// "<file>: tensor '<name>'", how errors name a tensor.
std::string tensor_at(const WeightFiles& w, const std::string& t) {
  return fmt::format("{}: tensor '{}'", w.path_of(t), t);
}

// The quant-state JSON's scalars into q: quant type (matching the tensor's name `qs_key`),
// blocksize, dtype, shape (against `expect_shape` when given) and the nested fields.
void read_quant_state(const WeightFiles& w, const std::string& key, const std::string& qs_key,
                      const Shape& expect_shape, QuantizedWeight& q) {
  const std::string at = tensor_at(w, qs_key);
  const TensorInfo& qi = w.info(qs_key);
  if (qi.dtype != DType::U8 || qi.shape.size() != 1)
    bad_input("{}: the quant state must be U8 [bytes], found {} {}", at, dtype_name(qi.dtype),
              shape_str(qi.shape));
  Tensor qb = w.get(qs_key);
  const std::string text(static_cast<const char*>(qb.raw()), qb.nbytes());
  json js;
  try {
    js = json::parse(text);
  } catch (const json::exception& e) {
    bad_input("{}: the quant state is not valid JSON: {}", at, e.what());
  }
  if (!js.is_object()) bad_input("{}: the quant state must be a JSON object", at);
  auto field = [&](const char* k) -> const json& {
    if (!js.contains(k)) bad_input("{}: the quant state has no '{}': {}", at, k, text);
    return js[k];
  };
  const json& qt = field("quant_type");
  if (!qt.is_string() || !parse_quant_type(qt.get<std::string>(), &q.type))
    bad_input("{}: unknown quant_type {} (rig reads bitsandbytes' nf4 and fp4)", at, qt.dump());
  if (qs_key != key + "." + quant_state_suffix(q.type))
    bad_input("{}: quant_type \"{}\" does not match the tensor's name", at,
              quant_type_name(q.type));
  const json& bs = field("blocksize");
  if (!bs.is_number_integer() || bs.get<int64_t>() <= 0 || bs.get<int64_t>() > (1 << 20))
    bad_input("{}: blocksize {} must be a positive integer", at, bs.dump());
  q.blocksize = bs.get<int64_t>();
  const json& dt = field("dtype");
  if (!dt.is_string() || !dtype_from_json_name(dt.get<std::string>(), &q.dtype))
    bad_input("{}: dtype {} is not float32, bfloat16 or float16", at, dt.dump());
  const json& sh = field("shape");
  bool shape_ok = sh.is_array() && !sh.empty();
  if (shape_ok)
    for (const auto& d : sh)
      shape_ok = shape_ok && d.is_number_integer() && d.get<int64_t>() >= 0 &&
                 d.get<int64_t>() < (int64_t(1) << 40);
  if (!shape_ok) bad_input("{}: shape {} is not a list of sizes", at, sh.dump());
  for (const auto& d : sh) q.shape.push_back(d.get<int64_t>());
  if (!expect_shape.empty() && q.shape != expect_shape)
    bad_input(
        "{}: the quant state's shape {} differs from the {} that config.json implies for '{}'", at,
        shape_str(q.shape), shape_str(expect_shape), key);
  q.nested = js.contains("nested_offset") || js.contains("nested_blocksize");
  if (q.nested) {
    const json& nbs = field("nested_blocksize");
    if (!nbs.is_number_integer() || nbs.get<int64_t>() <= 0)
      bad_input("{}: nested_blocksize {} must be a positive integer", at, nbs.dump());
    q.nested_blocksize = nbs.get<int64_t>();
    if (js.contains("nested_dtype") && js["nested_dtype"] != "float32")
      bad_input("{}: nested_dtype {} (bitsandbytes writes float32)", at, js["nested_dtype"].dump());
    const json& off = field("nested_offset");
    if (!off.is_number()) bad_input("{}: nested_offset {} is not a number", at, off.dump());
    q.nested_offset = float(off.get<double>());
  }
}

// Every tensor a quant state of this shape needs is there, with its dtype and size.
void check_state_tensors(const WeightFiles& w, const std::string& key, const std::string& qs_key,
                         const QuantizedWeight& q) {
  auto where = [&](const std::string& t) { return tensor_at(w, t); };
  const std::string qs_file = w.path_of(qs_key);
  const int64_t n = q.numel(), nb = q.n_blocks();
  auto need = [&](const std::string& k) -> const TensorInfo& {
    if (!w.has(k))
      bad_input("{}: tensor '{}' is a bitsandbytes 4-bit weight (it has '{}') but '{}' is missing",
                qs_file, key, qs_key, k);
    return w.info(k);
  };
  auto expect = [&](const std::string& k, DType want, int64_t count, const char* what) {
    const TensorInfo& t = need(k);
    if (t.dtype != want || shape_numel(t.shape) != count)
      bad_input("{} is {} {}, but a {} weight {} needs {} [{}] ({})", where(k), dtype_name(t.dtype),
                shape_str(t.shape), shape_str(q.shape), q.nested ? "double-quantized" : "4-bit",
                dtype_name(want), count, what);
  };
  // The packed nibbles: U8 [(n + 1) / 2, 1] (other storage dtypes hold the same bytes).
  const TensorInfo& pi = need(key);
  const size_t want_bytes = size_t((n + 1) / 2);
  if (pi.end - pi.begin != want_bytes)
    bad_input("{} holds {} bytes ({} {}) but the quant state's shape {} needs {} packed bytes",
              where(key), pi.end - pi.begin, dtype_name(pi.dtype), shape_str(pi.shape),
              shape_str(q.shape), want_bytes);
  const std::string bs_note = fmt::format("one per block of {}", q.blocksize);
  expect(key + ".absmax", q.nested ? DType::U8 : DType::F32, nb, bs_note.c_str());
  expect(key + ".quant_map", DType::F32, 16, "the 4-bit code");
  if (q.nested) {
    const int64_t nn = (nb + q.nested_blocksize - 1) / q.nested_blocksize;
    const std::string nnote = fmt::format("one per {} blocks", q.nested_blocksize);
    expect(key + ".nested_absmax", DType::F32, nn, nnote.c_str());
    expect(key + ".nested_quant_map", DType::F32, 256, "the 8-bit dynamic code");
  }
}

}  // namespace

QuantizedWeight load_quantized(const WeightFiles& w, const std::string& key,
                               const Shape& expect_shape, bool tensors) {
  QuantizedWeight q;
  std::string qs_key = key + "." + quant_state_suffix(QuantType::NF4);
  if (!w.has(qs_key)) qs_key = key + "." + quant_state_suffix(QuantType::FP4);
  if (!w.has(qs_key))
    bad_input("{}: tensor '{}' has no quant state '{}.{}'", w.path_of(key), key, key,
              quant_state_suffix(QuantType::NF4));
  read_quant_state(w, key, qs_key, expect_shape, q);
  check_state_tensors(w, key, qs_key, q);
  if (!tensors) return q;
  const int64_t n = q.numel(), nb = q.n_blocks();
  const size_t want_bytes = size_t((n + 1) / 2);
  Tensor packed = w.get(key);
  q.packed = Tensor::empty({int64_t(want_bytes), 1}, DType::U8, Device::cpu(), "nf4 weight");
  std::memcpy(q.packed.raw(), packed.raw(), want_bytes);
  q.absmax = w.get(key + ".absmax").clone("nf4 absmax");
  q.quant_map = w.get(key + ".quant_map").clone("nf4 quant_map");
  const auto& table = code_table(q.type);
  for (int i = 0; i < 16; ++i)
    if (q.quant_map.f32()[i] != table[size_t(i)])
      bad_input("{}: value {} is {} but bitsandbytes' {} code has {} there",
                tensor_at(w, key + ".quant_map"), i, q.quant_map.f32()[i], quant_type_name(q.type),
                table[size_t(i)]);
  if (q.nested) {
    q.nested_absmax = w.get(key + ".nested_absmax").clone("nf4 nested_absmax");
    q.nested_quant_map = w.get(key + ".nested_quant_map").clone("nf4 nested_quant_map");
  }
  q.absmax = q.absmax.reshape({nb});
  return q;
}

json quantization_config_json(const QuantConfig& c) {
  return json{{"_load_in_4bit", true},
              {"_load_in_8bit", false},
              {"bnb_4bit_compute_dtype", c.compute_dtype},
              {"bnb_4bit_quant_storage", c.storage},
              {"bnb_4bit_quant_type", quant_type_name(c.type)},
              {"bnb_4bit_use_double_quant", c.double_quant},
              {"llm_int8_enable_fp32_cpu_offload", false},
              {"llm_int8_has_fp16_weight", false},
              {"llm_int8_skip_modules", nullptr},
              {"llm_int8_threshold", 6.0},
              {"load_in_4bit", true},
              {"load_in_8bit", false},
              {"quant_method", "bitsandbytes"}};
}

std::optional<QuantConfig> parse_quantization_config(const json& cfg, const std::string& source) {
  if (!cfg.is_object() || !cfg.contains("quantization_config") ||
      cfg["quantization_config"].is_null())
    return std::nullopt;
  const json& q = cfg["quantization_config"];
  const std::string where = source + ": quantization_config";
  if (!q.is_object()) bad_input("{} must be an object", where);
  const std::string method = q.value("quant_method", std::string("bitsandbytes"));
  if (method != "bitsandbytes")
    bad_input("{}: quant_method '{}' is not supported (rig reads bitsandbytes 4-bit models)", where,
              method);
  auto flag = [&](const char* k) { return q.contains(k) && q[k].is_boolean() && q[k].get<bool>(); };
  if (flag("load_in_8bit") || flag("_load_in_8bit"))
    bad_input("{}: 8-bit (LLM.int8) weights are not supported; rig reads 4-bit (load_in_4bit)",
              where);
  if (!flag("load_in_4bit") && !flag("_load_in_4bit"))
    bad_input("{}: load_in_4bit is not true; rig reads bitsandbytes 4-bit models", where);
  QuantConfig c;
  // transformers' BitsAndBytesConfig defaults: fp4, no double quantization, float32 compute.
  c.type = QuantType::FP4;
  c.double_quant = false;
  c.compute_dtype = "float32";
  if (q.contains("bnb_4bit_quant_type")) {
    const json& t = q["bnb_4bit_quant_type"];
    if (!t.is_string() || !parse_quant_type(t.get<std::string>(), &c.type))
      bad_input("{}: bnb_4bit_quant_type {} is not nf4 or fp4", where, t.dump());
  }
  if (q.contains("bnb_4bit_use_double_quant")) c.double_quant = flag("bnb_4bit_use_double_quant");
  if (q.contains("bnb_4bit_compute_dtype") && q["bnb_4bit_compute_dtype"].is_string())
    c.compute_dtype = q["bnb_4bit_compute_dtype"].get<std::string>();
  if (q.contains("bnb_4bit_quant_storage") && q["bnb_4bit_quant_storage"].is_string())
    c.storage = q["bnb_4bit_quant_storage"].get<std::string>();
  return c;
}

}  // namespace rig::quant
