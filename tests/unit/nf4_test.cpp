// NF4 / FP4 blockwise quantization and double quantization against bitsandbytes' own outputs
// (tests/data/bnb-nf4, made by bitsandbytes 0.50.1): bit for bit, both ways.
#include "rig/quant/nf4.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>

#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "test_util.h"

using namespace rig;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

std::string fix(const std::string& rel) {
  return test::data_path("bnb-nf4/" + rel);
}

const json& cases_json() {
  static const json j = json::parse(read_file(fix("cases.json")));
  return j;
}

// A case file: the copy in tests/data, or the full fixture set named by RIG_BNB_FIXTURES.
std::string case_path(const json& c) {
  std::string p = fix(c["file"].get<std::string>());
  if (fs::exists(p)) return p;
  if (const char* env = std::getenv("RIG_BNB_FIXTURES")) {
    std::string q = std::string(env) + "/" + c["file"].get<std::string>();
    if (fs::exists(q)) return q;
  }
  return "";
}

// Only the 4.7 MB case is left out of the repository (tests/data/bnb-nf4/COPIED.md).
bool may_be_absent(const json& c) {
  return c["name"] == "nf4_bs64_dq_bf16_256x4096";
}

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

// First differing byte (or -1), for messages.
int64_t first_diff(const Tensor& a, const Tensor& b) {
  const auto *pa = static_cast<const uint8_t*>(a.raw()), *pb = static_cast<const uint8_t*>(b.raw());
  for (size_t i = 0; i < std::min(a.nbytes(), b.nbytes()); ++i)
    if (pa[i] != pb[i]) return int64_t(i);
  return a.nbytes() == b.nbytes() ? -1 : int64_t(std::min(a.nbytes(), b.nbytes()));
}

DType dtype_of(const std::string& s) {
  if (s == "float32") return DType::F32;
  if (s == "bfloat16") return DType::BF16;
  return DType::F16;
}

}  // namespace

TEST(NF4, TablesAreBitsandbytes) {
  const json& t = cases_json()["tables"];
  const auto& nf4 = quant::code_table(quant::QuantType::NF4);
  const auto& fp4 = quant::code_table(quant::QuantType::FP4);
  ASSERT_EQ(t["nf4_code"].size(), 16u);
  for (int i = 0; i < 16; ++i) {
    EXPECT_EQ(bits(nf4[size_t(i)]), bits(t["nf4_code"][size_t(i)].get<float>())) << i;
    EXPECT_EQ(fmt::format("{:08x}", bits(nf4[size_t(i)])),
              t["nf4_code_hex"][size_t(i)].get<std::string>());
    EXPECT_EQ(bits(fp4[size_t(i)]), bits(t["fp4_code"][size_t(i)].get<float>())) << i;
  }
  // The dynamic map is generated as bitsandbytes' create_dynamic_map does, then compared.
  const auto dyn = quant::create_dynamic_map();
  ASSERT_EQ(dyn.size(), 256u);
  ASSERT_EQ(t["dynamic_code_256"].size(), 256u);
  int diff = 0;
  for (size_t i = 0; i < 256; ++i)
    diff += bits(dyn[i]) != bits(t["dynamic_code_256"][i].get<float>());
  EXPECT_EQ(diff, 0);
}

TEST(NF4, QuantizeReproducesEveryFixtureCase) {
  int checked = 0;
  for (const json& c : cases_json()["cases"]) {
    const std::string name = c["name"], path = case_path(c);
    if (path.empty()) {
      EXPECT_TRUE(may_be_absent(c)) << name << " is missing";
      continue;
    }
    SCOPED_TRACE(name);
    auto f = SafeTensorsFile::open(path);
    quant::QuantType type;
    ASSERT_TRUE(quant::parse_quant_type(c["quant_type"], &type));
    const bool dq = c["double_quant"];
    Tensor input = f.get("input").clone();
    ASSERT_EQ(input.dtype(), dtype_of(c["input_dtype"]));
    auto q = quant::quantize_4bit(input, type, c["blocksize"].get<int64_t>(), dq);
    // Every tensor transformers would save, byte for byte.
    auto sd = quant::state_dict("weight", q);
    size_t n_saved = 0;
    for (const auto& t : f.tensors()) n_saved += t.name.rfind("weight", 0) == 0;
    EXPECT_EQ(sd.size(), n_saved);
    for (const auto& [key, t] : sd) {
      ASSERT_TRUE(f.has(key)) << key;
      Tensor want = f.get(key);
      EXPECT_EQ(t.dtype(), want.dtype()) << key;
      EXPECT_EQ(t.shape(), want.shape()) << key;
      EXPECT_TRUE(same_bytes(t, want)) << key << ": first differing byte " << first_diff(t, want);
    }
    // The JSON string itself, as cases.json records it.
    EXPECT_EQ(quant::quant_state_json(q), c["quant_state_json"].get<std::string>());
    // The raw absmax (before double quantization) and the fp32 offset.
    auto raw = quant::quantize_4bit(input, type, c["blocksize"].get<int64_t>(), false);
    EXPECT_TRUE(same_bytes(raw.absmax, f.get("absmax_raw_f32")));
    EXPECT_TRUE(same_bytes(raw.packed, f.get("weight")));
    if (dq) {
      EXPECT_EQ(bits(q.nested_offset), bits(f.get_f32("nested_offset_f32").f32()[0]));
    }
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

TEST(NF4, DequantizeReproducesEveryFixtureCase) {
  int checked = 0;
  for (const json& c : cases_json()["cases"]) {
    const std::string name = c["name"], path = case_path(c);
    if (path.empty()) {
      EXPECT_TRUE(may_be_absent(c)) << name << " is missing";
      continue;
    }
    SCOPED_TRACE(name);
    auto w = WeightFiles::open_file(path);
    auto shape = c["shape"].get<Shape>();
    auto q = quant::load_quantized(w, "weight", shape);
    EXPECT_EQ(q.dtype, dtype_of(c["input_dtype"]));
    EXPECT_EQ(q.nested, c["double_quant"].get<bool>());
    EXPECT_EQ(q.n_blocks(), c["n_blocks"].get<int64_t>());
    // The scales bitsandbytes multiplies with (decoded double quantization, negative ones kept).
    auto eff = quant::effective_absmax(q);
    Tensor want_eff = w.get("absmax_eff_f32");
    ASSERT_EQ(int64_t(eff.size()), want_eff.numel());
    EXPECT_EQ(0, std::memcmp(eff.data(), want_eff.raw(), eff.size() * 4));
    // bitsandbytes' dequantize_4bit output (in the weight's own dtype), bit for bit.
    Tensor want = w.get("dequant");
    Tensor out = Tensor::empty(shape, want.dtype());
    quant::dequantize_4bit(q, out);
    EXPECT_TRUE(same_bytes(out, want)) << "first differing byte " << first_diff(out, want);
    // The float32 product before rounding, where the fixture keeps it.
    Tensor out32 = Tensor::empty(shape, DType::F32);
    quant::dequantize_4bit_f32(q, out32);
    if (w.has("dequant_f32")) {
      EXPECT_TRUE(same_bytes(out32, w.get("dequant_f32")));
    } else if (want.dtype() == DType::F32) {
      EXPECT_TRUE(same_bytes(out32, want));  // pruned where it equals `dequant`
    } else {
      EXPECT_TRUE(may_be_absent(c));  // and from the large case, for size
    }
    // Rounded to the weight's dtype, then widened: what a float32 product reads.
    Tensor widened = Tensor::empty(shape, DType::F32);
    quant::dequantize_4bit(q, widened);
    EXPECT_TRUE(same_bytes(widened, want.to_dtype(DType::F32)));
    ++checked;
  }
  EXPECT_GE(checked, 15);
}

TEST(NF4, QuantStateJsonWritesFloatsAsPython) {
  quant::QuantizedWeight q;
  q.shape = {3};
  q.blocksize = 128;
  q.dtype = DType::F16;
  EXPECT_EQ(quant::quant_state_json(q),
            R"({"quant_type": "nf4", "blocksize": 128, "dtype": "float16", "shape": [3]})");
  q.nested = true;
  // Python's repr of each float32 value widened to double (checked with python3 and struct).
  const std::pair<float, const char*> cases[] = {{0.5f, "0.5"},
                                                 {1.0f, "1.0"},
                                                 {0.0f, "0.0"},
                                                 {-0.25f, "-0.25"},
                                                 {1e-5f, "9.999999747378752e-06"},
                                                 {0.1f, "0.10000000149011612"},
                                                 {3e20f, "3.000000060122632e+20"}};
  for (const auto& [v, s] : cases) {
    q.nested_offset = v;
    EXPECT_EQ(
        quant::quant_state_json(q),
        std::string(R"({"quant_type": "nf4", "blocksize": 128, "dtype": "float16", "shape": [3], )"
                    R"("nested_blocksize": 256, "nested_dtype": "float32", "nested_offset": )") +
            s + "}");
  }
}

namespace {

// Rewrites a fixture case with `edit` applied to its tensors and returns the new file.
std::string edited_case(
    const std::string& dir, const std::string& file,
    const std::function<void(std::vector<std::pair<std::string, Tensor>>&)>& edit) {
  auto f = SafeTensorsFile::open(fix(file));
  std::vector<std::pair<std::string, Tensor>> ts;
  for (const auto& t : f.tensors()) ts.emplace_back(t.name, f.get(t.name).clone());
  edit(ts);
  std::string out = dir + "/model.safetensors";
  save_safetensors(out, ts);
  return out;
}

Tensor bytes_tensor(const std::string& s) {
  Tensor t = Tensor::empty({int64_t(s.size())}, DType::U8);
  std::memcpy(t.raw(), s.data(), s.size());
  return t;
}

// load_quantized's error for the edited file (empty if it loaded).
std::string load_error(const std::string& path, const Shape& shape = {64, 64}) {
  try {
    quant::load_quantized(WeightFiles::open_file(path), "weight", shape);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

const char* kCase = "cases/nf4_bs64_dq_f32_64x64.safetensors";
const char* kQs = "weight.quant_state.bitsandbytes__nf4";

}  // namespace

TEST(NF4, BadQuantizedWeightsAreClearErrors) {
  const std::string dir = test::temp_dir("nf4_bad");
  // The unedited file loads.
  EXPECT_EQ(load_error(edited_case(dir, kCase, [](auto&) {})), "");
  // A truncated absmax: 63 codes for 64 blocks.
  auto p = edited_case(dir, kCase, [](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == "weight.absmax") t = t.slice_rows(0, 63).clone();
  });
  std::string e = load_error(p);
  EXPECT_NE(e.find(p), std::string::npos) << e;
  EXPECT_NE(e.find("'weight.absmax'"), std::string::npos) << e;
  EXPECT_NE(e.find("U8 [64]"), std::string::npos) << e;
  // A quant state whose shape disagrees with the architecture.
  p = edited_case(dir, kCase, [](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == kQs) {
        std::string s(static_cast<const char*>(t.raw()), t.nbytes());
        s.replace(s.find("[64, 64]"), 8, "[64, 65]");
        t = bytes_tensor(s);
      }
  });
  e = load_error(p);
  EXPECT_NE(e.find(p), std::string::npos) << e;
  EXPECT_NE(e.find(kQs), std::string::npos) << e;
  EXPECT_NE(e.find("[64, 65]"), std::string::npos) << e;
  // ... and with the packed data (no architecture to compare with).
  e = load_error(p, {});
  EXPECT_NE(e.find("'weight' holds 2048 bytes"), std::string::npos) << e;
  // An unknown quant_type.
  p = edited_case(dir, kCase, [](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == kQs) {
        std::string s(static_cast<const char*>(t.raw()), t.nbytes());
        s.replace(s.find("\"nf4\""), 5, "\"int3\"");
        t = bytes_tensor(s);
      }
  });
  e = load_error(p);
  EXPECT_NE(e.find(kQs), std::string::npos) << e;
  EXPECT_NE(e.find("unknown quant_type \"int3\""), std::string::npos) << e;
  // A quant state that is not JSON.
  p = edited_case(dir, kCase, [](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == kQs) t = bytes_tensor("{\"quant_type\": ");
  });
  e = load_error(p);
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
  // Each companion tensor missing.
  for (const char* gone : {"weight.absmax", "weight.quant_map", "weight.nested_absmax",
                           "weight.nested_quant_map", "weight"}) {
    p = edited_case(dir, kCase, [&](auto& ts) {
      std::erase_if(ts, [&](const auto& kv) { return kv.first == gone; });
    });
    e = load_error(p);
    EXPECT_NE(e.find(p), std::string::npos) << e;
    EXPECT_NE(e.find(std::string("'") + gone + "' is missing"), std::string::npos) << e;
  }
  // A quant map that is not bitsandbytes' NF4 table.
  p = edited_case(dir, kCase, [](auto& ts) {
    for (auto& [k, t] : ts)
      if (k == "weight.quant_map") t.f32()[3] = 0.5f;
  });
  e = load_error(p);
  EXPECT_NE(e.find("'weight.quant_map'"), std::string::npos) << e;
}
