#include "rig/io/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "rig/io/atomic_file.h"
#include "test_util.h"

using namespace rig;

namespace {

std::string make_file(const std::string& header, size_t data_bytes, int64_t len_override = -1) {
  std::string s(8, '\0');
  uint64_t n = len_override >= 0 ? uint64_t(len_override) : header.size();
  for (int i = 0; i < 8; ++i) s[size_t(i)] = char(n >> (8 * i));
  s += header;
  s.append(data_bytes, '\x01');
  return s;
}

std::string write_tmp(const std::string& name, const std::string& bytes) {
  // One folder per test: ctest runs tests in parallel, and temp_dir empties the folder it returns.
  const std::string test = ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::string p = test::temp_dir("st-" + test) + "/" + name;
  std::ofstream(p, std::ios::binary) << bytes;
  return p;
}

std::string error_of(const std::string& bytes) {
  std::string p = write_tmp("bad.safetensors", bytes);
  try {
    SafeTensorsFile::open(p);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(SafeTensors, RoundTripAllDtypes) {
  std::string dir = test::temp_dir("st_rt");
  Tensor a = Tensor::from_f32({1, 2, 3, 4, 5, 6}, {2, 3});
  Tensor b = a.to_dtype(DType::BF16);
  Tensor c = Tensor::empty({3}, DType::I64);
  for (int i = 0; i < 3; ++i) c.data<int64_t>()[i] = 10 * i - 7;
  save_safetensors(dir + "/x.safetensors", {{"a", a}, {"b", b}, {"c", c}}, {{"format", "pt"}});
  auto f = SafeTensorsFile::open(dir + "/x.safetensors");
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  Tensor a2 = f.get_f32("a"), b2 = f.get_f32("b");
  EXPECT_EQ(a2.shape(), (Shape{2, 3}));
  for (int i = 0; i < 6; ++i) {
    EXPECT_EQ(a2.f32()[i], float(i + 1));
    EXPECT_EQ(b2.f32()[i], float(i + 1));  // small integers are exact in bf16
  }
  EXPECT_EQ(f.get("c").data<int64_t>()[2], 13);
  EXPECT_EQ(f.info("b").dtype, DType::BF16);
  // No temporary file is left behind.
  int files = 0;
  for (auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1);
}

TEST(SafeTensors, ReadsHuggingFaceFixture) {
  auto f = SafeTensorsFile::open(test::data_path("hf/tiny-llama3/model/model.safetensors"));
  auto& t = f.info("model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(t.shape, (Shape{32, 64}));
  EXPECT_EQ(f.tensors().size(), 21u);
}

TEST(SafeTensors, Bf16RoundingMatchesTorch) {
  // torch rounds to nearest even: 1 + 2^-8 is a tie and rounds down to 1.
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  for (float v : {0.0f, -2.5f, 65504.0f, 0.000060975552f}) EXPECT_EQ(f16_to_f32(f32_to_f16(v)), v);
  EXPECT_EQ(f32_to_f16(-3.14159f), 0xC248);  // -3.140625, the nearest half
  EXPECT_NEAR(f16_to_f32(f32_to_f16(1e-5f)), 1e-5f, 1e-7f);  // subnormal
}

TEST(SafeTensorsBadInput, ShortFile) {
  EXPECT_NE(error_of("abc").find("shorter than the 8-byte header"), std::string::npos);
}

TEST(SafeTensorsBadInput, HeaderLengthPastEnd) {
  EXPECT_NE(error_of(make_file("{}", 0, 5000)).find("runs past the end of the file"), std::string::npos);
}

TEST(SafeTensorsBadInput, HeaderLengthOverLimit) {
  EXPECT_NE(error_of(make_file("{}", 0, int64_t(200) << 20)).find("100 MB"), std::string::npos);
}

TEST(SafeTensorsBadInput, BadJson) {
  EXPECT_NE(error_of(make_file("{\"a\": ", 0)).find("not valid JSON"), std::string::npos);
}

TEST(SafeTensorsBadInput, NumberTooLargeForJson) {
  // Found by libFuzzer: nlohmann::json reports this as out_of_range, not as a parse error.
  auto e = error_of(make_file(R"({"a":{"dtype":"F32","shape":[411E111011110],"data_offsets":[0,0]}})", 0));
  EXPECT_NE(e.find("not valid JSON"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, UnknownDtype) {
  auto e = error_of(make_file(R"({"w":{"dtype":"F31","shape":[1],"data_offsets":[0,4]}})", 4));
  EXPECT_NE(e.find("unknown dtype 'F31'"), std::string::npos) << e;
  EXPECT_NE(e.find("'w'"), std::string::npos);
}

TEST(SafeTensorsBadInput, OverlappingOffsets) {
  auto e = error_of(make_file(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12));
  EXPECT_NE(e.find("overlap"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, HoleInOffsets) {
  auto e = error_of(make_file(
      R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})", 12));
  EXPECT_NE(e.find("hole"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, OffsetsPastBuffer) {
  auto e = error_of(make_file(R"({"w":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8));
  EXPECT_NE(e.find("run past the end of the data (8 bytes)"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, ShapeDisagreesWithOffsets) {
  auto e = error_of(make_file(R"({"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8));
  EXPECT_NE(e.find("needs 12 bytes"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, TruncatedRealFile) {
  std::string good = read_file(test::data_path("hf/tiny-llama3/model/model.safetensors"));
  auto e = error_of(good.substr(0, good.size() - 100));
  EXPECT_NE(e.find("run past the end of the data"), std::string::npos) << e;
}

TEST(SafeTensorsBadInput, CliReportsOneLineAndNonZeroExit) {
  std::string p = write_tmp("trunc.safetensors", "abc");
  auto r = test::run_rig("inspect " + p);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("rig: "), std::string::npos);
  EXPECT_NE(r.out.find("trunc.safetensors"), std::string::npos);
  EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << r.out;
}

TEST(SafeTensors, ShardedIndex) {
  std::string dir = test::temp_dir("sharded");
  save_safetensors(dir + "/model-00001-of-00002.safetensors", {{"a", Tensor::from_f32({1, 2}, {2})}});
  save_safetensors(dir + "/model-00002-of-00002.safetensors", {{"b", Tensor::from_f32({3}, {1})}});
  write_file_atomic(dir + "/model.safetensors.index.json",
                    R"({"metadata":{},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}})");
  auto w = WeightFiles::open_dir(dir);
  EXPECT_EQ(w.names().size(), 2u);
  EXPECT_EQ(w.get_f32("b").f32()[0], 3.0f);
  write_file_atomic(dir + "/model.safetensors.index.json",
                    R"({"weight_map":{"a":"model-00002-of-00002.safetensors"}})");
  EXPECT_THROW(WeightFiles::open_dir(dir), InputError);
}
