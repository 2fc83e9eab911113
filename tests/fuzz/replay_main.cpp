// Without libFuzzer: mutate a valid file at random for N rounds and check the parser either
// accepts it with every tensor inside the buffer or rejects it with InputError.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

int main(int argc, char** argv) {
  long rounds = argc > 1 ? std::atol(argv[1]) : 10000;
  std::string header =
      R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"BF16","shape":[3],"data_offsets":[16,22]},"__metadata__":{"k":"v"}})";
  std::vector<uint8_t> seed(8);
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) seed[size_t(i)] = uint8_t(n >> (8 * i));
  seed.insert(seed.end(), header.begin(), header.end());
  seed.resize(seed.size() + 22, 7);
  std::mt19937_64 rng(12345);
  for (long r = 0; r < rounds; ++r) {
    std::vector<uint8_t> buf = seed;
    int edits = 1 + int(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      switch (rng() % 4) {
        case 0: buf[rng() % buf.size()] = uint8_t(rng()); break;
        case 1: buf.resize(rng() % (buf.size() + 1)); if (buf.empty()) buf.push_back(0); break;
        case 2: buf.insert(buf.begin() + long(rng() % buf.size()), uint8_t("0123456789[],:\"{}"[rng() % 17])); break;
        case 3: buf.erase(buf.begin() + long(rng() % buf.size())); if (buf.empty()) buf.push_back(0); break;
      }
    }
    LLVMFuzzerTestOneInput(buf.data(), buf.size());
  }
  std::printf("fuzz replay: %ld mutated inputs parsed without a crash\n", rounds);
  return 0;
}
