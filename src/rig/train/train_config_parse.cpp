// The training config parser: YAML keys (and their axolotl and torchtune spellings) into a
// TrainConfig.
#include <algorithm>
#include <map>

#include "rig/core/allocator.h"
#include "rig/core/error.h"
#include "rig/core/tensor.h"
#include "rig/io/atomic_file.h"
#include "rig/model/config.h"
#include "rig/text/tokenizer.h"
#include "rig/train/guard.h"
#include "rig/train/train_config.h"
#include "rig/train/train_config_read.h"

namespace rig {

using namespace config_read;

namespace {

const std::vector<std::string> kLinearTargets = {"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                 "gate_proj", "up_proj", "down_proj"};

std::vector<std::string> read_targets(const Ctx& ctx, const Item& it) {
  std::vector<std::string> out;
  if (it.value.IsScalar()) {
    std::string s = it.value.Scalar();
    if (s == "all-linear" || s == "all_linear") return kLinearTargets;
    out.push_back(s);  // a single module name
  } else if (it.value.IsSequence()) {
    for (size_t i = 0; i < it.value.size(); ++i) {
      Item e{fmt::format("{}.{}", it.path, i), it.value[i], it.line, it.from_override};
      out.push_back(as_string(ctx, e));
    }
  } else {
    type_error(ctx, it, "a list of module names");
  }
  for (const auto& t : out)
    if (std::find(kLinearTargets.begin(), kLinearTargets.end(), t) == kLinearTargets.end())
      bad_input("{}: '{}': '{}' is not a LoRA target (use {} or all-linear){}", where(ctx, it),
                it.path, t, join(kLinearTargets), did_you_mean(t, kLinearTargets));
  if (out.empty())
    bad_input("{}: '{}' is empty; name at least one module", where(ctx, it), it.path);
  return out;
}

const std::vector<std::string> kFormats = {"alpaca", "chat", "text", "tokens"};
const std::map<std::string, std::string> kFormatAliases = {
    {"chat_template", "chat"}, {"completion", "text"}, {"pretrain", "text"}, {"sharegpt", "chat"}};
const std::vector<std::string> kTemplates = {"auto", "alpaca", "llama3", "chatml"};

DatasetSettings read_dataset(Ctx& ctx, const Item& it) {
  DatasetSettings d;
  if (it.value.IsScalar()) {
    d.path = it.value.Scalar();
    return d;
  }
  MapReader r(ctx, need_map(ctx, it), it.path);
  if (auto v = r.take("path")) d.path = as_string(ctx, *v);
  auto fmt_item = r.take("format");
  auto type_item = r.take("type");  // axolotl
  if (fmt_item && type_item)
    bad_input("{}: '{}' and '{}' both set the dataset format; keep one", where(ctx, *type_item),
              type_item->path, fmt_item->path);
  if (auto v = fmt_item ? fmt_item : type_item)
    d.format = as_enum(ctx, *v, kFormats, kFormatAliases);
  auto tpl = r.take("template");
  auto tpl2 = r.take("chat_template");
  if (auto v = tpl ? tpl : tpl2) d.template_name = as_enum(ctx, *v, kTemplates);
  r.finish();
  if (d.path.empty()) bad_input("{}: '{}' needs a 'path'", where(ctx, it), it.path);
  return d;
}

TrainConfig parse_root(Ctx& ctx, const YAML::Node& root) {
  // Long on purpose: one take() per top-level key, each on its own.
  TrainConfig c;
  c.source = ctx.source;
  MapReader r(ctx, root, "");

  // Model and its origin.
  if (auto v = r.take("model")) assign(ctx, "the model", *v, [&] { c.model = as_string(ctx, *v); });
  if (auto v = r.take("base_model"))
    assign(ctx, "the model", *v, [&] { c.model = as_string(ctx, *v); });
  if (auto v = r.take("init")) c.init = as_enum(ctx, *v, {"pretrained", "random"});
  if (auto v = r.take("architecture")) {
    if (v->value.IsScalar()) {
      c.architecture_name = v->value.Scalar();
      if (!builtin_architecture(c.architecture_name))
        bad_input(
            "{}: 'architecture' '{}' is not a built-in shape (built-in: {}){}; or give an "
            "inline config.json object",
            where(ctx, *v), c.architecture_name, join(builtin_architecture_names()),
            did_you_mean(c.architecture_name, builtin_architecture_names()));
    } else if (v->value.IsMap()) {
      c.architecture = yaml_to_json(v->value);
      ModelConfig::from_json(c.architecture, where(ctx, *v) + ": architecture");
    } else {
      type_error(ctx, *v, "a built-in shape name or a config.json mapping");
    }
  }

  // Method.
  if (auto v = r.take("method"))
    assign(ctx, "the method", *v, [&] { c.method = as_enum(ctx, *v, {"full", "lora", "qlora"}); });
  if (auto v = r.take("adapter"))
    assign(ctx, "the method", *v, [&] { c.method = as_enum(ctx, *v, {"lora", "qlora"}); });
  bool load_4bit = false;
  std::optional<Item> load_4bit_item = r.take("load_in_4bit");
  if (load_4bit_item) load_4bit = as_bool(ctx, *load_4bit_item);
  if (auto v = r.take("load_in_8bit"); v && as_bool(ctx, *v))
    bad_input("{}: 8-bit base weights are not supported; use 'adapter: qlora' (4-bit NF4)",
              where(ctx, *v));

  // LoRA.
  if (auto v = r.take("lora")) {
    MapReader l(ctx, need_map(ctx, *v), "lora");
    if (auto x = l.take("r")) assign(ctx, "lora.r", *x, [&] { c.lora.r = as_int(ctx, *x); });
    if (auto x = l.take("alpha"))
      assign(ctx, "lora.alpha", *x, [&] { c.lora.alpha = as_double(ctx, *x); });
    if (auto x = l.take("dropout"))
      assign(ctx, "lora.dropout", *x, [&] { c.lora.dropout = as_double(ctx, *x); });
    for (const char* k : {"targets", "target_modules"})
      if (auto x = l.take(k))
        assign(ctx, "lora.targets", *x, [&] { c.lora.targets = read_targets(ctx, *x); });
    for (const char* k : {"rslora", "use_rslora"})
      if (auto x = l.take(k))
        assign(ctx, "lora.rslora", *x, [&] { c.lora.rslora = as_bool(ctx, *x); });
    l.finish();
  }
  if (auto v = r.take("lora_r")) assign(ctx, "lora.r", *v, [&] { c.lora.r = as_int(ctx, *v); });
  if (auto v = r.take("lora_alpha"))
    assign(ctx, "lora.alpha", *v, [&] { c.lora.alpha = as_double(ctx, *v); });
  if (auto v = r.take("lora_dropout"))
    assign(ctx, "lora.dropout", *v, [&] { c.lora.dropout = as_double(ctx, *v); });
  if (auto v = r.take("lora_target_modules"))
    assign(ctx, "lora.targets", *v, [&] { c.lora.targets = read_targets(ctx, *v); });
  for (const char* k : {"peft_use_rslora", "use_rslora"})
    if (auto v = r.take(k))
      assign(ctx, "lora.rslora", *v, [&] { c.lora.rslora = as_bool(ctx, *v); });
  // axolotl: lora_target_linear adds every linear layer to whatever lora_target_modules named.
  if (auto v = r.take("lora_target_linear"); v && as_bool(ctx, *v)) c.lora.targets = kLinearTargets;

  // Data.
  std::string default_template;
  if (auto v = r.take("chat_template")) default_template = as_enum(ctx, *v, kTemplates);
  if (auto v = r.take("datasets")) {
    if (!v->value.IsSequence()) type_error(ctx, *v, "a list of datasets");
    for (size_t i = 0; i < v->value.size(); ++i) {
      Item e{fmt::format("datasets.{}", i), v->value[i], v->line, false};
      if (!v->value[i].Mark().is_null()) e.line = v->value[i].Mark().line + 1;
      e.from_override = is_override(ctx, e.path);
      c.datasets.push_back(read_dataset(ctx, e));
    }
  }
  for (auto& d : c.datasets) {
    if (!d.template_name.empty()) continue;
    if (d.format == "alpaca")
      d.template_name = default_template.empty() ? "alpaca" : default_template;
    if (d.format == "chat")
      d.template_name = default_template.empty() ? "auto" : default_template;
  }
  for (const char* k : {"tokenizer", "tokenizer_config"})
    if (auto v = r.take(k))
      assign(ctx, "the tokenizer", *v, [&] { c.tokenizer = as_string(ctx, *v); });
  for (const char* k : {"sequence_len", "max_seq_len"})
    if (auto v = r.take(k))
      assign(ctx, "sequence_len", *v, [&] { c.sequence_len = as_int(ctx, *v); });
  for (const char* k : {"packing", "sample_packing"})
    if (auto v = r.take(k)) assign(ctx, "packing", *v, [&] { c.packing = as_bool(ctx, *v); });
  if (auto v = r.take("train_on_inputs")) c.train_on_inputs = as_bool(ctx, *v);

  // Batch and length of the run.
  for (const char* k : {"micro_batch_size", "batch_size"})
    if (auto v = r.take(k))
      assign(ctx, "micro_batch_size", *v, [&] { c.micro_batch_size = as_int(ctx, *v); });
  if (auto v = r.take("gradient_accumulation_steps"))
    c.gradient_accumulation_steps = as_int(ctx, *v);
  if (auto v = r.take("max_steps")) c.max_steps = as_int(ctx, *v);
  for (const char* k : {"num_epochs", "epochs"})
    if (auto v = r.take(k))
      assign(ctx, "num_epochs", *v, [&] { c.num_epochs = as_double(ctx, *v); });

  // Optimizer.
  const std::vector<std::string> opt_names = {"adamw", "adamw8bit"};
  const std::map<std::string, std::string> opt_aliases = {
      {"adamw_torch", "adamw"},        {"adamw_torch_fused", "adamw"},
      {"adamw_hf", "adamw"},           {"adamw_8bit", "adamw8bit"},
      {"adamw_bnb_8bit", "adamw8bit"}, {"paged_adamw_8bit", "adamw8bit"}};
  if (auto v = r.take("optimizer")) {
    if (v->value.IsScalar()) {  // axolotl: optimizer: adamw_torch
      assign(ctx, "optimizer.name", *v,
             [&] { c.optimizer.name = as_enum(ctx, *v, opt_names, opt_aliases); });
    } else {
      MapReader o(ctx, need_map(ctx, *v), "optimizer");
      if (auto x = o.take("name"))
        assign(ctx, "optimizer.name", *x,
               [&] { c.optimizer.name = as_enum(ctx, *x, opt_names, opt_aliases); });
      if (auto x = o.take("lr"))
        assign(ctx, "the learning rate", *x, [&] { c.optimizer.lr = as_double(ctx, *x); });
      if (auto x = o.take("betas")) {
        if (!x->value.IsSequence() || x->value.size() != 2)
          type_error(ctx, *x, "a list of two numbers [beta1, beta2]");
        Item b1{x->path + ".0", x->value[0], x->line, x->from_override};
        Item b2{x->path + ".1", x->value[1], x->line, x->from_override};
        assign(ctx, "optimizer.beta1", *x, [&] { c.optimizer.beta1 = as_double(ctx, b1); });
        assign(ctx, "optimizer.beta2", *x, [&] { c.optimizer.beta2 = as_double(ctx, b2); });
      }
      if (auto x = o.take("eps"))
        assign(ctx, "optimizer.eps", *x, [&] { c.optimizer.eps = as_double(ctx, *x); });
      if (auto x = o.take("weight_decay"))
        assign(ctx, "weight_decay", *x, [&] { c.optimizer.weight_decay = as_double(ctx, *x); });
      if (auto x = o.take("no_decay_on_norms_and_biases"))
        c.optimizer.no_decay_on_norms_and_biases = as_bool(ctx, *x);
      if (auto x = o.take("min_8bit_size")) {
        c.optimizer.min_8bit_size = as_int(ctx, *x);
        if (c.optimizer.min_8bit_size < 0)
          bad_input("{}: optimizer.min_8bit_size must be 0 or more, found {}", where(ctx, *x),
                    c.optimizer.min_8bit_size);
      }
      o.finish();
    }
  }
  if (auto v = r.take("learning_rate"))
    assign(ctx, "the learning rate", *v, [&] { c.optimizer.lr = as_double(ctx, *v); });
  if (auto v = r.take("weight_decay"))
    assign(ctx, "weight_decay", *v, [&] { c.optimizer.weight_decay = as_double(ctx, *v); });
  if (auto v = r.take("adam_beta1"))
    assign(ctx, "optimizer.beta1", *v, [&] { c.optimizer.beta1 = as_double(ctx, *v); });
  if (auto v = r.take("adam_beta2"))
    assign(ctx, "optimizer.beta2", *v, [&] { c.optimizer.beta2 = as_double(ctx, *v); });
  if (auto v = r.take("adam_epsilon"))
    assign(ctx, "optimizer.eps", *v, [&] { c.optimizer.eps = as_double(ctx, *v); });

  // Schedule.
  const std::vector<std::string> sched_names = {"constant", "linear", "cosine"};
  const std::map<std::string, std::string> sched_aliases = {{"constant_with_warmup", "constant"}};
  if (auto v = r.take("schedule")) {
    MapReader s(ctx, need_map(ctx, *v), "schedule");
    if (auto x = s.take("name"))
      assign(ctx, "schedule.name", *x,
             [&] { c.schedule.name = as_enum(ctx, *x, sched_names, sched_aliases); });
    if (auto x = s.take("warmup_steps"))
      assign(ctx, "warmup_steps", *x, [&] { c.schedule.warmup_steps = as_int(ctx, *x); });
    if (auto x = s.take("min_lr_ratio"))
      assign(ctx, "min_lr_ratio", *x, [&] { c.schedule.min_lr_ratio = as_double(ctx, *x); });
    s.finish();
  }
  if (auto v = r.take("lr_scheduler"))
    assign(ctx, "schedule.name", *v,
           [&] { c.schedule.name = as_enum(ctx, *v, sched_names, sched_aliases); });
  if (auto v = r.take("warmup_steps"))
    assign(ctx, "warmup_steps", *v, [&] { c.schedule.warmup_steps = as_int(ctx, *v); });
  if (auto v = r.take("cosine_min_lr_ratio"))
    assign(ctx, "min_lr_ratio", *v, [&] { c.schedule.min_lr_ratio = as_double(ctx, *v); });
  if (auto v = r.take("max_grad_norm")) c.max_grad_norm = as_double(ctx, *v);

  // Precision and memory.
  const std::map<std::string, std::string> prec_aliases = {
      {"float32", "fp32"}, {"bfloat16", "bf16"}, {"fp16", "fp16"}};
  if (auto v = r.take("precision"))
    assign(ctx, "precision", *v, [&] {
      c.precision = as_enum(ctx, *v, {"auto", "fp32", "bf16"}, prec_aliases);
    });
  if (auto v = r.take("dtype"))  // torchtune
    assign(ctx, "precision", *v, [&] {
      c.precision = as_enum(ctx, *v, {"fp32", "bf16"}, prec_aliases);
    });
  if (auto v = r.take("bf16"))  // axolotl: true | false | auto
    assign(ctx, "precision", *v, [&] {
      if (v->value.IsScalar() && v->value.Scalar() == "auto")
        c.precision = "auto";
      else
        c.precision = as_bool(ctx, *v) ? "bf16" : "fp32";
    });
  if (auto v = r.take("fp16"); v && as_bool(ctx, *v))
    bad_input("{}: fp16 training is not supported; use 'precision: bf16'", where(ctx, *v));
  if (c.precision == "fp16") bad_input("{}: fp16 training is not supported; use bf16", ctx.source);
  if (auto v = r.take("activation_checkpointing"))
    assign(ctx, "activation_checkpointing", *v, [&] {
      bool b;
      if (v->value.IsScalar() && v->value.Tag() != "!" && YAML::convert<bool>::decode(v->value, b))
        c.activation_checkpointing = b ? "full" : "none";
      else
        c.activation_checkpointing = as_enum(ctx, *v, {"none", "full", "selective"});
    });
  if (auto v = r.take("recompute_layers"))
    assign(ctx, "recompute_layers", *v, [&] {
      c.recompute_layers = as_int(ctx, *v);
      if (c.recompute_layers < -1)
        bad_input("{}: recompute_layers must be -1 (every layer) or a layer count, found {}",
                  where(ctx, *v), c.recompute_layers);
    });
  for (const char* k : {"gradient_checkpointing", "enable_activation_checkpointing"})
    if (auto v = r.take(k))
      assign(ctx, "activation_checkpointing", *v,
             [&] { c.activation_checkpointing = as_bool(ctx, *v) ? "full" : "none"; });
  if (auto v = r.take("strategy"))
    c.strategy =
        as_enum(ctx, *v, {"auto", "ddp", "sharded"}, {{"fsdp", "sharded"}, {"zero3", "sharded"}});
  if (auto v = r.take("dist")) {
    MapReader d(ctx, need_map(ctx, *v), "dist");
    if (auto x = d.take("timeout_s")) c.dist.timeout_s = as_double(ctx, *x);
    if (auto x = d.take("bucket_mb")) c.dist.bucket_mb = as_double(ctx, *x);
    if (auto x = d.take("powersgd_rank")) c.dist.powersgd_rank = as_int(ctx, *x);
    d.finish();
  }
  if (auto v = r.take("device")) {
    c.device = as_string(ctx, *v);
    if (c.device != "auto") try {
        Device::parse(c.device);
      } catch (const InputError&) {
        bad_input("{}: 'device' is '{}', which is not one of auto, cpu, cuda, cuda:N",
                  where(ctx, *v), c.device);
      }
  }
  if (auto v = r.take("max_memory")) {
    std::string s = as_string(ctx, *v);
    c.max_memory = parse_bytes(s, where(ctx, *v) + ": max_memory");
  }

  // Evaluation and saving.
  if (auto v = r.take("eval")) {
    MapReader e(ctx, need_map(ctx, *v), "eval");
    if (auto x = e.take("every"))
      assign(ctx, "eval.every", *x, [&] { c.eval.every = as_int(ctx, *x); });
    if (auto x = e.take("split"))
      assign(ctx, "eval.split", *x, [&] { c.eval.split = as_double(ctx, *x); });
    if (auto x = e.take("batches")) c.eval.batches = as_int(ctx, *x);
    if (auto x = e.take("generate")) c.eval.generate = as_int(ctx, *x);
    e.finish();
  }
  if (auto v = r.take("eval_steps"))
    assign(ctx, "eval.every", *v, [&] { c.eval.every = as_int(ctx, *v); });
  if (auto v = r.take("val_set_size"))
    assign(ctx, "eval.split", *v, [&] { c.eval.split = as_double(ctx, *v); });
  if (auto v = r.take("save")) {
    MapReader s(ctx, need_map(ctx, *v), "save");
    if (auto x = s.take("every"))
      assign(ctx, "save.every", *x, [&] { c.save.every = as_int(ctx, *x); });
    if (auto x = s.take("keep_last"))
      assign(ctx, "save.keep_last", *x, [&] { c.save.keep_last = as_int(ctx, *x); });
    s.finish();
  }
  if (auto v = r.take("save_steps"))
    assign(ctx, "save.every", *v, [&] { c.save.every = as_int(ctx, *v); });
  if (auto v = r.take("save_total_limit"))
    assign(ctx, "save.keep_last", *v, [&] { c.save.keep_last = as_int(ctx, *v); });

  if (auto v = r.take("thermal")) {
    MapReader t(ctx, need_map(ctx, *v), "thermal");
    if (auto x = t.take("pause_above_c")) c.thermal.pause_above_c = as_double(ctx, *x);
    if (auto x = t.take("resume_below_c")) c.thermal.resume_below_c = as_double(ctx, *x);
    t.finish();
  }

  if (auto v = r.take("guard")) {
    MapReader g(ctx, need_map(ctx, *v), "guard");
    if (auto x = g.take("skip_nonfinite")) c.guard.skip_nonfinite = as_bool(ctx, *x);
    if (auto x = g.take("max_skips_in_row")) c.guard.max_skips_in_row = as_int(ctx, *x);
    if (auto x = g.take("rollback_on_spike")) c.guard.rollback_on_spike = as_bool(ctx, *x);
    if (auto x = g.take("spike_window")) c.guard.spike_window = as_int(ctx, *x);
    if (auto x = g.take("spike_warmup")) c.guard.spike_warmup = as_int(ctx, *x);
    if (auto x = g.take("spike_k")) c.guard.spike_k = as_double(ctx, *x);
    if (auto x = g.take("spike_loss_ratio")) c.guard.spike_loss_ratio = as_double(ctx, *x);
    if (auto x = g.take("spike_grad_ratio")) c.guard.spike_grad_ratio = as_double(ctx, *x);
    if (auto x = g.take("max_rollbacks")) c.guard.max_rollbacks = as_int(ctx, *x);
    if (auto x = g.take("replica_check_every")) c.guard.replica_check_every = as_int(ctx, *x);
    if (auto x = g.take("verify_checkpoints")) c.guard.verify_checkpoints = as_bool(ctx, *x);
    g.finish();
  }
  if (auto v = r.take("inject")) {
    // One spec or a list of them; each is checked here so a typo stops the run before it starts.
    std::vector<Item> items;
    if (v->value.IsSequence()) {
      for (size_t i = 0; i < v->value.size(); ++i)
        items.push_back({fmt::format("inject.{}", i), v->value[i], v->line, v->from_override});
    } else {
      items.push_back(*v);
    }
    for (const auto& it : items) {
      std::string spec = as_string(ctx, it);
      check_injection_spec(spec, where(ctx, it) + ": '" + it.path + "'");
      c.inject.push_back(spec);
    }
  }

  // The rest.
  if (auto v = r.take("seed")) {
    int64_t s = as_int(ctx, *v);
    if (s < 0) bad_input("{}: 'seed' must be 0 or more, found {}", where(ctx, *v), s);
    c.seed = uint64_t(s);
  }
  if (auto v = r.take("deterministic")) c.deterministic = as_bool(ctx, *v);
  if (auto v = r.take("output_dir")) c.output_dir = as_string(ctx, *v);
  if (auto v = r.take("resume")) {
    assign(ctx, "resume", *v, [&] {
      bool b;
      if (v->value.IsScalar() && v->value.Tag() != "!" && YAML::convert<bool>::decode(v->value, b))
        c.resume = b ? "auto" : "never";
      else
        c.resume = as_string(ctx, *v);
    });
  }
  if (auto v = r.take("resume_from_checkpoint"))
    assign(ctx, "resume", *v, [&] { c.resume = as_string(ctx, *v); });
  if (auto v = r.take("auto_resume_from_checkpoints"))
    assign(ctx, "resume", *v, [&] { c.resume = as_bool(ctx, *v) ? "auto" : "never"; });
  r.finish();

  if (load_4bit) {
    if (c.method == "lora") c.method = "qlora";
    if (c.method == "full")
      bad_input(
          "{}: 'load_in_4bit' needs 'adapter: qlora' (4-bit base weights cannot be trained "
          "directly)",
          where(ctx, *load_4bit_item));
  }
  return c;
}

}  // namespace

TrainConfig parse_train_config(const std::string& text, const std::string& source,
                               const std::vector<std::string>& overrides) {
  // Every string of a config ends up in config.json and the hash: it must be UTF-8.
  size_t bad = 0;
  if (!utf8_valid(text, &bad)) {
    const size_t line = size_t(std::count(text.begin(), text.begin() + long(bad), '\n')) + 1;
    const size_t bol = text.rfind('\n', bad == 0 ? 0 : bad - 1);
    const size_t col = bad - (bol == std::string::npos || bad == 0 ? 0 : bol + 1) + 1;
    bad_input("{}:{}:{}: not valid UTF-8", source, line, col);
  }
  for (const auto& o : overrides)
    if (!utf8_valid(o)) bad_input("{}: --set '{}': not valid UTF-8", source, o);
  Ctx ctx;
  ctx.source = source;
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    bad_input("{}:{}:{}: YAML syntax error: {}", source, e.mark.line + 1, e.mark.column + 1, e.msg);
  }
  if (root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) bad_input("{}: expected a mapping of keys at the top level", source);
  for (const auto& o : overrides) apply_override(root, o, source, ctx.override_paths);
  TrainConfig c = parse_root(ctx, root);
  c.validate();
  return c;
}

TrainConfig load_train_config(const std::string& path, const std::vector<std::string>& overrides) {
  return parse_train_config(read_file(path), path, overrides);
}

}  // namespace rig
