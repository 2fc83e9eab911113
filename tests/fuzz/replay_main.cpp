// Without libFuzzer: each kept input of a corpus folder runs as it is (regression cases, crash
// inputs included), then random mutations of them for N rounds; the target traps on anything but
// a clean accept or an InputError. Without a corpus folder the seed is a small safetensors file
// (the original safetensors target).
//
//   fuzz_NAME_replay ROUNDS [CORPUS_DIR]
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::string safetensors_seed() {
  std::string header =
      R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"__metadata__":{"k":"v"}})";
  std::string seed(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) seed[size_t(i)] = char(uint8_t(n >> (8 * i)));
  seed += header;
  seed.append(22, char(7));
  return seed;
}

const std::string* g_current = nullptr;
std::string g_name;

void run(const std::string& s) {
  g_current = &s;
  LLVMFuzzerTestOneInput(reinterpret_cast<const uint8_t*>(s.data()), s.size());
}

}  // namespace

// Called by a target that found a bug: the input goes to crash-NAME.bin in the working folder,
// ready to be kept in corpus/NAME as a regression case once fixed.
extern "C" void rig_fuzz_save_input() {
  if (!g_current) return;
  const std::string path = "crash-" + g_name + ".bin";
  std::ofstream(path, std::ios::binary) << *g_current;
  std::fprintf(stderr, "fuzz: input saved as %s\n", path.c_str());
}

int main(int argc, char** argv) {
  g_name = std::filesystem::path(argv[0]).filename().string();
  long rounds = argc > 1 ? std::atol(argv[1]) : 10000;
  std::vector<std::string> seeds;
  if (argc > 2) {
    std::vector<std::filesystem::path> files;
    for (const auto& e : std::filesystem::directory_iterator(argv[2]))
      if (e.is_regular_file()) files.push_back(e.path());
    std::sort(files.begin(), files.end());
    for (const auto& f : files) {
      std::ifstream in(f, std::ios::binary);
      seeds.emplace_back(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
      run(seeds.back());
    }
    if (seeds.empty()) {
      std::fprintf(stderr, "%s: no inputs in %s\n", argv[0], argv[2]);
      return 2;
    }
  } else {
    seeds.push_back(safetensors_seed());
  }
  std::mt19937_64 rng(12345);
  const std::string structural = "0123456789[],:\"{}-.\\ \n\tnulltrue";
  const std::string nums[] = {"-1", "0", "99999999999", "1e308", "-0.5", "65536"};
  for (long r = 0; r < rounds; ++r) {
    std::string buf = seeds[size_t(r) % seeds.size()];
    if (buf.empty()) buf.push_back('\0');
    int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const size_t at = rng() % buf.size();
      switch (rng() % 6) {
        case 0:
          buf[at] = char(rng());
          break;
        case 1:
          buf.resize(rng() % (buf.size() + 1));
          break;
        case 2:
          buf.insert(at, 1, structural[rng() % structural.size()]);
          break;
        case 3:
          buf.erase(at, 1);
          break;
        case 4:
          buf.insert(rng() % buf.size(), buf.substr(at, 1 + rng() % 16));
          break;  // repeat a piece
        case 5:
          buf.insert(at, nums[rng() % 6]);
          break;  // a large, negative or odd number
      }
      if (buf.empty()) buf.push_back('\0');
    }
    run(buf);
  }
  std::printf("fuzz replay: %zu kept input(s) and %ld mutated inputs without a crash\n",
              seeds.size(), rounds);
  return 0;
}
