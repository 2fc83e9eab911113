#include "rig/train/train_config_schema.h"

#include <algorithm>
#include <map>

namespace rig {

namespace {

// The order of the keys is the order of the reference page; within a mapping it is also the
// order "did you mean" weighs equally close names in.
std::vector<ConfigSection> make_sections() {
  // Long on purpose: one table, an entry per config key.
  return {
      {.title = "Model",
       .keys =
           {
               {.name = "model",
                .type = "path",
                .default_text = "none",
                .aliases = {{"base_model"}},
                .doc =
                    "Hugging Face model folder: `config.json` and `model.safetensors` (or shards "
                    "with `model.safetensors.index.json`)."},
               {.name = "init",
                .type = "`pretrained` | `random`",
                .default_yaml = "pretrained",
                .doc = "`random` initialises the weights instead of loading them (demo, tests, "
                       "benchmarks). With `qlora` the 4-bit weights are drawn straight as codes "
                       "(uniform NF4 indices, block scales near those of normal(0, 0.02) blocks), "
                       "byte by byte from the seed: no float copy is made, and sharded ranks draw "
                       "only their own bytes (a 70B model starts in seconds)."},
               {.name = "architecture",
                .type = "name or mapping",
                .default_text = "none",
                .doc =
                    "With `init: random`: a built-in shape of the model catalogue "
                    "(`src/rig/model/catalog.cpp`: `tiny`, `llama2-7b`, `llama3-8b`, "
                    "`llama3.1-8b`, `llama3-70b`, `llama3-1b` (also `llama3.2-1b`), `llama3-3b` "
                    "(`llama3.2-3b`), `qwen2.5-0.5b`/`7b`/`14b`/`32b`/`72b`, "
                    "`qwen3-0.6b`/`1.7b`/`4b`/`8b`/`14b`/`32b`, `mistral-7b`) or an "
                    "inline `config.json` mapping (`{model_type: llama, hidden_size: 256, ...}`), "
                    "checked like a config.json. Without it, `init: random` takes the shape from "
                    "`model`'s config.json. Not allowed with `init: pretrained`."},
               {.name = "method",
                .type = "`full` | `lora` | `qlora`",
                .default_yaml = "full",
                .aliases = {{"adapter", "`lora` or `qlora`; axolotl: no adapter means full"},
                            {"load_in_4bit",
                             "`true` with `adapter: lora` means `qlora`: NF4 with double "
                             "quantization, blocks of 64"},
                            {"load_in_8bit", "`true` is rejected"}},
                .doc = "What is trained: every weight; LoRA adapters on frozen bf16 weights; LoRA "
                       "adapters on frozen NF4 (4-bit) weights. With `qlora`, `model` may be a "
                       "bitsandbytes 4-bit folder (`quantization_config` in its config.json, as "
                       "transformers saves one; loaded as it is) or a bf16/fp16/fp32 folder, whose "
                       "decoder linear weights are then quantized while loading, one tensor at a "
                       "time, exactly as bitsandbytes would (NF4, blocks of 64, double "
                       "quantization, as axolotl's and transformers' QLoRA defaults); embeddings, "
                       "norms and `lm_head` stay unquantized. `rig quantize` writes the 4-bit "
                       "folder once for reuse. A 4-bit folder with `full` or `lora` is an error. "
                       "With `strategy: sharded` the 4-bit weights and their quantization state "
                       "are sharded across ranks and gathered per layer, in bf16 or float32 "
                       "compute. See `docs/qlora.md`."},
           }},
      {.title = "LoRA (`lora:`), used when `method` is `lora` or `qlora`",
       .keys =
           {
               {.name = "lora.r",
                .type = "integer ≥ 1",
                .default_yaml = "16",
                .aliases = {{"lora_r"}},
                .doc = "Adapter rank."},
               {.name = "lora.alpha",
                .type = "number > 0",
                .default_yaml = "32",
                .aliases = {{"lora_alpha"}},
                .doc = "Scale numerator: the adapter output is multiplied by alpha/r."},
               {.name = "lora.dropout",
                .type = "number in [0, 1)",
                .default_yaml = "0",
                .aliases = {{"lora_dropout"}},
                .doc = "Dropout on the adapter input."},
               {.name = "lora.targets",
                .type = "list",
                .default_yaml = "[q_proj, k_proj, v_proj, o_proj]",
                .aliases = {{"lora.target_modules"},
                            {"lora_target_modules"},
                            {"lora_target_linear", "`true` selects all seven"}},
                .doc = "Which linear layers get adapters: any of `q_proj k_proj v_proj o_proj "
                       "gate_proj up_proj down_proj`, or `all-linear`."},
               {.name = "lora.rslora",
                .type = "boolean",
                .default_yaml = "false",
                .aliases = {{"lora.use_rslora"}, {"peft_use_rslora"}, {"use_rslora"}},
                .doc = "Rank-stabilised scale alpha/√r."},
           }},
      {.title = "Data",
       .keys =
           {
               {.name = "datasets",
                .type = "list",
                .default_text = "required",
                .doc = "One or more datasets, mixed in order. An item is a mapping below or just a "
                       "path."},
               {.name = "datasets.N.path",
                .type = "path",
                .default_text = "required",
                .doc = "A JSONL file (alpaca, chat, tokens) or a text file (text)."},
               {.name = "datasets.N.format",
                .type = "`alpaca` | `chat` | `text` | `tokens`",
                .default_yaml = "alpaca",
                .aliases = {{"datasets.N.type",
                             "axolotl: `chat_template`→chat, `completion`→text"}},
                .doc = "`alpaca`: `{instruction, input, output}` records. `chat`: `{messages: "
                       "[{role, content}]}` records. `text`: raw text for continued pre-training. "
                       "`tokens`: `{input_ids: [...]}` already tokenised."},
               {.name = "datasets.N.template",
                .type = "`auto` | `alpaca` | `llama3` | `chatml`",
                .aliases = {{"datasets.N.chat_template"}},
                .doc =
                    "How records become text. `auto` (chat): the model's own Jinja chat template "
                    "from the `tokenizer_config.json` (or `chat_template.jinja`) beside "
                    "`tokenizer.json`, rendered as transformers' `apply_chat_template` does, the "
                    "assistant turns trained; without one, `llama3` or `chatml` by the "
                    "tokenizer's control tokens. Default for chat is `auto`, for alpaca `alpaca`, "
                    "or the top-level `chat_template`. Not used with text and tokens."},
               {.name = "chat_template",
                .type = "as above",
                .default_text = "none",
                .doc = "Default template for every alpaca/chat dataset without its own (axolotl)."},
               {.name = "tokenizer",
                .type = "path",
                .default_text = "the model folder",
                .aliases = {{"tokenizer_config"}},
                .doc = "A `tokenizer.json`, or a folder holding one. Required with `init: random` "
                       "and no `model`, unless every dataset is `tokens`."},
               {.name = "sequence_len",
                .type = "integer ≥ 1",
                .default_yaml = "2048",
                .aliases = {{"max_seq_len"}},
                .doc = "Tokens per sequence; longer examples are truncated."},
               {.name = "packing",
                .type = "boolean",
                .default_yaml = "true",
                .aliases = {{"sample_packing"}},
                .doc = "Pack several examples into one sequence (attention does not cross example "
                       "boundaries; `rig bench train --packed N` measures its speed)."},
               {.name = "train_on_inputs",
                .type = "boolean",
                .default_yaml = "false",
                .doc = "Also train on prompt tokens (instruction, user turns); by default only "
                       "responses count in the loss."},
           }},
      {.title = "Batch and length",
       .keys =
           {
               {.name = "micro_batch_size",
                .type = "integer ≥ 1",
                .default_yaml = "1",
                .aliases = {{"batch_size", "torchtune"}},
                .doc = "Sequences per forward/backward on each GPU."},
               {.name = "gradient_accumulation_steps",
                .type = "integer ≥ 1",
                .default_yaml = "1",
                .doc = "Micro-batches per optimizer step. Global batch = micro_batch_size × "
                       "gradient_accumulation_steps × GPUs."},
               {.name = "max_steps",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .doc = "Optimizer steps to run; when > 0 it wins over `num_epochs`."},
               {.name = "num_epochs",
                .type = "number ≥ 0",
                .default_yaml = "1",
                .aliases = {{"epochs"}},
                .doc = "Passes over the training data, when `max_steps` is 0 (fractions allowed)."},
           }},
      {.title = "Optimizer (`optimizer:`)",
       .keys =
           {
               {.name = "optimizer.name",
                .type = "`adamw` | `adamw8bit`",
                .default_yaml = "adamw",
                .doc = "AdamW with fp32 or 8-bit block-quantised moments (bitsandbytes' blockwise "
                       "scheme: one byte per moment, a code into its dynamic map, signed for m and "
                       "unsigned for v, and one fp32 absmax per 256 elements; the update itself in "
                       "fp32; state ≈ ¼ of fp32's; `docs/qlora.md`). `optimizer: NAME` as a plain "
                       "string also works, with axolotl's names (`adamw_torch`, "
                       "`adamw_torch_fused`, `adamw_bnb_8bit`, `paged_adamw_8bit`, ...). "
                       "With `strategy: sharded` each rank keeps the 8-bit moments of its own "
                       "shard (blocks of 256 never split between ranks, so the update equals one "
                       "rank's; `docs/distributed.md`)."},
               {.name = "optimizer.min_8bit_size",
                .type = "integer",
                .default_yaml = "4096",
                .doc = "`adamw8bit`: tensors with fewer elements (norms, biases, small adapters) "
                       "keep fp32 moments, as bitsandbytes does."},
               {.name = "optimizer.lr",
                .type = "number > 0",
                .default_yaml = "2e-4",
                .aliases = {{"learning_rate"}},
                .doc = "Peak learning rate."},
               {.name = "optimizer.betas",
                .type = "[b1, b2] each in [0, 1)",
                .default_yaml = "[0.9, 0.999]",
                .aliases = {{"adam_beta1", "b1"}, {"adam_beta2", "b2"}},
                .doc = "AdamW's moment decay rates."},
               {.name = "optimizer.eps",
                .type = "number > 0",
                .default_yaml = "1e-8",
                .aliases = {{"adam_epsilon"}},
                .doc = "Added to the root of the second moment."},
               {.name = "optimizer.weight_decay",
                .type = "number ≥ 0",
                .default_yaml = "0",
                .aliases = {{"weight_decay"}},
                .doc = "Decoupled weight decay."},
               {.name = "optimizer.no_decay_on_norms_and_biases",
                .type = "boolean",
                .default_yaml = "true",
                .doc = "Exempt RMSNorm weights and biases from weight decay, as Hugging Face's "
                       "Trainer does."},
           }},
      {.title = "Schedule (`schedule:`)",
       .keys =
           {
               {.name = "schedule.name",
                .type = "`constant` | `linear` | `cosine`",
                .default_yaml = "cosine",
                .aliases = {{"lr_scheduler", "`constant_with_warmup` = constant"}},
                .doc = "Shape after warm-up; the same formulas as Hugging Face's "
                       "`get_*_schedule_with_warmup`."},
               {.name = "schedule.warmup_steps",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .aliases = {{"warmup_steps"}},
                .doc = "Linear warm-up from 0 over this many optimizer steps; must be less than "
                       "`max_steps`."},
               {.name = "schedule.min_lr_ratio",
                .type = "number in [0, 1]",
                .default_yaml = "0",
                .aliases = {{"cosine_min_lr_ratio"}},
                .doc = "Where linear and cosine end, as a fraction of the peak."},
           }},
      {.title = "Numerics and memory",
       .keys =
           {
               {.name = "max_grad_norm",
                .type = "number ≥ 0",
                .default_yaml = "1.0",
                .doc = "Clip the global gradient norm to this; 0 turns clipping off."},
               {.name = "precision",
                .type = "`auto` | `fp32` | `bf16`",
                .default_yaml = "auto",
                .aliases = {{"dtype", "torchtune"},
                            {"bf16", "`true`, `false` or `auto`; axolotl"},
                            {"fp16", "`true` is rejected"}},
                .doc = "Compute precision; `auto` is bf16 on CUDA and fp32 on the CPU backend "
                       "(which only does fp32, so `bf16` with `device: cpu` is an error)."},
               {.name = "activation_checkpointing",
                .type = "`none` | `full` | `selective`",
                .default_yaml = "none",
                .aliases = {{"gradient_checkpointing", "boolean"},
                            {"enable_activation_checkpointing", "boolean"}},
                .doc = "What each layer keeps from its forward for its backward. `none`: "
                       "everything the backward reads. `selective`: the outputs of the matrix "
                       "products and attention; the two RMSNorm outputs and SwiGLU are recomputed "
                       "in backward (cheap element-wise work, no extra matrix products). `full`: "
                       "the layer's input only; the whole forward runs again in backward. "
                       "Activations that no backward product reads (the input of a frozen "
                       "projection without LoRA) are never kept. `true`/`false` mean full/none. "
                       "`rig plan --checkpointing` predicts each mode's memory."},
               {.name = "recompute_layers",
                .type = "integer",
                .default_yaml = "-1",
                .doc =
                    "With `full`: how many layers, from the first, recompute their forward; the "
                    "others run `selective`. Spends the memory full checkpointing leaves free on "
                    "less recompute (`rig plan --recompute-layers N` shows the memory, `rig "
                    "bench train --recompute-layers N` the speed). `-1`: every layer."},
               {.name = "strategy",
                .type = "`auto` | `ddp` | `sharded`",
                .default_yaml = "auto",
                .doc =
                    "With several ranks (`rig train --nproc-per-node N`, torchrun, srun): "
                    "replicate the model and sum gradients (`ddp`), or keep 1/N of every weight, "
                    "gradient and optimizer moment per rank and gather a layer's weights only "
                    "while it runs (`sharded`, ZeRO-3/FSDP style; QLoRA's 4-bit weights too). "
                    "`auto` is ddp; a single process ignores it. `fsdp` and `zero3` mean "
                    "`sharded`. Both take `precision: bf16` (sharded: float32 master shards, bf16 "
                    "compute copies made per gathered layer). More ranks than GPUs share them "
                    "(collectives through Gloo in host memory). See "
                    "[distributed.md](distributed.md)."},
               {.name = "dist.timeout_s",
                .type = "number > 0",
                .default_yaml = "600",
                .doc = "How long a rank waits in one collective (and at start-up for the others to "
                       "join) before it fails naming the rank that did not take part. A dead rank "
                       "is noticed at once; this bounds a hung one. Not part of the config hash."},
               {.name = "dist.bucket_mb",
                .type = "number > 0",
                .default_yaml = "25",
                .doc = "Data-parallel gradient bucket size in MiB: a bucket's all-reduce starts as "
                       "soon as the backward pass has filled it. Not part of the config hash."},
               {.name = "dist.powersgd_rank",
                .type = "integer 0-64",
                .default_yaml = "0",
                .doc = "Data-parallel only: compress the gradients of weight matrices to this rank "
                       "with PowerSGD (one warm-started power iteration, error feedback), sending "
                       "(rows + columns) x rank numbers instead of rows x columns. 0 sends them "
                       "exact. Lossy: the run no longer equals a 1-rank run; see "
                       "[distributed.md](distributed.md)."},
               {.name = "device",
                .type = "`auto` | `cpu` | `cuda` | `cuda:N`",
                .default_yaml = "auto",
                .doc = "`auto`: CUDA when a GPU is present, else the CPU."},
               {.name = "max_memory",
                .type = "size",
                .default_text = "none",
                .doc = "A per-device memory budget (`22GiB`, `16GB`, bytes), so a big GPU behaves "
                       "like a smaller card. It bounds the bytes rig reserves from the device "
                       "(tensors, rounding and cached free blocks: past the budget the cache is "
                       "given back before anything new is reserved); allocations past it fail with "
                       "the tensor named. The CUDA context and the libraries' own memory come on "
                       "top: leave about 1 GiB for them (measured in `docs/cuda-backend.md`). "
                       "Ranks sharing a GPU through CUDA IPC keep a 32 MiB staging buffer each, "
                       "taken off this budget; with none set, ranks sharing a GPU each get an "
                       "even share of it less 1 GiB for their context. At the start `train.log` "
                       "gives `rig plan`'s "
                       "predicted peak beside it, and a job predicted over it is warned about "
                       "before its first step."},
           }},
      {.title = "Evaluation (`eval:`) and saving (`save:`)",
       .keys =
           {
               {.name = "eval.every",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .aliases = {{"eval_steps"}},
                .doc = "Optimizer steps between evaluations; 0 evaluates only at the end. Needs "
                       "`eval.split` > 0."},
               {.name = "eval.split",
                .type = "number in [0, 1)",
                .default_yaml = "0",
                .aliases = {{"val_set_size", "a fraction; axolotl's absolute counts are rejected"}},
                .doc = "Fraction of the data held out for evaluation; 0 means no evaluation."},
               {.name = "eval.batches",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .doc = "Micro-batches per evaluation; 0 uses the whole held-out set."},
               {.name = "eval.generate",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .doc = "Held-out samples whose response is generated greedily (from the prompt up "
                       "to the first trained token) at every evaluation; reported as "
                       "`eval_exact_match`, the fraction generated exactly."},
               {.name = "save.every",
                .type = "integer ≥ 0",
                .default_yaml = "0",
                .aliases = {{"save_steps"}},
                .doc = "Optimizer steps between checkpoints; 0 saves only at the end."},
               {.name = "save.keep_last",
                .type = "integer ≥ 0",
                .default_yaml = "3",
                .aliases = {{"save_total_limit"}},
                .doc = "Complete checkpoints kept; older ones are deleted after a new one is "
                       "complete. 0 keeps all."},
           }},
      {.title = "Temperature (`thermal:`)",
       .keys =
           {
               {.name = "thermal.pause_above_c",
                .type = "number ≥ 0",
                .default_yaml = "0",
                .doc = "Pause training (between steps) while the hottest GPU reported by NVML is "
                       "above this temperature; 0 never pauses. Every metrics line carries the "
                       "GPUs' `max_temp_c`, power and throttle flags when NVML is present."},
               {.name = "thermal.resume_below_c",
                .type = "number ≥ 0",
                .default_yaml = "0",
                .doc = "Resume once every GPU is below this; 0 means 8 °C under "
                       "`thermal.pause_above_c`."},
           }},
      {.title = "Guard (`guard:`) and fault injection",
       .intro = "The training guard watches every step and every checkpoint; all of it is on by "
                "default, because a\nbox of consumer GPUs has no ECC, and a bit flip or a bad "
                "batch found thousands of steps later costs\nmore than the checks (a pass over the "
                "gradients per step, a pass over the weights every\n`replica_check_every` steps). "
                "[reliability.md](reliability.md) has the rules, what each fault\ncosts, and the "
                "table the tests measure.",
       .keys =
           {
               {.name = "guard.skip_nonfinite",
                .type = "boolean",
                .default_yaml = "true",
                .doc =
                    "Before the optimizer touches anything, check the gradients (and the loss) "
                    "for NaN/Inf; when found, skip the step: weights, AdamW moments and the "
                    "learning-rate schedule stay as they were, the batch is consumed, an `event: "
                    "skipped_step` line goes to metrics.jsonl. `false`: a non-finite step stops "
                    "the run (the last checkpoint is intact)."},
               {.name = "guard.max_skips_in_row",
                .type = "integer ≥ 1",
                .default_yaml = "5",
                .doc =
                    "That many skipped steps in a row stop the run with an error naming the "
                    "last checkpoint: one bad batch is noise, five in a row is a broken model or "
                    "learning rate that skipping will not fix."},
               {.name = "guard.rollback_on_spike",
                .type = "boolean",
                .default_yaml = "true",
                .doc =
                    "When the loss or the gradient norm spikes (rule below), go back to the last "
                    "verified checkpoint (weights, optimizer, data position, the rule's history) "
                    "and skip the batches drawn since it, as PaLM did by hand; `event: "
                    "rollback`."},
               {.name = "guard.spike_window",
                .type = "integer ≥ 3",
                .default_yaml = "100",
                .doc = "Steps of history the rule looks at: the median and the median absolute "
                       "deviation (MAD) of the last this-many healthy steps."},
               {.name = "guard.spike_warmup",
                .type = "integer, 3 to `spike_window`",
                .default_yaml = "20",
                .doc = "Steps in the history before the rule applies (the first steps of a run "
                       "move too fast to judge)."},
               {.name = "guard.spike_k",
                .type = "number > 0",
                .default_yaml = "8",
                .doc = "A value spikes when it is above the median by this many robust deviations "
                       "(1.4826 x MAD, the standard deviation of normal noise)..."},
               {.name = "guard.spike_loss_ratio",
                .type = "number ≥ 1",
                .default_yaml = "1.5",
                .doc = "...and, for the loss, above this many times the median (so a very steady "
                       "curve does not flag small moves)."},
               {.name = "guard.spike_grad_ratio",
                .type = "number ≥ 1",
                .default_yaml = "100",
                .doc = "...and, for the gradient norm, above this many times the median: gradient "
                       "norms are heavy-tailed (a healthy demo run reaches 12x), clipping already "
                       "bounds one step's update, and broken numerics are orders of magnitude."},
               {.name = "guard.max_rollbacks",
                .type = "integer ≥ 0",
                .default_yaml = "3",
                .doc = "Rollbacks per run (counted across resumes through the checkpoints); the "
                       "next one stops the run for a human to look."},
               {.name = "guard.replica_check_every",
                .type = "integer ≥ 0",
                .default_yaml = "100",
                .doc = "Every this many steps and before every checkpoint: data-parallel ranks "
                       "compare a 64-bit hash of all their parameters (a mismatch names the odd "
                       "rank and rolls every rank back), every rank scans its weights for NaN/Inf "
                       "or magnitudes above 1e8 and hashes its frozen weights against the start; "
                       "sharded ranks hash their own shards at the start and end of the step. 0 "
                       "turns these checks off."},
               {.name = "guard.verify_checkpoints",
                .type = "boolean",
                .default_yaml = "true",
                .doc = "Verify a checkpoint before resuming or rolling back to it: manifest, every "
                       "checksum, no NaN/Inf, weights below 1e8. A newest checkpoint that fails is "
                       "moved to `checkpoints/rejected-step-N` (`event: checkpoint_rejected`) and "
                       "the one before it is used."},
               {.name = "inject",
                .type = "list of `KIND@STEP[:RANK]`",
                .default_yaml = "[]",
                .doc =
                    "Faults to inject (`rig train --inject` appends to it): `nan-grad`, "
                    "`bit-flip`, `bit-flip-frozen`, `loss-spike`, `kill`, `kill-during-save`, "
                    "`corrupt-checkpoint`, at optimizer step STEP (from 1), on rank RANK "
                    "(default 0). Each fires once; `rig train --resume` does not replay the ones "
                    "the run's config.yaml records. See "
                    "[reliability.md](reliability.md#fault-injection)."},
           }},
      {.title = "Seed and run folder",
       .keys =
           {
               {.name = "seed",
                .type = "integer ≥ 0",
                .default_yaml = "42",
                .doc = "Seeds initialisation, dropout and data order."},
               {.name = "deterministic",
                .type = "boolean",
                .default_yaml = "false",
                .doc =
                    "On CUDA, pick bitwise-repeatable kernels where the fastest are not: "
                    "cuDNN's attention backward then uses its deterministic variant "
                    "(B·heads·T²·2 bytes more workspace, about 6% slower at seq 4096). rig's own "
                    "attention kernels are deterministic either way."},
               {.name = "output_dir",
                .type = "path",
                .default_yaml = "runs/run",
                .doc = "The run folder (layout below)."},
               {.name = "resume",
                .type = "`auto` | `never` | path",
                .default_yaml = "auto",
                .aliases = {{"resume_from_checkpoint", "path"},
                            {"auto_resume_from_checkpoints", "boolean"}},
                .doc = "`auto` continues from the newest complete checkpoint in `output_dir` if "
                       "there is one; `never` starts over; a path names a checkpoint folder. "
                       "`true`/`false` mean auto/never."},
           }},
  };
}

// "datasets.3.path" -> "datasets.N.path": list indices as the table writes them.
std::string schema_path(const std::string& path) {
  std::string out;
  for (size_t b = 0;;) {
    size_t dot = path.find('.', b);
    std::string part = path.substr(b, dot == std::string::npos ? dot : dot - b);
    if (b) out += '.';
    if (!part.empty() && part.find_first_not_of("0123456789") == std::string::npos)
      out += 'N';
    else
      out += part;
    if (dot == std::string::npos) return out;
    b = dot + 1;
  }
}

}  // namespace

const std::vector<ConfigSection>& config_sections() {
  static const std::vector<ConfigSection> sections = make_sections();
  return sections;
}

const std::vector<ConfigKey>& config_schema() {
  static const std::vector<ConfigKey> keys = [] {
    std::vector<ConfigKey> all;
    for (const auto& s : config_sections()) all.insert(all.end(), s.keys.begin(), s.keys.end());
    return all;
  }();
  return keys;
}

const std::vector<std::string>& config_keys_at(const std::string& prefix) {
  static const std::map<std::string, std::vector<std::string>> by_prefix = [] {
    std::map<std::string, std::vector<std::string>> m;
    auto add = [&](const std::string& name) {
      // Every mapping on the way holds the next part: "lora.r" puts "lora" at the top level.
      for (size_t b = 0;;) {
        size_t dot = name.find('.', b);
        std::string parent = b ? name.substr(0, b - 1) : "";
        std::string part = name.substr(b, dot == std::string::npos ? dot : dot - b);
        auto& v = m[parent];
        if (std::find(v.begin(), v.end(), part) == v.end()) v.push_back(part);
        if (dot == std::string::npos) break;
        b = dot + 1;
      }
    };
    for (const auto& k : config_schema()) {
      add(k.name);
      for (const auto& a : k.aliases) add(a.name);
    }
    return m;
  }();
  static const std::vector<std::string> none;
  auto it = by_prefix.find(schema_path(prefix));
  return it == by_prefix.end() ? none : it->second;
}

}  // namespace rig
