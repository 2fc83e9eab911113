#include "rig/train/trainer.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <map>
#include <random>
#include <thread>

#include "rig/core/allocator.h"
#include "rig/data/loader.h"
#include "rig/data/records.h"
#include "rig/dist/communicator.h"
#include "rig/dist/launcher.h"
#include "rig/hw/telemetry.h"
#include "rig/io/atomic_file.h"
#include "rig/io/safetensors.h"
#include "rig/ops/ops.h"
#include "rig/optim/adamw.h"
#include "rig/train/checkpoint.h"
#include "rig/train/guard.h"
#include "rig/train/metrics.h"
#include "rig/train/parallel.h"
#include "rig/train/progress.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string tokenizer_path(const TrainConfig& cfg) {
  std::string p = cfg.tokenizer.empty() ? cfg.model : cfg.tokenizer;
  if (p.empty())
    bad_input("{}: no tokenizer: set 'tokenizer' (a tokenizer.json or a model folder)", cfg.source);
  if (fs::is_directory(p)) p = (fs::path(p) / "tokenizer.json").string();
  if (!fs::exists(p)) bad_input("{}: tokenizer file {} does not exist", cfg.source, p);
  return p;
}

TokenBatch to_token_batch(const Batch& b) {
  return TokenBatch{b.input_ids, b.labels, b.position_ids, b.segment_ids};
}

int64_t real_tokens(const Batch& b) {
  int64_t n = 0;
  const int64_t* s = b.segment_ids.data<int64_t>();
  for (int64_t i = 0; i < b.segment_ids.numel(); ++i) n += s[i] != 0;
  return n;
}

struct Data {
  std::shared_ptr<const TokenDataset> train, eval;
  RenderStats stats;
};

// The vocabulary the model will have, without loading its weights.
int64_t model_vocab_size(const TrainConfig& cfg) {
  json arch = cfg.init == "random" ? cfg.architecture_json() : json();
  if (!arch.is_null()) return ModelConfig::from_json(arch, cfg.source + " architecture").vocab_size;
  if (cfg.model.empty()) return 0;
  return ModelConfig::load(cfg.model).vocab_size;
}

Data load_data(const TrainConfig& cfg, const Tokenizer& tok) {
  if (cfg.datasets.empty()) bad_input("{}: no datasets configured", cfg.source);
  std::vector<Sample> all;
  Data d;
  const int64_t vocab = model_vocab_size(cfg);
  for (const auto& ds : cfg.datasets) {
    RenderOptions ro;
    ro.format = parse_data_format(ds.format.empty() ? "auto" : ds.format);
    ro.chat = parse_chat_template(
        ds.template_name.empty() || ds.template_name == "alpaca" ? "auto" : ds.template_name);
    ro.train_on_all = cfg.train_on_inputs;
    ro.vocab_limit = vocab;
    RenderStats st;
    auto s = load_samples(ds.path, &tok, ro, &st);
    d.stats.records += st.records;
    d.stats.samples += st.samples;
    d.stats.tokens += st.tokens;
    d.stats.trained_tokens += st.trained_tokens;
    all.insert(all.end(), std::make_move_iterator(s.begin()), std::make_move_iterator(s.end()));
  }
  if (all.empty()) bad_input("{}: the datasets hold no samples", cfg.source);
  // Held-out split: a seeded shuffle, the last fraction kept for evaluation.
  std::vector<size_t> idx(all.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
  std::mt19937_64 rng(cfg.seed ^ 0x5eedull);
  std::shuffle(idx.begin(), idx.end(), rng);
  size_t n_eval =
      cfg.eval.split > 0
          ? std::max<size_t>(1, size_t(std::llround(cfg.eval.split * double(all.size()))))
          : 0;
  if (n_eval >= all.size())
    bad_input("{}: eval.split {} leaves no training samples", cfg.source, cfg.eval.split);
  std::vector<Sample> tr, ev;
  for (size_t i = 0; i < idx.size(); ++i)
    (i < idx.size() - n_eval ? tr : ev).push_back(std::move(all[idx[i]]));
  d.train = std::make_shared<const TokenDataset>(TokenDataset::from_samples(tr));
  if (!ev.empty()) d.eval = std::make_shared<const TokenDataset>(TokenDataset::from_samples(ev));
  return d;
}

int64_t planned_steps(const TrainConfig& cfg, const TokenDataset& data, int world) {
  if (cfg.max_steps > 0) return cfg.max_steps;
  double rows = cfg.packing ? std::ceil(double(data.num_tokens()) / double(cfg.sequence_len))
                            : double(data.size());
  double per_step = double(cfg.micro_batch_size * cfg.gradient_accumulation_steps * world);
  return std::max<int64_t>(1, int64_t(std::ceil(cfg.num_epochs * rows / per_step)));
}

// How often a paused run looks at the temperature again (RIG_THERMAL_POLL_MS for tests).
int cfg_pause_poll_ms() {
  const char* v = std::getenv("RIG_THERMAL_POLL_MS");
  return v ? std::max(1, std::atoi(v)) : 1000;
}

uint64_t step_seed(uint64_t seed, int64_t step, int64_t micro) {
  uint64_t x = seed + 0x9E3779B97F4A7C15ull * uint64_t(step * 1024 + micro + 1);
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  return (x ^ (x >> 27)) | 1;  // never 0: 0 means "no dropout"
}

// A config's identity for resuming: where it resumes from does not change what it trains.
std::string resume_hash(TrainConfig c) {
  c.resume = "auto";
  return c.config_hash();
}

// The same identity at any world size and split of the batch: a step trains on the global
// batch (micro batch x accumulation x ranks) whatever the strategy, so a run may resume on other
// ranks with the micro batch or accumulation changed to keep it.
std::string global_batch_hash(TrainConfig c, int world) {
  c.resume = "auto";
  c.micro_batch_size *= c.gradient_accumulation_steps * world;
  c.gradient_accumulation_steps = 1;
  c.strategy = "auto";
  return c.config_hash();
}

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

// rank 0's value of a small count on every rank (a broadcast, so it adds no all-reduce).
int64_t broadcast_from_lead(dist::Communicator& comm, int64_t v) {
  std::vector<float> f(3);
  encode_count(v + 2, f.data());  // -1 and -2 (no checkpoint, all rejected) travel too
  Tensor t = Tensor::from_f32(f, {3});
  if (comm.device().is_cpu()) {
    comm.broadcast(t, 0);
  } else {
    Tensor d = t.to(comm.device(), "broadcast");
    comm.broadcast(d, 0);
    t = d.to(Device::cpu(), "broadcast");
  }
  return decode_count(t.f32()) - 2;
}

// The loss-spike fault's factor on one step's loss and gradients.
constexpr float kLossSpikeFactor = 1000.0f;

// The kill faults: what a power cut or the OOM killer does, with the metrics already flushed.
[[noreturn]] void kill_self() {
  std::fflush(nullptr);
  std::raise(SIGKILL);
  std::abort();  // not reached
}

// The weight a bit-flip fault hits: the first trainable matrix of a layer (every token reads it),
// else the first trainable tensor.
Tensor flip_target(std::vector<Param>& params) {
  for (auto& p : params)
    if (p.trainable && p.value.ndim() == 2 && p.name.find("layers.") != std::string::npos)
      return p.value;
  for (auto& p : params)
    if (p.trainable && p.name.rfind("layer.", 0) == 0) return p.value;  // a sharded unit
  for (auto& p : params)
    if (p.trainable) return p.value;
  fail("bit-flip: no trainable parameter to flip");
}

// What bit-flip-frozen hits: the first frozen matrix of a layer (a LoRA base weight), or this
// rank's shard of the first frozen layer unit.
Tensor frozen_flip_target(LlamaModel& model, const Sharded* shard) {
  if (shard) {
    // A layer's 4-bit unit when there is one (QLoRA: the bulk of the frozen bytes), else its
    // frozen float unit.
    auto shards = shard->frozen_shards();
    for (const char* kind : {".frozen_4bit", ".frozen"}) {
      size_t k = 0;
      for (const auto& u : shard->units()) {
        if (u.trainable) continue;
        if (u.name.rfind("layer.", 0) == 0 && u.name.ends_with(kind)) return shards[k];
        ++k;
      }
    }
  } else {
    for (auto& p : model.params()) {
      if (p.trainable || p.name.find("layers.") == std::string::npos) continue;
      if (p.quant) return p.quant->packed;  // QLoRA: the packed 4-bit codes
      if (p.value.ndim() == 2) return p.value;
    }
  }
  bad_input("bit-flip-frozen: the model has no frozen layer weights (use method: lora)");
}

// Sums a few floats over the ranks (on the communicator's device).
void sum_over_ranks(dist::Communicator& comm, std::vector<float>& v) {
  Tensor t = Tensor::from_f32(v, {int64_t(v.size())});
  if (comm.device().is_cpu()) {
    comm.all_reduce(t, dist::ReduceOp::Sum);
  } else {
    Tensor d = t.to(comm.device(), "counts");
    comm.all_reduce(d, dist::ReduceOp::Sum);
    t = d.to(Device::cpu(), "counts");
  }
  std::copy(t.f32(), t.f32() + v.size(), v.begin());
}

}  // namespace

std::unique_ptr<LlamaModel> build_model(const TrainConfig& cfg) {
  std::unique_ptr<LlamaModel> m;
  const bool qlora = cfg.method == "qlora";
  if (cfg.init == "random") {
    json arch = cfg.architecture_json();
    LoadOptions lo;
    lo.quantize = qlora;  // NF4, blocks of 64, double quantization, one weight at a time
    if (arch.is_null()) {
      if (cfg.model.empty())
        bad_input("{}: init: random needs 'architecture' or a model folder with config.json",
                  cfg.source);
      m = LlamaModel::random(ModelConfig::load(cfg.model), cfg.seed, lo);
    } else {
      m = LlamaModel::random(ModelConfig::from_json(arch, cfg.source + " architecture"), cfg.seed,
                             lo);
    }
  } else {
    if (cfg.model.empty()) bad_input("{}: set 'model' to a Hugging Face model folder", cfg.source);
    // QLoRA: a bitsandbytes 4-bit folder loads as it is; a bf16/fp32 one is quantized to NF4
    // (blocks of 64, double quantization) one tensor at a time while it loads.
    LoadOptions lo;
    lo.quantize = qlora;
    m = LlamaModel::load(cfg.model, lo);
    if (!qlora && m->is_quantized())
      bad_input(
          "{}: {} holds bitsandbytes 4-bit weights, which only LoRA adapters can train on; "
          "set method: qlora",
          cfg.source, cfg.model);
  }
  if (cfg.method == "lora" || qlora) {
    LoraConfig lc;
    lc.r = int(cfg.lora.r);
    lc.alpha = float(cfg.lora.alpha);
    lc.dropout = float(cfg.lora.dropout);
    lc.rslora = cfg.lora.rslora;
    lc.targets = cfg.lora.targets;
    m->add_lora(lc, cfg.seed + 1);
  }
  return m;
}

std::vector<int32_t> generate(LlamaModel& model, const std::vector<int32_t>& prompt,
                              const GenerateOptions& opt) {
  RIG_CHECK(!prompt.empty(), "generate needs a non-empty prompt");
  auto cache = model.new_cache(int64_t(prompt.size()) + opt.max_new_tokens + 1);
  std::vector<float> logits =
      model.decode(cache, std::vector<int64_t>(prompt.begin(), prompt.end()));
  const size_t limit =
      opt.vocab_limit > 0 ? std::min(logits.size(), size_t(opt.vocab_limit)) : logits.size();
  std::mt19937_64 rng(opt.seed);
  std::vector<int32_t> out;
  for (int64_t t = 0; t < opt.max_new_tokens; ++t) {
    logits.resize(limit);
    int32_t next = 0;
    if (opt.temperature <= 0) {
      next = int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    } else {
      // Softmax with temperature, then nucleus (top-p) sampling.
      std::vector<std::pair<float, int32_t>> p;
      float mx = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (size_t i = 0; i < logits.size(); ++i) {
        float e = std::exp((logits[i] - mx) / opt.temperature);
        p.emplace_back(e, int32_t(i));
        sum += e;
      }
      std::sort(p.begin(), p.end(), std::greater<>());
      double keep = 0;
      size_t k = 0;
      while (k < p.size() && keep < opt.top_p * sum) keep += p[k++].first;
      std::uniform_real_distribution<double> u(0, keep);
      double r = u(rng), acc = 0;
      next = p[k - 1].second;
      for (size_t i = 0; i < k; ++i)
        if ((acc += p[i].first) >= r) {
          next = p[i].second;
          break;
        }
    }
    out.push_back(next);
    if (std::find(opt.stop_ids.begin(), opt.stop_ids.end(), next) != opt.stop_ids.end()) break;
    logits = model.decode(cache, {next});
  }
  return out;
}

EvalResult evaluate(LlamaModel& model, const TokenDataset& data, int64_t seq_len,
                    int64_t micro_batch, int64_t max_batches) {
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

TrainResult train(const TrainConfig& cfg_in, const TrainHooks& hooks) {
  TrainConfig cfg = cfg_in;
  cfg.validate();
  Device dev = cfg.device == "auto" ? (cuda_available() ? Device::cuda(0) : Device::cpu())
                                    : Device::parse(cfg.device);
  if (dev.is_cuda() && !cuda_available())
    bad_input("{}: device '{}' requested, but {}", cfg.source, cfg.device,
#ifdef RIG_WITH_CUDA
              "no CUDA GPU is visible");
#else
              "this rig was built without CUDA");
#endif
  const std::string precision = cfg.resolved_precision(dev.is_cuda());
  if (precision == "bf16" && !dev.is_cuda())
    bad_input("{}: 'precision: bf16' needs a CUDA device; the CPU backend computes in fp32",
              cfg.source);

  // The ranks: handed in (tests), or this process is one worker of a launched run.
  std::unique_ptr<dist::Group> group;
  dist::Communicator* comm = hooks.comm;
  if (!comm) {
    const dist::DistEnv env = dist::env_from_process();
    // A launched world of one (--nproc-per-node 1) still goes through the communicator, so the
    // distributed path can be run on a single GPU.
    if (env.world > 1 || dist::launched_worker()) {
      if (dev.is_cuda() && (cfg.device == "auto" || cfg.device == "cuda"))
        dev = Device::cuda(env.local_rank);
      dist::CommOptions co;
      co.timeout = dist::Millis(int64_t(cfg.dist.timeout_s * 1000));
      group = dist::init_group(env, dev.is_cuda() ? dist::Backend::Nccl : dist::Backend::Gloo, co);
      comm = group->comm.get();
    }
  }
  const int rank = comm ? comm->rank() : 0, world = comm ? comm->world() : 1;
  const bool lead = rank == 0;
  const bool sharding = comm && cfg.strategy == "sharded";
  const std::string strategy_name = !comm ? "single" : sharding ? "sharded" : "ddp";
  // Shards are float32 flat buffers; bf16 compute copies of gathered layers are not made yet.
  if (sharding && precision == "bf16")
    bad_input(
        "{}: strategy: sharded trains in float32 for now; set precision: fp32 (or use strategy: "
        "ddp)",
        cfg.source);

  Allocator& alloc = allocator_for(dev);
  if (cfg.max_memory) alloc.set_budget(alloc.in_use() + cfg.max_memory);
  const std::string run = cfg.output_dir;
  fs::create_directories(run);

  // The faults to inject (every rank holds all of them, so the lead logs those aimed at others).
  Injector injector(cfg.inject, world, cfg.source + ": inject");

  // Which checkpoint to resume or roll back to: the newest that passes verification (manifest,
  // checksums, NaN/Inf). Rank 0 verifies, sets rejected ones aside, and tells the others which.
  // The answer is a folder, or nothing: kNoCheckpoint (the run has none) or kAllRejected.
  std::vector<RejectedCheckpoint> rejected;  // reported once the metrics file is open
  constexpr int64_t kNoCheckpoint = -1, kAllRejected = -2;
  int64_t choice = kNoCheckpoint;
  auto choose_checkpoint = [&]() -> std::optional<std::string> {
    choice = kNoCheckpoint;
    if (lead) {
      CheckpointChoice c = newest_usable_checkpoint(run, cfg.guard.verify_checkpoints);
      for (auto& r : c.rejected) {
        r.dir = set_aside_checkpoint(r.dir);
        rejected.push_back(std::move(r));
      }
      if (c.chosen)
        choice = c.chosen->step;
      else if (!c.rejected.empty())
        choice = kAllRejected;
    }
    if (comm) choice = broadcast_from_lead(*comm, choice);
    if (choice < 0) return std::nullopt;
    return (fs::path(run) / "checkpoints" / fmt::format("step-{}", choice)).string();
  };

  std::optional<LoadedCheckpoint> ckpt;
  if (cfg.resume == "never") {
    if (!list_checkpoints(run).empty())
      bad_input(
          "{}: {} already holds checkpoints; use resume: auto to continue it or another output_dir",
          cfg.source, run);
  } else if (cfg.resume != "auto") {
    // A checkpoint named by path: used only if it passes, with no fallback.
    int64_t ok = 1;
    std::string why;
    if (lead && cfg.guard.verify_checkpoints) {
      VerifyReport r = verify_checkpoint(cfg.resume, verify_for_use());
      ok = r.ok();
      why = r.to_text();
    }
    if (comm) ok = broadcast_from_lead(*comm, ok);
    if (!ok)
      bad_input("{}: the checkpoint {} does not pass verification{}", cfg.source, cfg.resume,
                lead ? ":\n" + why : " (rank 0 says why)");
    ckpt = load_checkpoint(cfg.resume);
  } else if (auto dir = choose_checkpoint()) {
    ckpt = load_checkpoint(*dir);
  } else if (choice == kAllRejected) {
    bad_input(
        "{}: every checkpoint of {} fails verification (they are set aside as "
        "checkpoints/rejected-step-N; rig ckpt verify says why{}); starting over would discard "
        "the run, so rig stops here",
        cfg.source, run,
        rejected.empty() ? std::string() : ": " + rejected.front().problems.front());
  }
  if (ckpt && ckpt->state.value("config_hash", "") != resume_hash(cfg) &&
      ckpt->state.value("batch_hash", "") != global_batch_hash(cfg, world)) {
    // Resuming on another number of ranks without adapting the batch is the likely mistake.
    const int64_t here = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world;
    const int64_t there = ckpt->state.value("global_batch", int64_t(0));
    if (there > 0 && there != here)
      bad_input(
          "{}: {} was written with a global batch of {} rows on {} rank(s), but here it is {} "
          "(micro_batch_size {} x gradient_accumulation_steps {} x {} rank(s)); change "
          "micro_batch_size or gradient_accumulation_steps so they match",
          cfg.source, ckpt->dir, there, ckpt->state.value("world", 1), here, cfg.micro_batch_size,
          cfg.gradient_accumulation_steps, world);
    bad_input(
        "{}: the configuration differs from the one that wrote {}; resume with the run's own "
        "config.yaml or start a new output_dir",
        cfg.source, ckpt->dir);
  }
  Tokenizer tok = Tokenizer::load(tokenizer_path(cfg));
  Data data = load_data(cfg, tok);
  // Written once the data has loaded: bad data stops the run before it leaves anything behind.
  if (lead) save_run_config(cfg, run);
  auto model = build_model(cfg);
  // Frozen matrices turn bf16 on the host, so the device never holds their float32 copies.
  model->set_compute_dtype(precision == "bf16" ? DType::BF16 : DType::F32);
  ops::set_deterministic(cfg.deterministic);
  model->to_device(dev);
  if (tok.vocab_size() > model->config().vocab_size)
    bad_input("{}: the tokenizer has {} tokens but the model's vocabulary is {}", cfg.source,
              tok.vocab_size(), model->config().vocab_size);
  const int64_t n_params = model->num_parameters(false), n_trainable = model->num_parameters(true);

  OptimizerConfig oc;
  oc.lr = float(cfg.optimizer.lr);
  oc.beta1 = float(cfg.optimizer.beta1);
  oc.beta2 = float(cfg.optimizer.beta2);
  oc.eps = float(cfg.optimizer.eps);
  oc.weight_decay = float(cfg.optimizer.weight_decay);
  // Sharded: the norm spans every rank's shards, so the strategy clips.
  oc.max_grad_norm = sharding ? 0.0f : float(cfg.max_grad_norm);
  oc.no_decay_on_norms_and_biases = cfg.optimizer.no_decay_on_norms_and_biases;
  oc.eight_bit = cfg.optimizer.name == "adamw8bit";
  oc.min_8bit_size = cfg.optimizer.min_8bit_size;
  AdamW opt(oc);

  LoaderOptions lo;
  lo.seq_len = cfg.sequence_len;
  lo.micro_batch = cfg.micro_batch_size;
  lo.pack = cfg.packing;
  lo.seed = cfg.seed;
  lo.rank = rank;
  lo.world = world;
  DataLoader loader(data.train, lo);
  const int64_t total = planned_steps(cfg, *data.train, world);
  const int64_t accum = cfg.gradient_accumulation_steps;
  int64_t step = 0;
  std::unique_ptr<Sharded> shard;
  std::unique_ptr<DataParallel> ddp;
  if (sharding) shard = std::make_unique<Sharded>(*comm, *model, &opt);
  if (comm && !sharding)
    ddp = std::make_unique<DataParallel>(*comm, *model, size_t(cfg.dist.bucket_mb * (1 << 20)),
                                         int(cfg.dist.powersgd_rank), cfg.seed);
  StepHooks* step_hooks = shard ? static_cast<StepHooks*>(shard.get()) : ddp.get();
  std::vector<Param>& opt_params = shard ? shard->params() : model->params();

  // The guard's state: the spike rule's history, and counts that checkpoints carry.
  SpikeDetector spikes(SpikeRule{cfg.guard.spike_window, cfg.guard.spike_warmup, cfg.guard.spike_k,
                                 cfg.guard.spike_loss_ratio, cfg.guard.spike_grad_ratio});
  int64_t skipped_total = 0, rollbacks = 0, skips_in_row = 0;
  int64_t batches_drawn = 0;  // global batches taken from the data so far, skipped ones included

  // Everything a checkpoint holds back into the model, optimizer, data position and guard.
  auto restore = [&](const LoadedCheckpoint& ck) {
    const json* layout = ck.state.contains("sharded") ? &ck.state["sharded"] : nullptr;
    if (layout) check_layout(*layout, shard ? shard->units() : flat_units(*model), ck.dir);
    const int64_t opt_step = ck.state.at("optimizer_step").get<int64_t>();
    std::map<std::string, Tensor> state;
    if (layout && !sharding) {
      // A sharded checkpoint resumed whole: the flat shards back into named tensors.
      state = read_sharded_as_named(ck.dir, *layout);
    } else {
      for (auto& [name, t] : ck.tensors) state[name] = t;
    }
    if (shard) {
      shard->load(layout ? sharded_checkpoint_reader(ck.dir, *layout) : named_tensor_reader(state),
                  opt, opt_step, dev);
    } else {
      std::map<std::string, Tensor> opt_state;
      for (auto& p : model->params()) {
        if (!p.trainable) continue;
        auto it = state.find("param." + p.name);
        if (it == state.end()) bad_input("{}: checkpoint has no tensor 'param.{}'", ck.dir, p.name);
        p.value.copy_from(it->second.reshape(p.value.shape()));
        for (const char* k : {"adamw.m.", "adamw.v."})
          if (auto m = state.find(k + p.name); m != state.end())
            opt_state[m->first] = m->second.reshape(p.value.shape());
        for (const char* k :
             {"adamw8bit.mq.", "adamw8bit.mabs.", "adamw8bit.vq.", "adamw8bit.vabs."})
          if (auto m = state.find(k + p.name); m != state.end()) opt_state[m->first] = m->second;
      }
      model->refresh_compute_weights();
      opt.load_state(opt_state, opt_step, dev);
    }
    std::vector<LoaderState> saved;
    if (ck.state.contains("loader_ranks"))
      for (const auto& j : ck.state["loader_ranks"]) saved.push_back(LoaderState::from_json(j));
    else
      saved.push_back(LoaderState::from_json(ck.state.at("loader")));
    loader.restore(resplit_loader_state(saved, rank, world, ck.dir));
    step = ck.state.at("step").get<int64_t>();
    const json g = ck.state.value("guard", json::object());
    spikes.from_json(g.value("history", json()));
    skipped_total = std::max(skipped_total, g.value("skipped_steps", int64_t(0)));
    rollbacks = std::max(rollbacks, g.value("rollbacks", int64_t(0)));
    batches_drawn = g.value("batches", step);
  };
  if (ckpt) restore(*ckpt);

  // What the guard hashes and scans: every parameter a rank holds (frozen ones too: a flipped
  // bit in a frozen base weight makes a replica's gradients differ).
  // A parameter's stored bytes: its value, or for a 4-bit weight (QLoRA's base, whose value is
  // not kept) the packed codes and scales.
  auto add_weight = [](const Param& p, std::vector<Tensor>& w) {
    if (!p.quant) {
      w.push_back(p.value);
      return;
    }
    w.push_back(p.quant->packed);
    w.push_back(p.quant->absmax);
    if (p.quant->nested_absmax.defined()) w.push_back(p.quant->nested_absmax);
  };
  auto weights = [&] {
    std::vector<Tensor> w;
    if (shard) {
      for (const auto& p : shard->params()) w.push_back(p.value);
      for (const auto& t : shard->frozen_shards()) w.push_back(t);
    } else {
      for (const auto& p : model->params()) add_weight(p, w);
    }
    return w;
  };
  auto trainable_weights = [&] {
    std::vector<Tensor> w;
    for (const auto& p : opt_params)
      if (p.trainable) w.push_back(p.value);
    return w;
  };
  auto grads = [&] {
    std::vector<Tensor> g;
    for (const auto& p : opt_params)
      if (p.trainable && p.grad.defined()) g.push_back(p.grad);
    return g;
  };
  // Nothing writes frozen weights (LoRA's base) after start, so their hash must never move; a
  // checkpoint does not hold them, so a rollback after they changed reloads them.
  auto frozen_weights = [&] {
    if (shard) return shard->frozen_shards();
    std::vector<Tensor> w;
    for (const auto& p : model->params())
      if (!p.trainable) add_weight(p, w);
    return w;
  };
  const uint64_t frozen_ref = ops::hash64(frozen_weights());
  auto reload_frozen = [&] {
    auto fresh = build_model(cfg);
    fresh->set_compute_dtype(model->compute_dtype());
    if (shard) {
      Sharded slices(*comm, *fresh);  // this rank's slices of the fresh weights (no communication)
      auto mine = shard->frozen_shards(), theirs = slices.frozen_shards();
      for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_from(theirs[i]);
    } else {
      auto& ps = model->params();
      for (size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].trainable) continue;
        if (ps[i].quant) {
          // 4-bit weights: the bytes a flip could hit are the packed codes and the scales.
          const auto& q = *fresh->params()[i].quant;
          ps[i].quant->packed.copy_from(q.packed);
          ps[i].quant->absmax.copy_from(q.absmax);
          if (q.nested_absmax.defined()) ps[i].quant->nested_absmax.copy_from(q.nested_absmax);
        } else {
          ps[i].value.copy_from(fresh->params()[i].value);
        }
      }
    }
    if (ops::hash64(frozen_weights()) != frozen_ref)
      fail(
          "the frozen weights reloaded from {} differ from those the run started with (the model "
          "files changed on disk?)",
          cfg.model.empty() ? std::string("the seed") : cfg.model);
  };

  // Only rank 0 writes the run folder and shows progress.
  std::unique_ptr<MetricsWriter> metrics;
  if (lead) metrics = std::make_unique<MetricsWriter>(run, ckpt ? step : -1);
  auto note = [&](const std::string& s) {
    if (metrics) metrics->note(s);
  };
  note(fmt::format("device {}, {} compute", dev.str(), precision));
  if (comm)
    note(fmt::format("{} ranks, {}: global batch {} x {} x {} rows", world, strategy_name,
                     cfg.micro_batch_size, cfg.gradient_accumulation_steps, world));
  note(
      fmt::format("{} {} steps {} of {}: {} parameters ({} trainable), {} training samples "
                  "({} tokens), {} held out",
                  ckpt ? "resuming" : "starting", cfg.method, step, total, n_params, n_trainable,
                  data.train->size(), data.train->num_tokens(), data.eval ? data.eval->size() : 0));
  std::unique_ptr<Progress> progress;
  if (!hooks.quiet && lead) progress = std::make_unique<Progress>(total, step);
  auto say = [&](const std::string& s) {
    note(s);
    if (progress) progress->message(s);
  };
  // An event line in metrics.jsonl, the same in words in train.log and on the console.
  auto event = [&](const std::string& name, int64_t s, const json& fields,
                   const std::string& text) {
    if (metrics) metrics->event(name, s, fields, text);
    if (progress) progress->message(text);
  };
  auto report_rejected = [&] {
    for (const auto& r : rejected)
      event("checkpoint_rejected", r.step, {{"moved_to", r.dir}, {"problems", r.problems}},
            fmt::format("checkpoint step-{} fails verification ({}); set aside as {}", r.step,
                        r.problems.front(), r.dir));
    rejected.clear();
  };
  auto log_fault = [&](const Injection& i, int64_t s) {
    event("inject", s, {{"kind", fault_name(i.kind)}, {"rank", i.rank}, {"spec", i.spec}},
          fmt::format("injecting fault {} (rank {}) at step {}", fault_name(i.kind), i.rank, s));
  };
  report_rejected();
  const bool resumed = ckpt.has_value();
  if (ckpt) {
    event("resumed", step, {{"from", ckpt->dir}},
          fmt::format("resumed from {} at step {}", ckpt->dir, step));
    ckpt.reset();  // drops the mapping of its files
  }

  const Checkpointing ck = cfg.activation_checkpointing == "none"        ? Checkpointing::None
                           : cfg.activation_checkpointing == "selective" ? Checkpointing::Selective
                                                                         : Checkpointing::Full;
  auto save = [&](int64_t s) {
    // Faults that wait for the next checkpoint.
    std::optional<Injection> kill_save = injector.take(FaultKind::KillDuringSave, s, true);
    std::optional<Injection> corrupt = injector.take(FaultKind::CorruptCheckpoint, s, true);
    if (kill_save) log_fault(*kill_save, s);
    std::function<void()> die;
    if (kill_save && kill_save->rank == rank) die = [] { kill_self(); };
    json st = {{"step", s},
               {"optimizer_step", opt.steps()},
               {"loader", loader.state().to_json()},
               {"config_hash", resume_hash(cfg)},
               {"batch_hash", global_batch_hash(cfg, world)},
               {"seed", cfg.seed},
               {"lr", cfg.schedule.lr_at(std::max<int64_t>(0, s - 1), total, cfg.optimizer.lr)}};
    st["guard"] = {{"history", spikes.to_json()},
                   {"skipped_steps", skipped_total},
                   {"rollbacks", rollbacks},
                   {"batches", batches_drawn}};
    // Every rank's data position (they differ with packing), so any world size can resume.
    json ranks = json::array();
    for (const auto& ls : gather_loader_states(comm, loader.state())) ranks.push_back(ls.to_json());
    st["loader_ranks"] = ranks;
    st["world"] = world;
    st["global_batch"] = cfg.micro_batch_size * cfg.gradient_accumulation_steps * world;
    st["strategy"] = strategy_name;
    std::string dir;
    if (shard) {
      // Every rank writes its own shards; rank 0 then moves them into the checkpoint atomically.
      fs::path staging = fs::path(run) / "checkpoints" / fmt::format(".step-{}.shards", s);
      if (lead) {
        fs::remove_all(staging);
        fs::create_directories(staging);
      }
      comm->barrier();
      save_safetensors((staging / shard_file_name(rank, world)).string(), shard->shard_tensors(opt),
                       {{"format", kCheckpointFormat}, {"step", std::to_string(s)}});
      if (die && !lead) die();
      comm->barrier();
      if (lead) {
        std::vector<std::string> files;
        for (int r = 0; r < world; ++r)
          files.push_back((staging / shard_file_name(r, world)).string());
        st["sharded"] = shard->layout();
        dir = save_checkpoint(run, s, {}, st, cfg.save.keep_last, files, die);
      }
      comm->barrier();  // nobody stages the next checkpoint while rank 0 tidies up
    } else if (lead) {
      std::vector<std::pair<std::string, Tensor>> ts;
      for (auto& p : model->params())
        if (p.trainable)
          ts.emplace_back("param." + p.name, p.value.to(Device::cpu(), "checkpoint"));
      for (auto& [name, t] : opt.state_tensors())
        ts.emplace_back(name, t.to(Device::cpu(), "checkpoint"));
      dir = save_checkpoint(run, s, ts, st, cfg.save.keep_last, {}, die);
    } else if (die) {
      die();  // a replica that does not write dies while rank 0 writes
    }
    if (lead) say(fmt::format("saved checkpoint {}", dir));
    if (corrupt) {
      log_fault(*corrupt, s);
      if (lead) note(fmt::format("corrupted {}", corrupt_checkpoint_file(dir)));
    }
  };
  TrainResult result;
  // Held-out loss, and when asked, exact match of greedily generated responses. Every rank
  // evaluates (sharded: on the gathered model); rank 0 reports.
  auto run_eval = [&](int64_t s, bool final_eval) {
    if (!data.eval) return;
    const bool gather = shard && !shard->gathered();
    if (gather) shard->gather_all();
    auto e = evaluate(*model, *data.eval, cfg.sequence_len, cfg.micro_batch_size, cfg.eval.batches);
    json extra = {{"eval_perplexity", std::exp(e.loss)}};
    std::string line = fmt::format("step {}: eval loss {:.4f} (perplexity {:.2f}) over {} tokens",
                                   s, e.loss, std::exp(e.loss), e.tokens);
    if (cfg.eval.generate > 0) {
      auto em = exact_match(*model, *data.eval, tok, cfg.eval.generate, final_eval ? 5 : 0);
      extra["eval_exact_match"] = em.exact_match;
      line += fmt::format(", exact match {:.1f}%", 100 * em.exact_match);
      if (final_eval) {
        result.exact_match = em.exact_match;
        result.samples = em.samples;
      }
    }
    if (gather) shard->release_all();
    if (metrics) metrics->log_eval(s, e.loss, extra);
    say(line);
    result.eval_loss = e.loss;
  };

  // GPU telemetry in every metrics line, and the thermal pause, wherever NVML answers.
  std::optional<hw::Telemetry> telemetry;
  try {
    telemetry.emplace(hw::Telemetry::open());
  } catch (const Error& e) {
    note(fmt::format("no GPU telemetry: {}", e.what()));
  }
  std::optional<hw::ThermalPause> thermal;
  if (telemetry && cfg.thermal.pause_above_c > 0)
    thermal.emplace(cfg.thermal.pause_above_c, cfg.thermal.resume_below_c > 0
                                                   ? cfg.thermal.resume_below_c
                                                   : cfg.thermal.pause_above_c - 8);
  int throttled_steps = 0;
  auto watch_gpus = [&](StepMetrics& m) {
    if (!telemetry) return;
    hw::StepSummary g = hw::Telemetry::summarize(telemetry->sample());
    m.extra["gpu"] = g.to_json();
    // Sustained thermal throttling: say so once per streak.
    throttled_steps = g.thermal_throttle ? throttled_steps + 1 : 0;
    if (throttled_steps == 10)
      say(
          fmt::format("warning: GPU {} has been thermally throttled for 10 steps ({:.0f} C); check "
                      "cooling and fan curves",
                      g.hottest_gpu, g.max_temp_c.value_or(0)));
    if (!thermal || !thermal->update(g)) return;
    say(fmt::format("pausing: GPU {} at {:.0f} C is above {:.0f} C; resuming below {:.0f} C",
                    g.hottest_gpu, g.max_temp_c.value_or(0), thermal->pause_at(),
                    thermal->resume_below()));
    while (thermal->update(g) && !(hooks.should_stop && hooks.should_stop())) {
      std::this_thread::sleep_for(std::chrono::milliseconds(cfg_pause_poll_ms()));
      g = hw::Telemetry::summarize(telemetry->sample());
    }
    say(fmt::format("resuming at {:.0f} C", g.max_temp_c.value_or(0)));
  };

  // ---- the guard's decisions (docs/reliability.md); every rank reaches the same one ----------

  auto last_checkpoint_words = [&] {
    auto l = latest_checkpoint(run);
    return l ? fmt::format(
                   "the last checkpoint ({}) is intact; continue with rig train --resume {}",
                   l->dir, run)
             : std::string("there is no checkpoint yet");
  };
  // The check of the weights at rest (not sharded; every replica_check_every steps and before
  // every checkpoint): data-parallel replicas compare parameter hashes (one all-gather), and
  // every rank scans its weights for implausible values and its frozen weights for any change.
  auto check_at_rest = [&]() -> std::optional<HealthVerdict> {
    RankHealth mine;
    if (ddp) mine.hash = ops::hash64(weights());
    mine.implausible = ops::count_bad_values(weights(), kImplausibleWeight);
    mine.changed = ops::hash64(frozen_weights()) != frozen_ref;
    HealthVerdict v = judge_health(gather_health(comm, mine), ddp != nullptr, "frozen");
    if (v.ok) return std::nullopt;
    return v;
  };
  // After a NaN/Inf or a spike: is the model itself damaged (a replica that differs, a weight
  // that no training produces), or was it the batch?
  auto diagnose = [&]() -> std::optional<HealthVerdict> {
    RankHealth mine;
    if (ddp) mine.hash = ops::hash64(weights());
    mine.implausible = ops::count_bad_values(weights(), kImplausibleWeight);
    mine.changed = ops::hash64(frozen_weights()) != frozen_ref;
    HealthVerdict v = judge_health(gather_health(comm, mine), ddp != nullptr, "frozen");
    if (v.ok) return std::nullopt;
    return v;
  };
  // found_by: what made the guard look ("check at rest", "shard check", "NaN/Inf", "spike").
  auto report_verdict = [&](const HealthVerdict& v, int64_t s, const std::string& found_by) {
    json fields = {{"ranks", v.ranks}, {"detail", v.detail}, {"found_by", found_by}};
    if (!v.hashes.empty()) {
      json h = json::array();
      for (uint64_t x : v.hashes) h.push_back(fmt::format("{:016x}", x));
      fields["hashes"] = h;
    }
    event(v.rule == "replica"   ? "replica_mismatch"
          : v.rule == "weights" ? "bad_weights"
                                : v.rule + "_mismatch",
          s, fields, fmt::format("step {}: {}", s, v.detail));
  };
  // Back to the newest verified checkpoint: weights, optimizer, data position, guard history.
  // skip_window: the data is suspect, so the batches drawn since that checkpoint are skipped.
  // Returns false when there is no checkpoint to go back to.
  auto rollback = [&](int64_t at, const std::string& rule, json details, bool skip_window) {
    if (rollbacks >= cfg.guard.max_rollbacks)
      fail(
          "step {}: the guard wants to roll back ({}), but the run has rolled back {} time(s), "
          "as many as guard.max_rollbacks allows; stopping for a human to look (metrics.jsonl "
          "lists every event); {}",
          at, rule, rollbacks, last_checkpoint_words());
    const LoaderState after = loader.state();
    const int64_t drawn = batches_drawn;
    auto dir = choose_checkpoint();
    report_rejected();
    if (!dir) return false;
    LoadedCheckpoint back = load_checkpoint(*dir);
    restore(back);
    const bool reload = ops::hash64(frozen_weights()) != frozen_ref;
    if (reload) reload_frozen();
    ++rollbacks;
    if (ddp) ddp->reset_compression();
    int64_t skipped = 0;
    if (skip_window) {
      loader.restore(after);
      skipped = drawn - batches_drawn;
      batches_drawn = drawn;
    }
    skips_in_row = 0;
    if (metrics) metrics->rewind(step);
    details["to_step"] = step;
    details["rule"] = rule;
    details["skipped_batches"] = skipped;
    details["rollbacks"] = rollbacks;
    if (reload) details["reloaded_frozen_weights"] = true;
    event("rollback", at, details,
          fmt::format("step {}: rolled back to step {} ({}){}; rollback {} of at most {}", at, step,
                      rule,
                      skip_window ? fmt::format(", skipping the {} batch(es) drawn since", skipped)
                                  : std::string(", replaying the same batches"),
                      rollbacks, cfg.guard.max_rollbacks));
    return true;
  };
  auto check_due = [&](int64_t s) {
    const int64_t n = cfg.guard.replica_check_every;
    return n > 0 && (s % n == 0 || (cfg.save.every > 0 && s % cfg.save.every == 0) || s == total);
  };

  // Stopping on a signal: a checkpoint only from weights that pass the check at rest (every rank
  // takes part: they agreed to stop at this step).
  auto save_if_healthy = [&] {
    if (!shard && cfg.guard.replica_check_every > 0)
      if (auto bad = check_at_rest()) {
        report_verdict(*bad, step, "check at rest");
        say(fmt::format("not saving a checkpoint from these weights; {}", last_checkpoint_words()));
        return;
      }
    save(step);
  };

  alloc.reset_peak();
  if (!resumed && cfg.eval.every > 0) run_eval(0, false);  // the starting point of the curve
  while (step < total) {
    bool stop = hooks.should_stop && hooks.should_stop();
    if (stop && !comm) {
      save_if_healthy();
      result.interrupted = true;
      break;
    }
    const double t0 = now_s();
    const float lr = float(cfg.schedule.lr_at(step, total, cfg.optimizer.lr));
    const LoaderState at = loader.state();
    const int64_t next = step + 1;  // the step this attempt computes
    if (hooks.discard_batches) {
      const int64_t n = hooks.discard_batches(next);
      for (int64_t k = 0; k < n * accum; ++k) loader.next();
      batches_drawn += n;
    }
    auto fault = [&](FaultKind k) {
      std::optional<Injection> i = injector.take(k, next);
      if (i) log_fault(*i, next);
      return i && i->rank == rank;
    };
    // Sharded: the shards at the start of a checked step, compared again before the update.
    const bool shard_check = shard && check_due(next);
    const uint64_t shard_ref = shard_check ? ops::hash64(trainable_weights()) : 0;
    if (fault(FaultKind::BitFlip)) {
      Tensor target = flip_target(opt_params);
      auto [was, is] = flip_high_exponent_bit(target);
      if (!shard) model->refresh_compute_weights();
      note(fmt::format("rank {}: flipped a weight from {:g} to {:g}", rank, was, is));
    }
    if (fault(FaultKind::BitFlipFrozen)) {
      Tensor target = frozen_flip_target(*model, shard.get());
      auto [was, is] = flip_high_exponent_bit(target);
      note(fmt::format(
          "rank {}: flipped {} from {:g} to {:g}", rank,
          target.dtype() == DType::U8 ? "a byte of frozen 4-bit weights" : "a frozen weight", was,
          is));
    }
    const bool spike_fault = fault(FaultKind::LossSpike), nan_fault = fault(FaultKind::NanGrad),
               kill_fault = fault(FaultKind::Kill);
    std::vector<Batch> micro;
    int64_t trained = 0, tokens = 0;
    for (int64_t k = 0; k < accum; ++k) {
      micro.push_back(loader.next());
      trained += micro.back().trained_tokens;
      tokens += real_tokens(micro.back());
    }
    ++batches_drawn;
    if (comm) {
      // The whole global batch's trained tokens scale every rank's gradients; a stop request on
      // any rank stops all of them at the same step.
      std::vector<float> v(7);
      v[0] = stop ? 1.0f : 0.0f;
      encode_count(trained, &v[1]);
      encode_count(tokens, &v[4]);
      sum_over_ranks(*comm, v);
      trained = decode_count(&v[1]);
      tokens = decode_count(&v[4]);
      if (v[0] > 0) {
        loader.restore(at);
        --batches_drawn;
        save_if_healthy();
        result.interrupted = true;
        break;
      }
    }
    if (shard)
      shard->zero_grad();
    else
      model->zero_grad();
    // loss-spike: this rank's loss and gradients multiplied, before they are summed over ranks.
    const float fault_scale = spike_fault ? kLossSpikeFactor : 1.0f;
    double loss_sum = 0;
    int64_t loss_tokens = 0;
    for (size_t k = 0; k < micro.size(); ++k) {
      StepOptions so;
      // The mean over every trained token of the accumulated (global) batch, as one big batch
      // would give.
      so.grad_scale = (trained ? 1.0f / float(trained) : 0.0f) * fault_scale;
      so.checkpointing = ck;
      so.recompute_layers = cfg.recompute_layers;
      so.dropout_seed =
          step_seed(cfg.seed, step, int64_t(rank) * cfg.gradient_accumulation_steps + int64_t(k));
      so.hooks = step_hooks;
      // Data-parallel: no communication until the last micro-step's backward.
      if (ddp) ddp->set_sync(k + 1 == micro.size());
      auto r = model->step(to_token_batch(micro[k]), so);
      loss_sum += r.loss_sum * fault_scale;
      loss_tokens += r.tokens;
    }
    if (ddp) ddp->finish();
    if (shard) shard->finish();
    if (nan_fault) poison_first_element(grads());
    if (kill_fault) kill_self();
    // The guard reads the gradients once, before anything is updated: NaN/Inf anywhere (on any
    // rank: the flag rides on the loss's all-reduce).
    bool bad_grads = ops::count_bad_values(grads()) > 0;
    if (comm) {
      std::vector<float> v(5);
      v[0] = float(loss_sum);
      encode_count(loss_tokens, &v[1]);
      v[4] = bad_grads ? 1.0f : 0.0f;
      sum_over_ranks(*comm, v);
      loss_sum = v[0];
      loss_tokens = decode_count(&v[1]);
      bad_grads = v[4] > 0;
    }
    const double loss = loss_tokens ? loss_sum / double(loss_tokens) : 0;
    bool nonfinite = bad_grads || !std::isfinite(loss);
    double norm = std::nan("");
    std::optional<Spike> spike;
    if (!nonfinite) {
      norm = shard ? shard->clip_grad_norm(float(cfg.max_grad_norm)) : grad_norm(opt_params);
      nonfinite = !std::isfinite(norm);
      if (!nonfinite && cfg.guard.rollback_on_spike) spike = spikes.check(loss, norm);
    }
    if (nonfinite && !cfg.guard.skip_nonfinite)
      fail(
          "step {}: the loss or the gradients are not finite (loss {}, gradient norm {}) and "
          "guard.skip_nonfinite is off; {}",
          next, loss, norm, last_checkpoint_words());
    // Sharded: a shard that changed between the start of this step and now.
    std::optional<HealthVerdict> verdict;
    if (shard_check) {
      RankHealth mine;
      mine.changed = ops::hash64(trainable_weights()) != shard_ref ||
                     ops::hash64(frozen_weights()) != frozen_ref;
      HealthVerdict v = judge_health(gather_health(comm, mine), false, "shard");
      if (!v.ok) verdict = v;
    }
    std::string found_by = "shard check";
    if (!verdict && (nonfinite || spike)) {
      verdict = diagnose();
      found_by = nonfinite ? "NaN/Inf" : "spike";
    }
    if (verdict) {
      // The model is damaged, not the data: back to the last verified state, same batches.
      report_verdict(*verdict, next, found_by);
      if (!rollback(next, verdict->rule, {{"ranks", verdict->ranks}}, false))
        fail("step {}: {}; there is no verified checkpoint to roll back to, so the run stops", next,
             verdict->detail);
      continue;
    }
    if (spike) {
      if (rollback(next, spike->metric, spike->to_json(), true)) continue;
      // No checkpoint yet: the step is skipped instead.
      nonfinite = true;
    }
    if (nonfinite) {
      ++skips_in_row;
      ++skipped_total;
      if (ddp) ddp->reset_compression();
      const std::string why =
          spike ? fmt::format(
                      "{} {:.4g} spikes above {:.4g} and there is no checkpoint to roll back to",
                      spike->metric, spike->value, spike->threshold)
                : std::string("NaN/Inf in the loss or the gradients");
      event("skipped_step", next, {{"reason", why}, {"in_a_row", skips_in_row}},
            fmt::format("step {}: skipped ({}); weights, optimizer and schedule unchanged, batch "
                        "consumed ({} in a row)",
                        next, why, skips_in_row));
      if (skips_in_row >= cfg.guard.max_skips_in_row)
        fail(
            "step {}: {} optimizer steps in a row were skipped ({}; guard.max_skips_in_row is {}): "
            "stopping. Look at the data and the learning rate around this step; {}",
            next, skips_in_row, why, cfg.guard.max_skips_in_row, last_checkpoint_words());
      continue;
    }
    skips_in_row = 0;
    // Sharded: clipped above already (the optimizer's max_grad_norm is 0 there).
    opt.clip_and_step(opt_params, lr, norm);  // also refreshes the compute copies
    spikes.record(loss, norm);
    ++step;
    StepMetrics m;
    m.step = step;
    m.loss = loss;
    m.lr = lr;
    m.grad_norm = norm;
    m.tokens_per_s = double(tokens) / std::max(1e-9, now_s() - t0);
    m.peak_memory_bytes = alloc.peak();
    m.extra["trained_tokens"] = trained;
    watch_gpus(m);
    if (metrics) metrics->log(m);
    if (progress) progress->update(m);
    result.final_loss = loss;
    // The weights at rest, now and then and before every checkpoint (the final one included), so
    // a checkpoint never holds a corrupted replica. (Sharded ranks checked theirs before the
    // update.)
    if (!shard && check_due(step))
      if (auto bad = check_at_rest()) {
        report_verdict(*bad, step, "check at rest");
        if (!rollback(step, bad->rule, {{"ranks", bad->ranks}}, false))
          fail("step {}: {}; there is no verified checkpoint to roll back to, so the run stops",
               step, bad->detail);
        continue;
      }
    if (cfg.eval.every > 0 && step % cfg.eval.every == 0 && step < total) run_eval(step, false);
    if (cfg.save.every > 0 && step % cfg.save.every == 0 && step < total) save(step);
  }
  result.steps = step;
  result.skipped_steps = skipped_total;
  result.rollbacks = rollbacks;
  if (progress) progress->finish();
  if (result.interrupted) return result;

  save(step);
  // Sharded: the whole model on every rank for the final evaluation and output.
  if (shard) shard->gather_all();
  run_eval(step, true);
  // The result, in the formats other tools load.
  fs::path out = fs::path(run) / "final";
  if (lead) {
    if (model->has_lora()) {
      model->save_adapter(out.string());
    } else {
      model->save_pretrained(out.string());
      fs::copy_file(tokenizer_path(cfg), out / "tokenizer.json",
                    fs::copy_options::overwrite_existing);
    }
    say(fmt::format("wrote {} to {}",
                    model->has_lora() ? "the LoRA adapter (PEFT format)" : "the model",
                    out.string()));
  }
  result.output = out.string();
  return result;
}

}  // namespace rig
