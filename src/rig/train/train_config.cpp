#include "rig/train/train_config.h"

#include <xxhash.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "rig/core/error.h"
#include "rig/io/atomic_file.h"
#include "rig/model/catalog.h"
#include "rig/train/guard.h"
#include "rig/train/train_config_read.h"

namespace rig {

using json = nlohmann::json;

// ---- closest key ---------------------------------------------------------------

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j)
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a[i - 1] != b[j - 1])});
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

std::string closest_match(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = SIZE_MAX;
  for (const auto& c : candidates) {
    size_t d = edit_distance(word, c);
    // A prefix ("micro_batch" for "micro_batch_size") is as good as a one-letter typo.
    if (word.size() >= 3 && (c.rfind(word, 0) == 0 || word.rfind(c, 0) == 0))
      d = std::min<size_t>(d, 1);
    if (d < best_d) best_d = d, best = c;
  }
  size_t limit = std::max<size_t>(2, word.size() / 3);
  return best_d <= limit ? best : std::string();
}

// ---- validation --------------------------------------------------------------

void TrainConfig::validate() const {
  // Long on purpose: a flat list of independent checks, one per rule.
  const std::string& s = source;
  auto need = [&](bool ok, const char* key, const std::string& what, const std::string& value) {
    if (!ok) bad_input("{}: '{}' {}, found {}", s, key, what, value);
  };
  if (init == "pretrained") {
    if (model.empty())
      bad_input(
          "{}: no model: set 'model' to a Hugging Face model folder, or 'init: random' with "
          "'architecture'",
          s);
    if (!architecture_name.empty() || !architecture.is_null())
      bad_input(
          "{}: 'architecture' is only used with 'init: random' (a pretrained model brings "
          "its own config.json)",
          s);
  } else if (model.empty() && architecture_name.empty() && architecture.is_null()) {
    bad_input(
        "{}: 'init: random' needs 'architecture' (a built-in shape such as tiny or "
        "llama3-8b, or an inline config.json mapping) or a 'model' folder to take it from",
        s);
  }
  if (method != "full") {
    need(lora.r > 0, "lora.r", "must be at least 1", std::to_string(lora.r));
    need(lora.alpha > 0, "lora.alpha", "must be more than 0", fmt::format("{}", lora.alpha));
    need(lora.dropout >= 0 && lora.dropout < 1, "lora.dropout", "must be in [0, 1)",
         fmt::format("{}", lora.dropout));
  }
  if (datasets.empty())
    bad_input("{}: no training data: add 'datasets: [{{path: data.jsonl, format: alpaca}}]'", s);
  for (size_t i = 0; i < datasets.size(); ++i) {
    const auto& d = datasets[i];
    if ((d.format == "text" || d.format == "tokens") && !d.template_name.empty())
      bad_input("{}: 'datasets.{}.template' is only used with the alpaca and chat formats", s, i);
  }
  bool needs_tokenizer = std::any_of(datasets.begin(), datasets.end(),
                                     [](const DatasetSettings& d) { return d.format != "tokens"; });
  if (needs_tokenizer && tokenizer.empty() && model.empty())
    bad_input(
        "{}: no tokenizer: set 'tokenizer' (a tokenizer.json or a folder holding one); "
        "without a model folder there is none to take it from",
        s);
  need(sequence_len > 0, "sequence_len", "must be at least 1", std::to_string(sequence_len));
  need(micro_batch_size > 0, "micro_batch_size", "must be at least 1",
       std::to_string(micro_batch_size));
  need(gradient_accumulation_steps > 0, "gradient_accumulation_steps", "must be at least 1",
       std::to_string(gradient_accumulation_steps));
  need(max_steps >= 0, "max_steps", "must be 0 or more", std::to_string(max_steps));
  need(num_epochs >= 0, "num_epochs", "must be 0 or more", fmt::format("{}", num_epochs));
  // Past these bounds a step count, milliseconds or bytes would overflow their integers.
  need(num_epochs <= 1e6, "num_epochs", "must be at most 1000000", fmt::format("{}", num_epochs));
  need(dist.timeout_s <= 1e6, "dist.timeout_s", "must be at most 1000000 seconds",
       fmt::format("{}", dist.timeout_s));
  need(dist.bucket_mb <= 1e6, "dist.bucket_mb", "must be at most 1000000",
       fmt::format("{}", dist.bucket_mb));
  if (max_steps == 0 && num_epochs <= 0)
    bad_input("{}: the run has no length: set 'max_steps' or 'num_epochs'", s);
  need(optimizer.lr > 0, "optimizer.lr", "(learning_rate) must be more than 0",
       fmt::format("{}", optimizer.lr));
  need(optimizer.beta1 >= 0 && optimizer.beta1 < 1, "optimizer.betas", "beta1 must be in [0, 1)",
       fmt::format("{}", optimizer.beta1));
  need(optimizer.beta2 >= 0 && optimizer.beta2 < 1, "optimizer.betas", "beta2 must be in [0, 1)",
       fmt::format("{}", optimizer.beta2));
  need(optimizer.eps > 0, "optimizer.eps", "must be more than 0", fmt::format("{}", optimizer.eps));
  need(optimizer.weight_decay >= 0, "optimizer.weight_decay", "must be 0 or more",
       fmt::format("{}", optimizer.weight_decay));
  need(schedule.warmup_steps >= 0, "schedule.warmup_steps", "must be 0 or more",
       std::to_string(schedule.warmup_steps));
  if (max_steps > 0 && schedule.warmup_steps >= max_steps)
    bad_input("{}: 'schedule.warmup_steps' ({}) must be less than max_steps ({})", s,
              schedule.warmup_steps, max_steps);
  need(schedule.min_lr_ratio >= 0 && schedule.min_lr_ratio <= 1, "schedule.min_lr_ratio",
       "must be in [0, 1]", fmt::format("{}", schedule.min_lr_ratio));
  need(max_grad_norm >= 0, "max_grad_norm", "must be 0 (off) or more",
       fmt::format("{}", max_grad_norm));
  need(eval.every >= 0, "eval.every", "must be 0 or more", std::to_string(eval.every));
  need(eval.split >= 0 && eval.split < 1, "eval.split",
       "(val_set_size) must be a fraction in [0, 1)", fmt::format("{}", eval.split));
  need(eval.batches >= 0, "eval.batches", "must be 0 or more", std::to_string(eval.batches));
  need(thermal.pause_above_c >= 0, "thermal.pause_above_c", "must be 0 (off) or a temperature",
       std::to_string(thermal.pause_above_c));
  need(thermal.resume_below_c >= 0 &&
           (thermal.pause_above_c == 0 || thermal.resume_below_c < thermal.pause_above_c),
       "thermal.resume_below_c", "must be below thermal.pause_above_c",
       std::to_string(thermal.resume_below_c));
  need(eval.generate >= 0, "eval.generate", "must be 0 or more", std::to_string(eval.generate));
  if (eval.every > 0 && eval.split == 0)
    bad_input("{}: 'eval.every' is {} but nothing is held out: set 'eval.split' (e.g. 0.05)", s,
              eval.every);
  need(dist.timeout_s > 0, "dist.timeout_s", "must be more than 0 seconds",
       fmt::format("{}", dist.timeout_s));
  need(dist.bucket_mb > 0, "dist.bucket_mb", "must be more than 0",
       fmt::format("{}", dist.bucket_mb));
  need(dist.powersgd_rank >= 0 && dist.powersgd_rank <= 64, "dist.powersgd_rank",
       "must be 0 (off) to 64", std::to_string(dist.powersgd_rank));
  if (dist.powersgd_rank > 0 && strategy == "sharded")
    bad_input(
        "{}: 'dist.powersgd_rank' compresses data-parallel gradients; it does not apply to "
        "strategy: sharded",
        s);
  need(save.every >= 0, "save.every", "must be 0 or more", std::to_string(save.every));
  need(save.keep_last >= 0, "save.keep_last", "must be 0 (keep all) or more",
       std::to_string(save.keep_last));
  if (precision == "bf16" && device == "cpu")
    bad_input("{}: 'precision: bf16' needs a CUDA device; the CPU backend computes in fp32", s);
  need(guard.max_skips_in_row >= 1, "guard.max_skips_in_row", "must be at least 1",
       std::to_string(guard.max_skips_in_row));
  need(guard.spike_window >= 3, "guard.spike_window", "must be at least 3 steps",
       std::to_string(guard.spike_window));
  need(guard.spike_warmup >= 3 && guard.spike_warmup <= guard.spike_window, "guard.spike_warmup",
       "must be 3 or more and at most guard.spike_window", std::to_string(guard.spike_warmup));
  need(guard.spike_k > 0, "guard.spike_k", "must be more than 0", fmt::format("{}", guard.spike_k));
  need(guard.spike_loss_ratio >= 1, "guard.spike_loss_ratio", "must be 1 or more",
       fmt::format("{}", guard.spike_loss_ratio));
  need(guard.spike_grad_ratio >= 1, "guard.spike_grad_ratio", "must be 1 or more",
       fmt::format("{}", guard.spike_grad_ratio));
  need(guard.max_rollbacks >= 0, "guard.max_rollbacks", "must be 0 or more",
       std::to_string(guard.max_rollbacks));
  need(guard.replica_check_every >= 0, "guard.replica_check_every", "must be 0 (off) or more",
       std::to_string(guard.replica_check_every));
  for (const auto& spec : inject) check_injection_spec(spec, s + ": 'inject'");
  if (output_dir.empty()) bad_input("{}: 'output_dir' is empty", s);
}

// ---- derived values -------------------------------------------------------------

double LoraSettings::scale() const {
  return rslora ? alpha / std::sqrt(double(r)) : alpha / double(r);
}

double ScheduleSettings::lr_at(int64_t step, int64_t total, double peak) const {
  // Hugging Face's schedules (get_cosine_schedule_with_warmup and friends), with a floor.
  if (step < warmup_steps) return peak * double(step) / double(std::max<int64_t>(1, warmup_steps));
  if (name == "constant") return peak;
  double progress =
      double(step - warmup_steps) / double(std::max<int64_t>(1, total - warmup_steps));
  progress = std::clamp(progress, 0.0, 1.0);
  double f = name == "linear" ? 1.0 - progress : 0.5 * (1.0 + std::cos(M_PI * progress));
  return peak * (min_lr_ratio + (1.0 - min_lr_ratio) * f);
}

std::string TrainConfig::resolved_precision(bool device_is_cuda) const {
  if (precision != "auto") return precision;
  return device_is_cuda ? "bf16" : "fp32";
}

json TrainConfig::architecture_json() const {
  if (!architecture_name.empty()) return *builtin_architecture(architecture_name);
  return architecture;
}

// ---- output ----------------------------------------------------------------------

json TrainConfig::to_json() const {
  return json::parse(to_ordered_json().dump());
}

nlohmann::ordered_json TrainConfig::to_ordered_json() const {
  using ojson = nlohmann::ordered_json;
  ojson j;
  j["model"] = model;
  j["init"] = init;
  j["architecture"] = architecture_name.empty() ? ojson(architecture) : ojson(architecture_name);
  j["method"] = method;
  j["lora"] = {{"r", lora.r},
               {"alpha", lora.alpha},
               {"dropout", lora.dropout},
               {"targets", lora.targets},
               {"rslora", lora.rslora}};
  ojson ds = ojson::array();
  for (const auto& d : datasets) {
    ojson e = {{"path", d.path}, {"format", d.format}};
    if (!d.template_name.empty()) e["template"] = d.template_name;
    ds.push_back(e);
  }
  j["datasets"] = ds;
  j["tokenizer"] = tokenizer;
  j["sequence_len"] = sequence_len;
  j["packing"] = packing;
  j["train_on_inputs"] = train_on_inputs;
  j["micro_batch_size"] = micro_batch_size;
  j["gradient_accumulation_steps"] = gradient_accumulation_steps;
  j["max_steps"] = max_steps;
  j["num_epochs"] = num_epochs;
  j["optimizer"] = {{"name", optimizer.name},
                    {"lr", optimizer.lr},
                    {"betas", {optimizer.beta1, optimizer.beta2}},
                    {"eps", optimizer.eps},
                    {"weight_decay", optimizer.weight_decay},
                    {"no_decay_on_norms_and_biases", optimizer.no_decay_on_norms_and_biases},
                    {"min_8bit_size", optimizer.min_8bit_size}};
  j["schedule"] = {{"name", schedule.name},
                   {"warmup_steps", schedule.warmup_steps},
                   {"min_lr_ratio", schedule.min_lr_ratio}};
  j["max_grad_norm"] = max_grad_norm;
  j["precision"] = precision;
  j["activation_checkpointing"] = activation_checkpointing;
  j["recompute_layers"] = recompute_layers;
  j["strategy"] = strategy;
  j["dist"] = {{"timeout_s", dist.timeout_s},
               {"bucket_mb", dist.bucket_mb},
               {"powersgd_rank", dist.powersgd_rank}};
  j["eval"] = {{"every", eval.every},
               {"split", eval.split},
               {"batches", eval.batches},
               {"generate", eval.generate}};
  j["save"] = {{"every", save.every}, {"keep_last", save.keep_last}};
  j["thermal"] = {{"pause_above_c", thermal.pause_above_c},
                  {"resume_below_c", thermal.resume_below_c}};
  j["guard"] = {{"skip_nonfinite", guard.skip_nonfinite},
                {"max_skips_in_row", guard.max_skips_in_row},
                {"rollback_on_spike", guard.rollback_on_spike},
                {"spike_window", guard.spike_window},
                {"spike_warmup", guard.spike_warmup},
                {"spike_k", guard.spike_k},
                {"spike_loss_ratio", guard.spike_loss_ratio},
                {"spike_grad_ratio", guard.spike_grad_ratio},
                {"max_rollbacks", guard.max_rollbacks},
                {"replica_check_every", guard.replica_check_every},
                {"verify_checkpoints", guard.verify_checkpoints}};
  j["inject"] = inject;
  j["seed"] = seed;
  j["deterministic"] = deterministic;
  j["device"] = device;
  j["max_memory"] = max_memory ? ojson(max_memory) : ojson(nullptr);
  j["output_dir"] = output_dir;
  j["resume"] = resume;
  return j;
}

namespace {

using config_read::yaml_to_json;

// Strings that would read back as another type are quoted; the rest stay plain and readable.
bool reads_as_non_string(const std::string& s) {
  if (s.empty()) return true;
  YAML::Node n = YAML::Load(s);
  if (!n.IsScalar()) return true;
  return !yaml_to_json(n).is_string() || n.Scalar() != s;
}

template <typename J>
void emit(YAML::Emitter& e, const J& j) {
  switch (j.type()) {
    case J::value_t::object:
      e << YAML::BeginMap;
      for (auto it = j.begin(); it != j.end(); ++it) {
        e << YAML::Key << it.key() << YAML::Value;
        emit(e, it.value());
      }
      e << YAML::EndMap;
      break;
    case J::value_t::array: {
      bool flat = std::all_of(j.begin(), j.end(), [](const J& x) { return x.is_primitive(); });
      e << (flat ? YAML::Flow : YAML::Block) << YAML::BeginSeq;
      for (const auto& x : j) emit(e, x);
      e << YAML::EndSeq;
      break;
    }
    case J::value_t::string: {
      const std::string& s = j.template get_ref<const std::string&>();
      bool quote = false;
      try {
        quote = reads_as_non_string(s);
      } catch (const YAML::Exception&) {
        quote = true;
      }
      if (quote) e << YAML::DoubleQuoted;
      e << s;
      break;
    }
    case J::value_t::boolean:
      e << j.template get<bool>();
      break;
    case J::value_t::null:
      e << YAML::Null;
      break;
    default:
      e << j.dump();  // numbers as JSON writes them: shortest text that reads back exactly
  }
}

}  // namespace

std::string TrainConfig::to_yaml() const {
  YAML::Emitter e;
  emit(e, to_ordered_json());
  return std::string(e.c_str()) + "\n";
}

std::string TrainConfig::config_hash() const {
  // Bookkeeping that does not change what is computed stays out, so a resumed run whose folder
  // moved or whose save cadence changed still matches.
  json j = to_json();
  j.erase("output_dir");
  j.erase("resume");
  j.erase("save");
  // How the run guards itself and the faults injected to prove it: a run resumes whatever they
  // are, and a clean run and an injected one are the same computation.
  j.erase("guard");
  j.erase("inject");
  // How ranks talk, not what they compute; compression does change it (and stays out when off,
  // so configs without it keep their hash).
  const int64_t psgd = j["dist"]["powersgd_rank"];
  j.erase("dist");
  if (psgd > 0) j["powersgd_rank"] = psgd;
  std::string s = j.dump();
  return fmt::format("{:016x}", XXH3_64bits(s.data(), s.size()));
}

void save_run_config(const TrainConfig& c, const std::string& run_dir) {
  std::filesystem::create_directories(run_dir);
  std::string head =
      fmt::format("# resolved by rig from {} (config hash {})\n", c.source, c.config_hash());
  write_file_atomic(run_dir + "/config.yaml", head + c.to_yaml());
  nlohmann::ordered_json j = c.to_ordered_json();
  j["config_hash"] = c.config_hash();
  write_file_atomic(run_dir + "/config.json", j.dump(1) + "\n");
}

// ---- built-in shapes: the model catalogue (rig/model/catalog.h) -----------------

std::vector<std::string> builtin_architecture_names() {
  return catalog_names();
}

std::optional<json> builtin_architecture(const std::string& name) {
  const CatalogModel* m = find_catalog_model(name);
  if (!m) return std::nullopt;
  return m->config;
}

}  // namespace rig
