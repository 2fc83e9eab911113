// The trainer's outputs: checkpoints (every rank's part of them), held-out evaluation, and the
// final adapter or model.
#include <cmath>
#include <filesystem>

#include "rig/dist/communicator.h"
#include "rig/io/safetensors.h"
#include "rig/train/trainer_impl.h"

namespace rig {

namespace fs = std::filesystem;
using json = nlohmann::json;

void Trainer::save(int64_t s) {
  // Faults that wait for the next checkpoint.
  std::optional<Injection> kill_save = injector_.take(FaultKind::KillDuringSave, s, true);
  std::optional<Injection> corrupt = injector_.take(FaultKind::CorruptCheckpoint, s, true);
  if (kill_save) log_fault(*kill_save, s);
  std::function<void()> die;
  if (kill_save && kill_save->rank == rank_) die = [] { kill_self(); };
  json st = {{"step", s},
             {"optimizer_step", opt_->steps()},
             {"loader", loader_->state().to_json()},
             {"config_hash", resume_hash(cfg_)},
             {"batch_hash", global_batch_hash(cfg_, world_)},
             {"seed", cfg_.seed},
             {"lr", cfg_.schedule.lr_at(std::max<int64_t>(0, s - 1), total_, cfg_.optimizer.lr)}};
  st["guard"] = {{"history", spikes_.to_json()},
                 {"skipped_steps", skipped_total_},
                 {"rollbacks", rollbacks_},
                 {"batches", batches_drawn_}};
  // Every rank's data position (they differ with packing), so any world size can resume.
  json ranks = json::array();
  for (const auto& ls : gather_loader_states(comm_, loader_->state()))
    ranks.push_back(ls.to_json());
  st["loader_ranks"] = ranks;
  st["world"] = world_;
  st["global_batch"] = cfg_.micro_batch_size * cfg_.gradient_accumulation_steps * world_;
  st["strategy"] = strategy_name_;
  std::string dir;
  if (shard_) {
    // Every rank writes its own shards; rank 0 then moves them into the checkpoint atomically.
    fs::path staging = fs::path(run_) / "checkpoints" / fmt::format(".step-{}.shards", s);
    if (lead_) {
      fs::remove_all(staging);
      fs::create_directories(staging);
    }
    comm_->barrier();
    save_safetensors((staging / shard_file_name(rank_, world_)).string(),
                     shard_->shard_tensors(*opt_),
                     {{"format", kCheckpointFormat}, {"step", std::to_string(s)}});
    if (die && !lead_) die();
    comm_->barrier();
    if (lead_) {
      std::vector<std::string> files;
      for (int r = 0; r < world_; ++r)
        files.push_back((staging / shard_file_name(r, world_)).string());
      st["sharded"] = shard_->layout();
      dir = save_checkpoint(run_, s, {}, st, cfg_.save.keep_last, files, die);
    }
    comm_->barrier();  // nobody stages the next checkpoint while rank 0 tidies up
  } else if (lead_) {
    std::vector<std::pair<std::string, Tensor>> ts;
    for (auto& p : model_->params())
      if (p.trainable) ts.emplace_back("param." + p.name, p.value.to(Device::cpu(), "checkpoint"));
    for (auto& [name, t] : opt_->state_tensors())
      ts.emplace_back(name, t.to(Device::cpu(), "checkpoint"));
    dir = save_checkpoint(run_, s, ts, st, cfg_.save.keep_last, {}, die);
  } else if (die) {
    die();  // a replica that does not write dies while rank 0 writes
  }
  if (lead_) say(fmt::format("saved checkpoint {}", dir));
  if (corrupt) {
    log_fault(*corrupt, s);
    if (lead_) note(fmt::format("corrupted {}", corrupt_checkpoint_file(dir)));
  }
}

// Held-out loss, and when asked, exact match of greedily generated responses. Every rank
// evaluates; rank 0 reports. Sharded, the loss is computed layer by layer through the same hooks
// as training (a base larger than one card never gathered whole); generation needs the whole
// model on every rank.
void Trainer::run_eval(int64_t s, bool final_eval) {
  if (!data_.eval) return;
  const bool layerwise = shard_ && !shard_->gathered();
  auto e = evaluate(*model_, *data_.eval, cfg_.sequence_len, cfg_.micro_batch_size,
                    cfg_.eval.batches, layerwise ? shard_.get() : nullptr);
  const bool gather = layerwise && cfg_.eval.generate > 0;
  if (gather) shard_->gather_all();
  json extra = {{"eval_perplexity", std::exp(e.loss)}};
  std::string line = fmt::format("step {}: eval loss {:.4f} (perplexity {:.2f}) over {} tokens", s,
                                 e.loss, std::exp(e.loss), e.tokens);
  if (cfg_.eval.generate > 0) {
    auto em = exact_match(*model_, *data_.eval, *tok_, cfg_.eval.generate, final_eval ? 5 : 0);
    extra["eval_exact_match"] = em.exact_match;
    line += fmt::format(", exact match {:.1f}%", 100 * em.exact_match);
    if (final_eval) {
      result_.exact_match = em.exact_match;
      result_.samples = em.samples;
    }
  }
  if (gather) shard_->release_all();
  if (metrics_) metrics_->log_eval(s, e.loss, extra);
  say(line);
  result_.eval_loss = e.loss;
}

// The result, in the formats other tools load (sharded: what it holds gathered on every rank
// first; a LoRA adapter's output is the adapter alone, so the frozen base stays sharded).
void Trainer::write_final() {
  run_eval(step_, true);
  if (shard_) shard_->gather_all(model_->has_lora());
  fs::path out = fs::path(run_) / "final";
  if (lead_) {
    if (model_->has_lora()) {
      model_->save_adapter(out.string());
    } else {
      model_->save_pretrained(out.string());
      fs::copy_file(tokenizer_path(cfg_), out / "tokenizer.json",
                    fs::copy_options::overwrite_existing);
    }
    say(fmt::format("wrote {} to {}",
                    model_->has_lora() ? "the LoRA adapter (PEFT format)" : "the model",
                    out.string()));
  }
  result_.output = out.string();
}

}  // namespace rig
