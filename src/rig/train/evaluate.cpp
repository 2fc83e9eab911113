// Held-out evaluation and generation: the loss over held-out batches, and greedy or sampled
// generation with exact match against the trained tokens (shared by rig train, eval, generate).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <random>

#include "rig/train/trainer_impl.h"

namespace rig {

namespace {

std::string describe(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string s = tok.decode(ids, DecodeOptions{true});
  std::string out;
  for (char ch : s) {
    if (ch == '\n') {
      if (!out.empty() && out.back() != ' ') out += ' ';
    } else {
      out += ch;
    }
  }
  while (!out.empty() && out.back() == ' ') out.pop_back();
  return out;
}

}  // namespace

void check_generate_options(const GenerateOptions& opt) {
  if (!std::isfinite(opt.temperature) || opt.temperature < 0)
    bad_input("--temperature {}: must be a finite number >= 0 (0: greedy)", opt.temperature);
  if (!std::isfinite(opt.top_p) || opt.top_p <= 0 || opt.top_p > 1)
    bad_input("--top-p {}: must be in (0, 1]", opt.top_p);
  if (opt.max_new_tokens < 0 || opt.max_new_tokens > 1000000)
    bad_input("--max-new-tokens {}: must be between 0 and 1000000", opt.max_new_tokens);
}

int32_t sample_token(const std::vector<float>& logits, float temperature, float top_p,
                     std::mt19937_64& rng) {
  RIG_CHECK(!logits.empty(), "sample_token: no logits");
  if (temperature <= 0)
    return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
  // Softmax with temperature, then nucleus (top-p) sampling.
  std::vector<std::pair<double, int32_t>> p;
  const float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    const double e = std::exp(double(logits[i] - mx) / double(temperature));
    p.emplace_back(e, int32_t(i));
    sum += e;
  }
  std::sort(p.begin(), p.end(), std::greater<>());
  double keep = p[0].first;
  size_t k = 1;
  while (k < p.size() && keep < double(top_p) * sum) keep += p[k++].first;
  std::uniform_real_distribution<double> u(0, keep);
  const double r = u(rng);
  double acc = 0;
  for (size_t i = 0; i < k; ++i)
    if ((acc += p[i].first) >= r) return p[i].second;
  return p[k - 1].second;
}

std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt, GenerateStats* stats) {
  RIG_CHECK(!prompt.empty(), "generate needs a non-empty prompt");
  check_generate_options(opt);
  using Clock = std::chrono::steady_clock;
  auto ms_since = [](Clock::time_point t) {
    return std::chrono::duration<double, std::milli>(Clock::now() - t).count();
  };
  const auto t0 = Clock::now();
  Clock::time_point t1;
  auto cache = model.new_cache(int64_t(prompt.size()) + opt.max_new_tokens + 1);
  const std::vector<int64_t> feed(prompt.begin(), prompt.end());
  std::vector<int32_t> out;
  auto stop = [&](int32_t id) {
    return std::find(opt.stop_ids.begin(), opt.stop_ids.end(), id) != opt.stop_ids.end();
  };
  if (opt.temperature <= 0 && model.device().is_cuda()) {
    // The argmax on the device over the ids below the limit (std::max_element's pick: the first
    // largest); each step feeds the previous pick from the device.
    const int64_t limit = opt.vocab_limit > 0 ? opt.vocab_limit : 0;
    for (int64_t t = 0; t < opt.max_new_tokens; ++t) {
      const int32_t next = int32_t(t == 0 ? model.decode_greedy(cache, feed, limit)
                                          : model.decode_greedy(cache, {}, limit));
      if (t == 0) t1 = Clock::now();
      out.push_back(next);
      if (stop(next)) break;
    }
  } else {
    std::vector<float> logits = model.decode(cache, feed);
    t1 = Clock::now();
    const size_t limit =
        opt.vocab_limit > 0 ? std::min(logits.size(), size_t(opt.vocab_limit)) : logits.size();
    std::mt19937_64 rng(opt.seed);
    for (int64_t t = 0; t < opt.max_new_tokens; ++t) {
      logits.resize(limit);
      const int32_t next = sample_token(logits, opt.temperature, opt.top_p, rng);
      out.push_back(next);
      if (stop(next) || t + 1 == opt.max_new_tokens) break;  // no step for a token never read
      logits = model.decode(cache, {next});
    }
  }
  if (stats) {
    stats->prompt_tokens = int64_t(prompt.size());
    stats->new_tokens = int64_t(out.size());
    if (out.empty()) t1 = Clock::now();  // --max-new-tokens 0: the prompt's pass alone
    stats->prefill_ms = std::chrono::duration<double, std::milli>(t1 - t0).count();
    stats->decode_ms = ms_since(t1);
  }
  return out;
}

EvalResult evaluate(LlamaModel& model, const TokenDataset& data, int64_t seq_len,
                    int64_t micro_batch, int64_t max_batches, StepHooks* hooks) {
  EvalResult r;
  auto shared = std::shared_ptr<const TokenDataset>(&data, [](const TokenDataset*) {});
  LoaderOptions lo;
  lo.seq_len = seq_len;
  lo.micro_batch = micro_batch;
  lo.pack = false;
  DataLoader loader(shared, lo);
  // One pass over the held-out samples (the last batch may repeat a few from the start).
  const int64_t batches = (int64_t(loader.samples_per_epoch()) + micro_batch - 1) / micro_batch;
  double loss_sum = 0;
  StepOptions so;
  so.backward = false;
  so.hooks = hooks;
  for (int64_t i = 0; i < batches && (max_batches <= 0 || i < max_batches); ++i) {
    auto res = model.step(to_token_batch(loader.next()), so);
    loss_sum += res.loss_sum;
    r.tokens += res.tokens;
  }
  r.loss = r.tokens ? loss_sum / double(r.tokens) : 0;
  return r;
}

EvalResult exact_match(LlamaModel& model, const TokenDataset& data, const Tokenizer& tok, int64_t n,
                       int64_t show) {
  EvalResult r;
  int64_t done = 0, hits = 0;
  for (size_t i = 0; i < data.size() && done < n; ++i) {
    auto ids = data.ids(i);
    auto train = data.train(i);
    size_t f = 0;
    while (f < train.size() && !train[f]) ++f;
    if (f == 0 || f == train.size()) continue;
    size_t e = f;
    while (e < train.size() && train[e]) ++e;
    std::vector<int32_t> prompt(ids.begin(), ids.begin() + long(f)),
        want(ids.begin() + long(f), ids.begin() + long(e));
    GenerateOptions go;
    go.max_new_tokens = int64_t(want.size());
    go.stop_ids = {want.back()};
    go.vocab_limit = tok.vocab_size();
    auto got = generate(model, prompt, go);
    bool ok = got == want;
    hits += ok;
    ++done;
    if (int64_t(r.samples.size()) < show)
      r.samples.push_back(fmt::format("{} -> {} ({})", describe(tok, prompt), describe(tok, got),
                                      ok ? "correct" : "expected " + describe(tok, want)));
  }
  r.exact_match = done ? double(hits) / double(done) : -1;
  return r;
}

}  // namespace rig
