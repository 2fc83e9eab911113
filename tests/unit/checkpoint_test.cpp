#include "rig/train/checkpoint.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <thread>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "test_util.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using rig::Tensor;
using Tensors = std::vector<std::pair<std::string, Tensor>>;

Tensor ramp(int64_t n, float scale = 0.01f) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[size_t(i)] = scale * float(i % 97) - 0.3f;
  return Tensor::from_f32(v, {n});
}

Tensors small_set() {
  Tensor bf = ramp(64).to_dtype(rig::DType::BF16);
  Tensor ids = Tensor::empty({3}, rig::DType::I64);
  for (int i = 0; i < 3; ++i) ids.data<int64_t>()[i] = 1000 + i;
  return {{"layers.0.q_proj.lora_A", ramp(32).reshape({4, 8})},
          {"layers.0.q_proj.lora_B", ramp(48).reshape({8, 6})},
          {"optim.exp_avg.bf16", bf},
          {"data.order", ids}};
}

json state_for(int64_t step) {
  return {{"optimizer_step", step},
          {"rng", {{"seed", 42}, {"offset", step * 7}}},
          {"data_position", {{"epoch", 0}, {"index", step * 16}}},
          {"config_hash", "abc"}};
}

bool has_problem(const rig::VerifyReport& r, const std::string& where, const std::string& what) {
  for (const auto& p : r.problems)
    if (p.where.find(where) != std::string::npos && p.what.find(what) != std::string::npos)
      return true;
  return false;
}

// Flips one byte inside tensor `name` of the checkpoint's state.safetensors.
void corrupt_tensor_byte(const std::string& ckpt, const std::string& name) {
  std::string path = ckpt + "/state.safetensors";
  size_t off;
  {
    rig::SafeTensorsFile f = rig::SafeTensorsFile::open(path);
    std::string bytes = rig::read_file(path);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; ++i) hlen |= uint64_t(uint8_t(bytes[size_t(i)])) << (8 * i);
    off = 8 + hlen + f.info(name).begin + 5;
  }
  std::fstream io(path, std::ios::in | std::ios::out | std::ios::binary);
  io.seekg(std::streamoff(off));
  char c;
  io.get(c);
  io.seekp(std::streamoff(off));
  io.put(char(c ^ 0x10));
}

TEST(Checkpoint, SaveLoadRoundTrip) {
  std::string run = rig::test::temp_dir("ckpt_roundtrip");
  Tensors t = small_set();
  std::string dir = rig::save_checkpoint(run, 10, t, state_for(10));
  EXPECT_EQ(dir, run + "/checkpoints/step-10");
  for (const char* f : {"state.safetensors", "trainer_state.json", "manifest.json"})
    EXPECT_TRUE(fs::exists(dir + "/" + f)) << f;
  EXPECT_FALSE(fs::exists(run + "/checkpoints/.step-10.tmp"));

  rig::LoadedCheckpoint c = rig::load_checkpoint(dir);
  EXPECT_EQ(c.step, 10);
  EXPECT_EQ(c.state["step"], 10);
  EXPECT_EQ(c.state["rng"]["offset"], 70);
  ASSERT_EQ(c.tensors.size(), t.size());
  for (size_t i = 0; i < t.size(); ++i) {
    EXPECT_EQ(c.tensors[i].first, t[i].first);
    EXPECT_EQ(c.tensors[i].second.shape(), t[i].second.shape());
    EXPECT_EQ(c.tensors[i].second.dtype(), t[i].second.dtype());
    EXPECT_EQ(0, std::memcmp(c.tensors[i].second.raw(), t[i].second.raw(), t[i].second.nbytes()));
  }
  ASSERT_NE(c.find("data.order"), nullptr);
  EXPECT_EQ(c.find("data.order")->data<int64_t>()[2], 1002);

  rig::VerifyReport r = rig::verify_checkpoint(dir);
  EXPECT_TRUE(r.ok()) << r.to_text();
  EXPECT_EQ(r.step, 10);
  EXPECT_EQ(r.tensors, 4u);
  EXPECT_EQ(r.tensors_scanned, 3u);  // the I64 tensor has no float values to scan

  auto v = rig::test::run_rig("ckpt verify " + dir);
  EXPECT_EQ(v.code, 0) << v.out;
  EXPECT_NE(v.out.find("OK"), std::string::npos) << v.out;
}

TEST(Checkpoint, KeepLastAndLatest) {
  std::string run = rig::test::temp_dir("ckpt_keep");
  EXPECT_FALSE(rig::latest_checkpoint(run).has_value());
  for (int64_t s : {5, 10, 15, 20}) rig::save_checkpoint(run, s, small_set(), state_for(s), 2);
  auto all = rig::list_checkpoints(run);
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].step, 15);
  EXPECT_EQ(all[1].step, 20);
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step-5"));
  EXPECT_EQ(rig::latest_checkpoint(run)->step, 20);
  // Re-saving an existing step (after a rollback) replaces it.
  rig::save_checkpoint(run, 20, small_set(), state_for(20), 2);
  EXPECT_TRUE(rig::verify_checkpoint(run + "/checkpoints/step-20").ok());
  // After a rollback the checkpoint just written survives keep_last even though it is older.
  rig::save_checkpoint(run, 17, small_set(), state_for(17), 1);
  all = rig::list_checkpoints(run);
  ASSERT_EQ(all.size(), 1u);
  EXPECT_EQ(all[0].step, 17);
  rig::save_checkpoint(run, 15, small_set(), state_for(15));
  auto lst = rig::test::run_rig("ckpt list " + run);
  EXPECT_EQ(lst.code, 0);
  EXPECT_NE(lst.out.find("step-15"), std::string::npos) << lst.out;
}

TEST(Checkpoint, CorruptByteNamesTheTensor) {
  std::string run = rig::test::temp_dir("ckpt_corrupt");
  std::string dir = rig::save_checkpoint(run, 3, small_set(), state_for(3));
  corrupt_tensor_byte(dir, "layers.0.q_proj.lora_B");
  rig::VerifyReport r = rig::verify_checkpoint(dir);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(has_problem(r, "tensor 'layers.0.q_proj.lora_B'", "checksum")) << r.to_text();
  EXPECT_TRUE(has_problem(r, "state.safetensors", "checksum")) << r.to_text();
  EXPECT_FALSE(has_problem(r, "lora_A", "")) << r.to_text();
  try {
    rig::load_checkpoint(dir);
    FAIL() << "load accepted a corrupted checkpoint";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.q_proj.lora_B"), std::string::npos) << e.what();
  }
  auto v = rig::test::run_rig("ckpt verify " + run);  // a run folder: every checkpoint
  EXPECT_EQ(v.code, 2) << v.out;
  EXPECT_NE(v.out.find("tensor 'layers.0.q_proj.lora_B': checksum"), std::string::npos) << v.out;
}

TEST(Checkpoint, CorruptTrainerStateIsCaught) {
  std::string run = rig::test::temp_dir("ckpt_state");
  std::string dir = rig::save_checkpoint(run, 3, small_set(), state_for(3));
  std::string st = rig::read_file(dir + "/trainer_state.json");
  st[st.find("42")] = '7';  // same size, different content
  { std::ofstream(dir + "/trainer_state.json", std::ios::binary) << st; }
  rig::VerifyReport r = rig::verify_checkpoint(dir);
  EXPECT_TRUE(has_problem(r, "trainer_state.json", "checksum")) << r.to_text();
  EXPECT_THROW(rig::load_checkpoint(dir), rig::InputError);
}

TEST(Checkpoint, ManifestOfTheWrongShapeIsBadInputNotAnInternalError) {
  // Found by fuzz_checkpoint_manifest: a manifest whose 'files' lacks trainer_state.json made
  // load_checkpoint throw the JSON library's out_of_range.
  std::string run = rig::test::temp_dir("ckpt_manifest_shape");
  std::string dir = rig::save_checkpoint(run, 3, small_set(), state_for(3));
  json m = json::parse(rig::read_file(dir + "/manifest.json"));
  m["files"].erase("trainer_state.json");
  { std::ofstream(dir + "/manifest.json") << m.dump(); }
  try {
    rig::load_checkpoint(dir);
    FAIL() << "loaded a checkpoint whose manifest lacks trainer_state.json";
  } catch (const rig::InputError& e) {
    EXPECT_NE(std::string(e.what()).find(dir + ": manifest.json"), std::string::npos) << e.what();
  }
}

TEST(Checkpoint, NaNInfAndHugeValuesAreNamed) {
  std::string run = rig::test::temp_dir("ckpt_nan");
  Tensors t = small_set();
  Tensor bad = ramp(100);
  bad.f32()[17] = std::numeric_limits<float>::quiet_NaN();
  bad.f32()[50] = std::numeric_limits<float>::infinity();
  Tensor huge = ramp(10);
  huge.f32()[3] = 3e5f;
  Tensor bf = ramp(10);
  bf.f32()[2] = std::numeric_limits<float>::quiet_NaN();
  t.push_back({"layers.1.mlp.up_proj.weight", bad});
  t.push_back({"layers.1.mlp.down_proj.weight", huge});
  t.push_back({"optim.exp_avg_sq.bf16", bf.to_dtype(rig::DType::BF16)});
  std::string dir = rig::save_checkpoint(run, 7, t, state_for(7));

  rig::VerifyReport r = rig::verify_checkpoint(dir);
  EXPECT_FALSE(r.ok());
  EXPECT_TRUE(r.manifest_ok);  // checksums are fine: the values were bad when written
  EXPECT_TRUE(has_problem(r, "tensor 'layers.1.mlp.up_proj.weight'", "1 NaN and 1 Inf"))
      << r.to_text();
  EXPECT_TRUE(has_problem(r, "tensor 'layers.1.mlp.up_proj.weight'", "index 17")) << r.to_text();
  EXPECT_TRUE(has_problem(r, "tensor 'layers.1.mlp.down_proj.weight'", "3e+05")) << r.to_text();
  EXPECT_TRUE(has_problem(r, "tensor 'optim.exp_avg_sq.bf16'", "1 NaN")) << r.to_text();
  EXPECT_EQ(r.problems.size(), 3u) << r.to_text();

  // The limit is configurable, per tensor too.
  rig::VerifyOptions o;
  o.max_abs_for = {{"down_proj", 1e6}};
  rig::VerifyReport r2 = rig::verify_checkpoint(dir, o);
  EXPECT_FALSE(has_problem(r2, "down_proj", "")) << r2.to_text();

  auto v = rig::test::run_rig("ckpt verify " + dir + " --json");
  EXPECT_EQ(v.code, 2);
  json j = json::parse(v.out);
  EXPECT_EQ(j[0]["ok"], false);
  EXPECT_EQ(j[0]["problems"].size(), 3u);
  EXPECT_EQ(rig::test::run_rig("ckpt verify " + dir + " --max-abs 1e6 --no-scan").code, 0);
}

TEST(Checkpoint, LeftoverTmpAndIncompleteFoldersAreIgnored) {
  std::string run = rig::test::temp_dir("ckpt_leftover");
  rig::save_checkpoint(run, 1, small_set(), state_for(1));
  std::string good = rig::save_checkpoint(run, 2, small_set(), state_for(2));
  // A writer killed mid-step-3: a temporary folder holding half a tensor file.
  fs::create_directories(run + "/checkpoints/.step-3.tmp");
  std::string half = rig::read_file(good + "/state.safetensors");
  half.resize(half.size() / 2);
  std::ofstream(run + "/checkpoints/.step-3.tmp/state.safetensors", std::ios::binary) << half;
  // A step folder without a manifest, and one whose tensor file was truncated afterwards.
  fs::create_directories(run + "/checkpoints/step-4");
  std::ofstream(run + "/checkpoints/step-4/state.safetensors", std::ios::binary) << half;
  fs::copy(good, run + "/checkpoints/step-5");
  fs::resize_file(run + "/checkpoints/step-5/state.safetensors", half.size());

  auto latest = rig::latest_checkpoint(run);
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 2);
  EXPECT_EQ(latest->dir, good);
  EXPECT_TRUE(rig::verify_checkpoint(good).ok());
  rig::VerifyReport r4 = rig::verify_checkpoint(run + "/checkpoints/step-4");
  EXPECT_FALSE(r4.manifest_ok);
  EXPECT_TRUE(has_problem(r4, "manifest.json", "missing")) << r4.to_text();
  EXPECT_THROW(rig::load_checkpoint(run + "/checkpoints/step-4"), rig::InputError);
  rig::VerifyReport r5 = rig::verify_checkpoint(run + "/checkpoints/step-5");
  EXPECT_TRUE(has_problem(r5, "state.safetensors", "truncated")) << r5.to_text();
  // The next save clears the dead writer's folder.
  rig::save_checkpoint(run, 6, small_set(), state_for(6));
  EXPECT_FALSE(fs::exists(run + "/checkpoints/.step-3.tmp"));
}

TEST(Checkpoint, SigkillDuringWriteLeavesPreviousCheckpoint) {
  std::string run = rig::test::temp_dir("ckpt_kill");
  std::string first = rig::save_checkpoint(run, 1, small_set(), state_for(1));
  // Big enough that writing takes a while: 24 tensors of 4 MiB.
  Tensors big;
  for (int i = 0; i < 24; ++i) big.push_back({fmt::format("layers.{}.weight", i), ramp(1 << 20)});

  pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    try {
      for (int64_t s = 2;; ++s) rig::save_checkpoint(run, s, big, state_for(s), 3);
    } catch (...) {
    }
    _exit(3);
  }
  // Wait until the child is inside its second save (a file of step 3 being written), then kill
  // it. Should the polling miss that window, step 3 done also ends the wait: the kill then lands
  // in a later save, which the checks below cover as well.
  const std::string tmp3 = run + "/checkpoints/.step-3.tmp";
  auto writing = [&] {
    std::error_code ec;
    try {
      for (const auto& f : fs::directory_iterator(tmp3, ec))
        if (f.is_regular_file(ec)) return true;
    } catch (const fs::filesystem_error&) {  // renamed or removed while listed
    }
    return fs::exists(run + "/checkpoints/step-3", ec);
  };
  EXPECT_TRUE(rig::test::wait_until(writing, 300));
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  int st = 0;
  waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFSIGNALED(st)) << "the child ended by itself: " << st;

  auto latest = rig::latest_checkpoint(run);
  ASSERT_TRUE(latest.has_value());
  EXPECT_GE(latest->step, 2);
  // Whatever the kill interrupted is not taken as complete.
  for (const auto& e : fs::directory_iterator(run + "/checkpoints")) {
    std::string n = e.path().filename().string();
    if (n.rfind(".step-", 0) == 0) {
      int64_t s = std::stoll(n.substr(6));
      EXPECT_LT(latest->step, s) << n;
    }
  }
  rig::VerifyReport r = rig::verify_checkpoint(latest->dir);
  EXPECT_TRUE(r.ok()) << r.to_text();
  EXPECT_EQ(rig::load_checkpoint(latest->dir).tensors.size(), big.size());
  EXPECT_TRUE(rig::verify_checkpoint(first).ok());
}

TEST(Checkpoint, BadArguments) {
  std::string run = rig::test::temp_dir("ckpt_bad");
  EXPECT_THROW(rig::save_checkpoint(run, -1, small_set(), json::object()), rig::InputError);
  EXPECT_THROW(rig::save_checkpoint(run, 1, small_set(), json::array()), rig::InputError);
  EXPECT_THROW(rig::save_checkpoint(run, 1, small_set(), json{{"step", 2}}), rig::InputError);
  EXPECT_THROW(rig::verify_checkpoint(run + "/nope"), rig::InputError);
  EXPECT_THROW(rig::load_checkpoint(run + "/nope"), rig::InputError);
  auto v = rig::test::run_rig("ckpt verify " + run + "/nope");
  EXPECT_EQ(v.code, 1);
  EXPECT_NE(v.out.find("no such folder"), std::string::npos) << v.out;
}

TEST(Checkpoint, ValueStats) {
  Tensor t = Tensor::from_f32({1, -5, 2, std::nanf(""), -INFINITY}, {5});
  rig::ValueStats s = rig::value_stats(t);
  EXPECT_EQ(s.nan, 1u);
  EXPECT_EQ(s.inf, 1u);
  EXPECT_EQ(s.first_bad_at, 3);
  EXPECT_DOUBLE_EQ(s.max_abs, 5);
  EXPECT_EQ(s.max_abs_at, 1);
  rig::ValueStats b = rig::value_stats(t.to_dtype(rig::DType::BF16));
  EXPECT_EQ(b.nan, 1u);
  EXPECT_EQ(b.inf, 1u);
}

}  // namespace
