// Tokenizer throughput: MB/s encoding a large mixed corpus one text at a time on one thread, and
// with encode_batch on all threads. The corpus is the seed documents plus the tokenizer reference
// texts, split into lines (pieces of ~100-200 bytes, like the HF baseline) and repeated to ~20 MB.
//
// usage: tokenizer_bench TOKENIZER_JSON [SEED_DIR] [REFERENCE_JSON...] [--mb N] [--threads N]
#include <fmt/format.h>

#include <algorithm>
#include <time.h>

#include <chrono>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <thread>

#include "rig/io/atomic_file.h"
#include "rig/text/tokenizer.h"
#include "rig/text/utf8.h"

namespace fs = std::filesystem;

int main(int argc, char** argv) try {
  if (argc < 2) {
    fmt::print(stderr, "usage: {} TOKENIZER_JSON [SEED_DIR] [REFERENCE_JSON...] [--mb N] [--threads N]\n", argv[0]);
    return 2;
  }
  double target_mb = 20;
  int threads = int(std::thread::hardware_concurrency());
  std::vector<std::string> texts;
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    if (a == "--mb" && i + 1 < argc) { target_mb = std::stod(argv[++i]); continue; }
    if (a == "--threads" && i + 1 < argc) { threads = std::stoi(argv[++i]); continue; }
    if (fs::is_directory(a)) {
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(a))
        if (e.path().extension() == ".txt") files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const auto& f : files) {
        std::string doc = rig::read_file(f.string()), line;
        for (char c : doc) {
          line += c;
          if (c == '\n') { texts.push_back(line); line.clear(); }
        }
        if (!line.empty()) texts.push_back(line);
      }
    } else {
      for (const auto& r : nlohmann::json::parse(rig::read_file(a))) texts.push_back(r["text"].get<std::string>());
    }
  }
  if (texts.empty()) texts.push_back("Hello world, this is a tokenizer benchmark. 你好，世界！ 12345\n");
  size_t base = 0;
  for (const auto& t : texts) base += t.size();
  std::vector<std::string> corpus;
  size_t bytes = 0;
  // A tenth of the corpus is unique random Unicode, so the word cache cannot hide the BPE cost.
  std::mt19937 rng(7);
  const std::pair<char32_t, char32_t> ranges[] = {{0x20, 0x7E}, {0x20, 0x7E}, {0xA0, 0x24F},
                                                  {0x400, 0x4FF}, {0x4E00, 0x9FFF}, {0x1F300, 0x1FAFF}};
  while (double(bytes) < target_mb * 1e5) {
    std::string s;
    for (int i = 0; i < 60; ++i) {
      auto [lo, hi] = ranges[rng() % 6];
      rig::utf8::append(s, char32_t(lo + rng() % (hi - lo + 1)));
    }
    corpus.push_back(s);
    bytes += s.size();
  }
  while (double(bytes) < target_mb * 1e6)
    for (const auto& t : texts) { corpus.push_back(t); bytes += t.size(); }
  std::shuffle(corpus.begin(), corpus.end(), rng);

  auto t0 = std::chrono::steady_clock::now();
  auto tok = rig::Tokenizer::load(argv[1]);
  auto t1 = std::chrono::steady_clock::now();
  fmt::print("tokenizer {} loaded in {:.2f} s; corpus {:.1f} MB in {} texts ({} bytes on average, {} distinct)\n",
             argv[1], std::chrono::duration<double>(t1 - t0).count(), bytes / 1e6, corpus.size(),
             bytes / std::max<size_t>(1, corpus.size()), texts.size());
  (void)base;
  // CPU seconds as well as wall seconds: on a shared machine wall time includes waiting for a core.
  auto cpu = [](clockid_t id) {
    timespec ts;
    clock_gettime(id, &ts);
    return double(ts.tv_sec) + ts.tv_nsec * 1e-9;
  };
  size_t ntok = 0;
  double c0 = cpu(CLOCK_THREAD_CPUTIME_ID);
  t0 = std::chrono::steady_clock::now();
  for (const auto& t : corpus) ntok += tok.encode(t).size();
  t1 = std::chrono::steady_clock::now();
  double s1 = std::chrono::duration<double>(t1 - t0).count();
  double cs1 = cpu(CLOCK_THREAD_CPUTIME_ID) - c0;
  fmt::print("1 thread:   {:8.2f} MB/s wall, {:8.2f} MB/s per CPU second  ({:.2f} s, {} tokens)\n",
             bytes / 1e6 / s1, bytes / 1e6 / cs1, s1, ntok);
  double p0 = cpu(CLOCK_PROCESS_CPUTIME_ID);
  t0 = std::chrono::steady_clock::now();
  auto all = tok.encode_batch(corpus, {}, threads);
  t1 = std::chrono::steady_clock::now();
  double sn = std::chrono::duration<double>(t1 - t0).count();
  size_t ntok2 = 0;
  for (const auto& v : all) ntok2 += v.size();
  double csn = cpu(CLOCK_PROCESS_CPUTIME_ID) - p0;
  fmt::print("{} threads: {:8.2f} MB/s wall, {:8.2f} MB/s per CPU second  ({:.2f} s, {} tokens)\n", threads,
             bytes / 1e6 / sn, bytes / 1e6 / csn, sn, ntok2);
  if (ntok2 != ntok) { fmt::print(stderr, "token counts differ between 1 and {} threads\n", threads); return 1; }
  return 0;
} catch (const std::exception& e) {
  fmt::print(stderr, "tokenizer_bench: {}\n", e.what());
  return 1;
}
