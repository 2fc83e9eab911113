// The trainer's setup (config, device, ranks, data, model, optimizer, strategy), the checkpoint
// a run resumes from, and restoring one (resume and rollback).
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <random>

#include "rig/core/allocator.h"
#include "rig/core/host_memory.h"
#include "rig/dist/communicator.h"
#include "rig/dist/launcher.h"
#include "rig/ops/ops.h"
#include "rig/train/trainer_impl.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// The vocabulary the model will have, without loading its weights.
int64_t model_vocab_size(const TrainConfig& cfg) {
  json arch = cfg.init == "random" ? cfg.architecture_json() : json();
  if (!arch.is_null()) return ModelConfig::from_json(arch, cfg.source + " architecture").vocab_size;
  if (cfg.model.empty()) return 0;
  return ModelConfig::load(cfg.model).vocab_size;
}

int64_t planned_steps(const TrainConfig& cfg, const TokenDataset& data, int world) {
  if (cfg.max_steps > 0) return cfg.max_steps;
  double rows = cfg.packing ? std::ceil(double(data.num_tokens()) / double(cfg.sequence_len))
                            : double(data.size());
  double per_step = double(cfg.micro_batch_size * cfg.gradient_accumulation_steps * world);
  return std::max<int64_t>(1, int64_t(std::ceil(cfg.num_epochs * rows / per_step)));
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

}  // namespace

std::string tokenizer_path(const TrainConfig& cfg) {
  std::string p = cfg.tokenizer.empty() ? cfg.model : cfg.tokenizer;
  if (p.empty())
    bad_input("{}: no tokenizer: set 'tokenizer' (a tokenizer.json or a model folder)", cfg.source);
  // A model named as on the Hugging Face Hub and not downloaded: rig reads local folders only.
  if (cfg.tokenizer.empty() && !fs::exists(p))
    bad_input("{}: model: '{}' is not a folder here; rig reads a Hugging Face model folder on "
              "disk: download it first (`huggingface-cli download {} --local-dir models/{}`) and "
              "set model: to that folder",
              cfg.source, p, p, fs::path(p).filename().string());
  if (fs::is_directory(p)) p = (fs::path(p) / "tokenizer.json").string();
  if (!fs::exists(p) && cfg.tokenizer.empty())
    bad_input("{}: the model folder has no {} (set tokenizer:)", cfg.source, p);
  if (!fs::exists(p)) bad_input("{}: tokenizer file {} does not exist", cfg.source, p);
  return p;
}

TrainData load_data(const TrainConfig& cfg, const Tokenizer& tok) {
  if (cfg.datasets.empty()) bad_input("{}: no datasets configured", cfg.source);
  std::vector<Sample> all;
  TrainData d;
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
    if (!st.chat_template.empty())
      d.templates.push_back(fmt::format("{}: {}", ds.path, st.chat_template));
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

std::unique_ptr<LlamaModel> build_model(const TrainConfig& cfg, const BuildOptions& b) {
  std::unique_ptr<LlamaModel> m;
  const bool qlora = cfg.method == "qlora";
  if (cfg.init == "random") {
    json arch = cfg.architecture_json();
    LoadOptions lo;
    lo.quantize = qlora;  // NF4, blocks of 64, double quantization
    // Drawn straight as 4-bit codes, made on the device (or, sharded, only each rank's bytes).
    lo.draw_codes = qlora;
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
    // (blocks of 64, double quantization) one tensor at a time while it loads, or, sharded,
    // only the tensors whose bytes this rank's shards hold.
    LoadOptions lo;
    lo.quantize = qlora;
    lo.defer_quantize = qlora && b.sharded;
    lo.frozen_bf16 = b.bf16 && (qlora || cfg.method == "lora");
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

Trainer::Trainer(const TrainConfig& cfg, const TrainHooks& hooks) : cfg_(cfg), hooks_(hooks) {
  cfg_.validate();
  setup_device();
  setup_ranks();
  alloc_ = &allocator_for(dev_);
  if (!max_memory_) max_memory_ = cfg_.max_memory;
  if (max_memory_) {
    // The cap counts what the communicator holds on the device outside the allocator too.
    const size_t outside = comm_ ? comm_->device_bytes() : 0;
    if (outside >= max_memory_)
      bad_input("{}: max_memory {} bytes leaves nothing beside the {} bytes of collective buffers",
                cfg_.source, max_memory_, outside);
    prior_budget_ = alloc_->budget();
    alloc_->set_budget(alloc_->in_use() + max_memory_ - outside);
  }
  run_ = cfg_.output_dir;
  fs::create_directories(run_);
  // The faults to inject (every rank holds all of them, so the lead logs those aimed at others).
  injector_ = Injector(cfg_.inject, world_, cfg_.source + ": inject");
  find_resume_checkpoint();
  check_resume_config();
  setup_model();
  setup_optimizer();
  setup_strategy();
  if (ckpt_) restore(*ckpt_);
  frozen_ref_ = ops::hash64(frozen_weights());
  open_run_log();
  open_telemetry();
}

// The cap is the process's (its device allocator's): it ends with the run, so that what runs
// next in this process (a sweep's next job, a test) is not held to it.
Trainer::~Trainer() {
  if (prior_budget_) alloc_->set_budget(*prior_budget_);
}

void Trainer::setup_device() {
  dev_ = resolve_device(cfg_.device, cfg_.source);  // shared with rig eval, generate, merge
  precision_ = cfg_.resolved_precision(dev_.is_cuda());
  if (precision_ == "bf16" && !dev_.is_cuda())
    bad_input("{}: 'precision: bf16' needs a CUDA device; the CPU backend computes in fp32",
              cfg_.source);
}

// The ranks: handed in (tests), or this process is one worker of a launched run.
// Ranks sharing a GPU with no max_memory each get an even share of it, less a CUDA context each
// (about 1 GiB, docs/cuda-backend.md): one rank's cache cannot starve the others, and a rank
// past its share stops naming the tensor and the budget.
void Trainer::share_gpu(int ranks_per_gpu) {
  if (cfg_.max_memory || !dev_.is_cuda() || ranks_per_gpu <= 1) return;
  const uint64_t total = cuda_total_memory(dev_.index), context = uint64_t(1) << 30;
  if (total / uint64_t(ranks_per_gpu) <= 2 * context) return;
  max_memory_ = total / uint64_t(ranks_per_gpu) - context;
  placement_ += fmt::format("; max_memory not set: each rank may reserve {} of the GPU's {}",
                            format_bytes(double(max_memory_)), format_bytes(double(total)));
}

void Trainer::setup_ranks() {
  comm_ = hooks_.comm;
  if (!comm_) {
    const dist::DistEnv env = dist::env_from_process();
    // A launched world of one (--nproc-per-node 1) still goes through the communicator, so the
    // distributed path can be run on a single GPU.
    if (env.world > 1 || dist::launched_worker()) {
      // GPU ranks take cuda:(local rank mod GPUs); a node with more ranks than GPUs shares them
      // (collectives then go through Gloo in host memory). A device named with an index pins
      // every rank there.
      const bool pinned = dev_.is_cuda() && cfg_.device != "auto" && cfg_.device != "cuda";
      dist::Placement where = dist::place_rank(env, dev_.is_cuda() ? cuda_device_count() : 0);
      if (pinned) {
        where.device = dev_;
        where.ranks_per_gpu = env.local_world;
        where.backend = env.local_world == 1 && dist::nccl_built() ? dist::Backend::Nccl
                                                                    : dist::Backend::Gloo;
      }
      dev_ = where.device;
      placement_ = where.describe(env.local_world);
      share_gpu(where.ranks_per_gpu);
      dist::CommOptions co;
      co.timeout = dist::Millis(int64_t(cfg_.dist.timeout_s * 1000));
      group_ = dist::init_group(env, where, co);
      comm_ = group_->comm.get();
      if (!comm_->transport().empty()) placement_ += " (data through " + comm_->transport() + ")";
      if (env.rank == 0 && where.ranks_per_gpu > 1 && !hooks_.quiet)
        fmt::print(stderr, "rig: {}\n", placement_);
    }
  }
  rank_ = comm_ ? comm_->rank() : 0;
  world_ = comm_ ? comm_->world() : 1;
  lead_ = rank_ == 0;
  sharding_ = comm_ && cfg_.strategy == "sharded";
  strategy_name_ = !comm_ ? "single" : sharding_ ? "sharded" : "ddp";
}

std::optional<std::string> Trainer::choose_checkpoint() {
  choice_ = kNoCheckpoint;
  if (lead_) {
    CheckpointChoice c = newest_usable_checkpoint(run_, cfg_.guard.verify_checkpoints);
    for (auto& r : c.rejected) {
      r.dir = set_aside_checkpoint(r.dir);
      rejected_.push_back(std::move(r));
    }
    if (c.chosen)
      choice_ = c.chosen->step;
    else if (!c.rejected.empty())
      choice_ = kAllRejected;
  }
  if (comm_) choice_ = broadcast_from_lead(*comm_, choice_);
  if (choice_ < 0) return std::nullopt;
  return (fs::path(run_) / "checkpoints" / fmt::format("step-{}", choice_)).string();
}

void Trainer::find_resume_checkpoint() {
  if (cfg_.resume == "never") {
    if (!list_checkpoints(run_).empty())
      bad_input(
          "{}: {} already holds checkpoints; use resume: auto to continue it or another output_dir",
          cfg_.source, run_);
  } else if (cfg_.resume != "auto") {
    // A checkpoint named by path: used only if it passes, with no fallback.
    int64_t ok = 1;
    std::string why;
    if (lead_ && cfg_.guard.verify_checkpoints) {
      VerifyReport r = verify_checkpoint(cfg_.resume, verify_for_use());
      ok = r.ok();
      why = r.to_text();
    }
    if (comm_) ok = broadcast_from_lead(*comm_, ok);
    if (!ok)
      bad_input("{}: the checkpoint {} does not pass verification{}", cfg_.source, cfg_.resume,
                lead_ ? ":\n" + why : " (rank 0 says why)");
    ckpt_ = load_checkpoint(cfg_.resume);
  } else if (auto dir = choose_checkpoint()) {
    ckpt_ = load_checkpoint(*dir);
  } else if (choice_ == kAllRejected) {
    bad_input(
        "{}: every checkpoint of {} fails verification (they are set aside as "
        "checkpoints/rejected-step-N; rig ckpt verify says why{}); starting over would discard "
        "the run, so rig stops here",
        cfg_.source, run_,
        rejected_.empty() ? std::string() : ": " + rejected_.front().problems.front());
  }
  resumed_ = ckpt_.has_value();
}

void Trainer::check_resume_config() const {
  if (!ckpt_ || ckpt_->state.value("config_hash", "") == resume_hash(cfg_) ||
      ckpt_->state.value("batch_hash", "") == global_batch_hash(cfg_, world_))
    return;
  // Resuming on another number of ranks without adapting the batch is the likely mistake.
  const int64_t here = cfg_.micro_batch_size * cfg_.gradient_accumulation_steps * world_;
  const int64_t there = ckpt_->state.value("global_batch", int64_t(0));
  if (there > 0 && there != here)
    bad_input(
        "{}: {} was written with a global batch of {} rows on {} rank(s), but here it is {} "
        "(micro_batch_size {} x gradient_accumulation_steps {} x {} rank(s)); change "
        "micro_batch_size or gradient_accumulation_steps so they match",
        cfg_.source, ckpt_->dir, there, ckpt_->state.value("world", 1), here, cfg_.micro_batch_size,
        cfg_.gradient_accumulation_steps, world_);
  bad_input(
      "{}: the configuration differs from the one that wrote {}; resume with the run's own "
      "config.yaml or start a new output_dir",
      cfg_.source, ckpt_->dir);
}

void Trainer::setup_model() {
  tok_.emplace(Tokenizer::load(tokenizer_path(cfg_)));
  data_ = load_data(cfg_, *tok_);
  // Written once the data has loaded: bad data stops the run before it leaves anything behind.
  if (lead_) save_run_config(cfg_, run_);
  model_ = build_model(cfg_, {sharding_, precision_ == "bf16"});
  place_model(*model_, cfg_, dev_, precision_);
  if (!sharding_) model_->materialize_4bit(dev_);  // sharded ranks draw their own bytes
  if (tok_->vocab_size() > model_->config().vocab_size)
    bad_input("{}: the tokenizer has {} tokens but the model's vocabulary is {}", cfg_.source,
              tok_->vocab_size(), model_->config().vocab_size);
  n_params_ = model_->num_parameters(false);
  n_trainable_ = model_->num_parameters(true);
}

void Trainer::setup_optimizer() {
  opt_ = std::make_unique<AdamW>(optimizer_config(cfg_, sharding_));
}

void Trainer::setup_strategy() {
  LoaderOptions lo;
  lo.seq_len = cfg_.sequence_len;
  lo.micro_batch = cfg_.micro_batch_size;
  lo.pack = cfg_.packing;
  lo.seed = cfg_.seed;
  lo.rank = rank_;
  lo.world = world_;
  loader_ = std::make_unique<DataLoader>(data_.train, lo);
  total_ = planned_steps(cfg_, *data_.train, world_);
  accum_ = cfg_.gradient_accumulation_steps;
  if (sharding_) {
    shard_ = std::make_unique<Sharded>(*comm_, *model_, opt_.get());
    check_generation_fits();
  }
  if (comm_ && !sharding_)
    ddp_ = std::make_unique<DataParallel>(*comm_, *model_, size_t(cfg_.dist.bucket_mb * (1 << 20)),
                                          int(cfg_.dist.powersgd_rank), cfg_.seed);
  stepper_ = std::make_unique<TrainStep>(*model_, *opt_, ddp_.get(), shard_.get(),
                                         train_step_options(cfg_, rank_));
  spikes_ =
      SpikeDetector(SpikeRule{cfg_.guard.spike_window, cfg_.guard.spike_warmup, cfg_.guard.spike_k,
                              cfg_.guard.spike_loss_ratio, cfg_.guard.spike_grad_ratio});
}

// Exact match generates with the whole model on every rank (the held-out loss runs layer by
// layer). A base larger than the budget is refused here, not by an out-of-memory stop at the
// first evaluation, hours in.
void Trainer::check_generation_fits() const {
  if (cfg_.eval.generate <= 0 || !data_.eval || !alloc_->budget()) return;
  double whole = 0;  // what gather_all makes on every rank: every unit, in float32 words
  for (const auto& u : shard_->units()) whole += 4.0 * double(u.flat_numel());
  double decoded = 0;  // a 4-bit weight is decoded while its product runs: the largest one
  for (const auto& p : model_->params())
    if (p.quant) decoded = std::max(decoded, double(p.numel()) * (precision_ == "bf16" ? 2 : 4));
  const double need = whole + decoded;  // at least: the KV cache and logits come on top
  const double room = double(alloc_->budget()) - double(alloc_->in_use());
  if (need > room)
    bad_input("{}: eval.generate {} generates with the whole model gathered on every rank (at "
              "least {}), more than max_memory leaves ({} of {}); set eval.generate: 0 (the "
              "held-out loss is computed layer by layer) and measure exact match after training "
              "with rig eval --generate",
              cfg_.source, cfg_.eval.generate, format_bytes(need), format_bytes(room),
              format_bytes(double(max_memory_)));
}

void Trainer::restore(const LoadedCheckpoint& ck) {
  const json* layout = ck.state.contains("sharded") ? &ck.state["sharded"] : nullptr;
  if (layout) check_layout(*layout, shard_ ? shard_->units() : flat_units(*model_), ck.dir);
  const int64_t opt_step = ck.state.at("optimizer_step").get<int64_t>();
  std::map<std::string, Tensor> state;
  if (layout && !sharding_) {
    // A sharded checkpoint resumed whole: the flat shards back into named tensors.
    state = read_sharded_as_named(ck.dir, *layout);
  } else {
    for (auto& [name, t] : ck.tensors) state[name] = t;
  }
  if (shard_) {
    shard_->load(layout ? sharded_checkpoint_reader(ck.dir, *layout) : named_tensor_reader(state),
                 *opt_, opt_step, dev_);
  } else {
    std::map<std::string, Tensor> opt_state;
    for (auto& p : model_->params()) {
      if (!p.trainable) continue;
      auto it = state.find("param." + p.name);
      if (it == state.end()) bad_input("{}: checkpoint has no tensor 'param.{}'", ck.dir, p.name);
      p.value.copy_from(it->second.reshape(p.value.shape()));
      for (const char* k : {"adamw.m.", "adamw.v."})
        if (auto m = state.find(k + p.name); m != state.end())
          opt_state[m->first] = m->second.reshape(p.value.shape());
      for (const char* k : {"adamw8bit.mq.", "adamw8bit.mabs.", "adamw8bit.vq.", "adamw8bit.vabs."})
        if (auto m = state.find(k + p.name); m != state.end()) opt_state[m->first] = m->second;
    }
    model_->refresh_compute_weights();
    opt_->load_state(opt_state, opt_step, dev_);
  }
  std::vector<LoaderState> saved;
  if (ck.state.contains("loader_ranks"))
    for (const auto& j : ck.state["loader_ranks"]) saved.push_back(LoaderState::from_json(j));
  else
    saved.push_back(LoaderState::from_json(ck.state.at("loader")));
  loader_->restore(resplit_loader_state(saved, rank_, world_, ck.dir));
  step_ = ck.state.at("step").get<int64_t>();
  const json g = ck.state.value("guard", json::object());
  spikes_.from_json(g.value("history", json()));
  skipped_total_ = std::max(skipped_total_, g.value("skipped_steps", int64_t(0)));
  rollbacks_ = std::max(rollbacks_, g.value("rollbacks", int64_t(0)));
  batches_drawn_ = g.value("batches", step_);
}

void Trainer::reload_frozen() {
  auto fresh = build_model(cfg_, {bool(shard_), model_->compute_dtype() == DType::BF16});
  fresh->set_compute_dtype(model_->compute_dtype());
  if (shard_) {
    // Only this rank reloads: the 4-bit offsets it would otherwise share are the run's own.
    if (fresh->offsets_pending()) {
      std::vector<float> offsets;
      for (const auto& p : model_->params()) offsets.push_back(p.quant ? p.quant->nested_offset : 0);
      fresh->set_4bit_offsets(offsets);
    }
    Sharded slices(*comm_, *fresh);  // this rank's slices of the fresh weights (no communication)
    auto mine = shard_->frozen_shards(), theirs = slices.frozen_shards();
    for (size_t i = 0; i < mine.size(); ++i) mine[i].copy_from(theirs[i]);
  } else {
    fresh->materialize_4bit(Device::cpu());
    auto& ps = model_->params();
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
  if (ops::hash64(frozen_weights()) != frozen_ref_)
    fail(
        "the frozen weights reloaded from {} differ from those the run started with (the model "
        "files changed on disk?)",
        cfg_.model.empty() ? std::string("the seed") : cfg_.model);
}

}  // namespace rig
