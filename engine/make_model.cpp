#include "engine/make_model.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/safetensors.h"
#include "engine/weight_quant.h"
#include "kernels/float_convert.h"

namespace pdserve {
namespace {

using nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The text BPE merges are learned from. Any fixed text works; this one is
// plain English so the merges look like real subwords.
constexpr std::string_view kCorpus =
    "The quick brown fox jumps over the lazy dog. A serving system turns prompts into tokens, "
    "and tokens into text. The router sends each request to a worker that already holds the "
    "prefix of its prompt in the cache, so that the prefill is short and the first token comes "
    "back fast. Prefill workers compute the attention keys and values of a prompt; decode "
    "workers generate one token at a time for many requests at once. The blocks of the cache "
    "move between the workers over the network, and the router keeps an index of which worker "
    "holds which block. When the cache is full, the least recently used blocks are evicted. "
    "Hello, world! How are you today? I am fine, thank you. What is the capital of France? "
    "The capital of France is Paris. Once upon a time there was a little model that wanted to "
    "learn how to speak. It read many books and wrote many stories, and in the end it could "
    "answer questions about the weather, the time, the river and the mountains. Numbers like "
    "1, 2, 3, 10, 100 and 2024 appear in text too. The engine schedules requests in the order "
    "they arrive, batches them together, and preempts the newest one when memory runs out. "
    "Every step mixes prefill chunks with decode tokens under a budget of tokens per step. "
    "She said that they would be there in the morning, but nobody came until the evening. "
    "We should write tests that fail when the code is wrong, and measure what is fast.";

// GPT-2's reversible byte -> printable unicode mapping, as UTF-8 strings.
std::vector<std::string> ByteSymbols() {
  std::vector<int> cps(256, -1);
  for (int b = '!'; b <= '~'; ++b) cps[b] = b;
  for (int b = 0xA1; b <= 0xAC; ++b) cps[b] = b;
  for (int b = 0xAE; b <= 0xFF; ++b) cps[b] = b;
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    if (cps[b] < 0) cps[b] = 256 + n++;
  }
  std::vector<std::string> out(256);
  for (int b = 0; b < 256; ++b) {
    const int cp = cps[b];
    std::string s;
    if (cp < 0x80) {
      s.push_back(static_cast<char>(cp));
    } else {
      s.push_back(static_cast<char>(0xC0 | (cp >> 6)));
      s.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
    out[b] = s;
  }
  return out;
}

// Splits text roughly as the GPT-2 pattern does: an optional leading space
// followed by a run of letters, of digits or of other symbols.
std::vector<std::string> PreTokenize(std::string_view text) {
  auto kind = [](unsigned char c) {
    if (std::isalpha(c)) return 0;
    if (std::isdigit(c)) return 1;
    if (std::isspace(c)) return 2;
    return 3;
  };
  std::vector<std::string> words;
  size_t i = 0;
  while (i < text.size()) {
    size_t j = i;
    if (text[j] == ' ' && j + 1 < text.size() && kind(text[j + 1]) != 2) ++j;
    const int k = kind(static_cast<unsigned char>(text[j]));
    ++j;
    while (j < text.size() && kind(static_cast<unsigned char>(text[j])) == k) ++j;
    words.emplace_back(text.substr(i, j - i));
    i = j;
  }
  return words;
}

struct Bpe {
  std::vector<std::string> vocab;  // id -> symbol string (byte-mapped)
  std::vector<std::pair<int, int>> merges;
};

Bpe LearnBpe(int64_t num_merges) {
  const auto bytes = ByteSymbols();
  Bpe bpe;
  bpe.vocab = bytes;
  std::map<std::string, int64_t> word_counts;
  for (const auto& w : PreTokenize(kCorpus)) ++word_counts[w];
  std::vector<std::pair<std::vector<int>, int64_t>> words;
  for (const auto& [w, n] : word_counts) {
    std::vector<int> ids;
    for (unsigned char c : w) ids.push_back(c);
    words.emplace_back(std::move(ids), n);
  }
  std::set<std::string> known(bytes.begin(), bytes.end());
  while (static_cast<int64_t>(bpe.merges.size()) < num_merges) {
    std::map<std::pair<int, int>, int64_t> pairs;
    for (const auto& [ids, n] : words) {
      for (size_t i = 0; i + 1 < ids.size(); ++i) pairs[{ids[i], ids[i + 1]}] += n;
    }
    // Most frequent pair; ties go to the smallest (left, right) ids.
    std::pair<int, int> best{-1, -1};
    int64_t best_count = 1;
    for (const auto& [p, n] : pairs) {
      if (n > best_count) {
        best = p;
        best_count = n;
      }
    }
    if (best.first < 0) break;  // every remaining pair occurs once: stop learning
    const int id = static_cast<int>(bpe.vocab.size());
    bpe.vocab.push_back(bpe.vocab[best.first] + bpe.vocab[best.second]);
    known.insert(bpe.vocab.back());
    bpe.merges.push_back(best);
    for (auto& [ids, n] : words) {
      std::vector<int> merged;
      for (size_t i = 0; i < ids.size(); ++i) {
        if (i + 1 < ids.size() && ids[i] == best.first && ids[i + 1] == best.second) {
          merged.push_back(id);
          ++i;
        } else {
          merged.push_back(ids[i]);
        }
      }
      ids = std::move(merged);
    }
  }
  // The text ran out of repeated pairs: extend with learned tokens followed
  // by a lowercase letter, in id order, so that every preset gets its size.
  for (int left = 256; static_cast<int64_t>(bpe.merges.size()) < num_merges; ++left) {
    for (int c = 'a'; c <= 'z' && static_cast<int64_t>(bpe.merges.size()) < num_merges; ++c) {
      const std::string s = bpe.vocab[left] + bpe.vocab[c];
      if (known.count(s)) continue;
      known.insert(s);
      bpe.vocab.push_back(s);
      bpe.merges.emplace_back(left, c);
    }
  }
  return bpe;
}

// The special tokens, BOS, EOS and chat template of each chat format
// (ModelSpec::chat_format), in the shape each family's tokenizer has them.
struct ChatShape {
  const char* specials[5];
  int bos;                      // index into specials; -1: no BOS token (ChatML)
  int eos;                      // tokenizer_config.json's eos_token
  std::vector<int> config_eos;  // config.json and generation_config.json
  const char* chat_template;
};

const ChatShape& ShapeOf(ChatFormat format) {
  static const ChatShape kLlama3{
      {"<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
       "<|eot_id|>"},
      0,
      4,
      {1, 4},
      "{{ bos_token }}{% for message in messages %}"
      "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + "
      "message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
      "{% endif %}"};
  // Gemma: turns of "user" and "model" (the assistant), no system turn of
  // its own (it is sent as a user turn here).
  static const ChatShape kGemma{
      {"<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"},
      2,
      1,
      {1, 4},
      "{{ bos_token }}{% for message in messages %}"
      "{% if message['role'] == 'assistant' %}{% set role = 'model' %}"
      "{% else %}{% set role = 'user' %}{% endif %}"
      "{{ '<start_of_turn>' + role + '\\n' + message['content'] | trim + '<end_of_turn>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"};
  // Mistral: each user turn in [INST] ... [/INST], each answer closed by </s>.
  static const ChatShape kMistral{
      {"<unk>", "<s>", "</s>", "[INST]", "[/INST]"},
      1,
      2,
      {2},
      "{{ bos_token }}{% for message in messages %}"
      "{% if message['role'] == 'assistant' %}{{ ' ' + message['content'] | trim + eos_token }}"
      "{% else %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}{% endif %}"
      "{% endfor %}"};
  // ChatML as Qwen writes it: no BOS, every turn between <|im_start|>role
  // and <|im_end|>.
  static const ChatShape kChatMl{
      {"<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>"},
      -1,
      2,
      {2, 0},
      "{% for message in messages %}"
      "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
      "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"};
  switch (format) {
    case ChatFormat::kGemma:
      return kGemma;
    case ChatFormat::kMistral:
      return kMistral;
    case ChatFormat::kChatMl:
      return kChatMl;
    case ChatFormat::kLlama3:
      break;
  }
  return kLlama3;
}

ordered_json TokenizerJson(const Bpe& bpe, const ChatShape& shape) {
  const int base = static_cast<int>(bpe.vocab.size());
  ordered_json added = ordered_json::array();
  for (int i = 0; i < 5; ++i) {
    added.push_back({{"id", base + i},
                     {"content", shape.specials[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  ordered_json vocab = ordered_json::object();
  for (size_t i = 0; i < bpe.vocab.size(); ++i) vocab[bpe.vocab[i]] = i;
  ordered_json merges = ordered_json::array();
  for (const auto& [l, r] : bpe.merges) merges.push_back(bpe.vocab[l] + " " + bpe.vocab[r]);
  ordered_json byte_level = {{"type", "ByteLevel"},
                             {"add_prefix_space", false},
                             {"trim_offsets", true},
                             {"use_regex", true}};
  // No BOS: the post-processor only adjusts offsets, as Qwen's does.
  ordered_json post = byte_level;
  if (shape.bos >= 0) {
    const std::string bos = shape.specials[shape.bos];
    const int bos_id = base + shape.bos;
    post = {{"type", "TemplateProcessing"},
            {"single",
             {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair",
             {{{"SpecialToken", {{"id", bos}, {"type_id", 0}}}},
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  }
  return ordered_json{{"version", "1.0"},
                      {"truncation", nullptr},
                      {"padding", nullptr},
                      {"added_tokens", added},
                      {"normalizer", nullptr},
                      {"pre_tokenizer", byte_level},
                      {"post_processor", post},
                      {"decoder", byte_level},
                      {"model",
                       {{"type", "BPE"},
                        {"dropout", nullptr},
                        {"unk_token", nullptr},
                        {"continuing_subword_prefix", nullptr},
                        {"end_of_word_suffix", nullptr},
                        {"fuse_unk", false},
                        {"byte_fallback", false},
                        {"ignore_merges", false},
                        {"vocab", vocab},
                        {"merges", merges}}}};
}

// splitmix64: a tiny, well-mixed generator; identical on every platform.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  double Uniform() { return static_cast<double>(Next() >> 11) * 0x1.0p-52 - 1.0; }

 private:
  uint64_t state_;
};

uint64_t NameHash(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

struct TensorPlan {
  std::string name;
  std::vector<int64_t> shape;
  // kNorm: 1 + 0.1 u; kNormOffset: 0.1 u (Gemma's norms add the 1).
  enum Kind { kUniform, kNorm, kNormOffset } kind = kUniform;
  double std = 0;         // target standard deviation of the uniform values
  bool keep_f32 = false;  // stored fp32 whatever the model's dtype
};

double FanIn(int64_t n) { return 1.0 / std::sqrt(static_cast<double>(n)); }

// DeepseekV2Attention / DeepseekV3Attention's tensors (multi-head latent
// attention), named and shaped as the modeling code declares them.
void PlanMlaAttention(const ModelConfig& c, const std::string& p, std::vector<TensorPlan>* plan) {
  const int64_t H = c.hidden_size, nh = c.num_heads;
  const int64_t qk = c.qk_nope_head_dim + c.qk_rope_head_dim;
  const int64_t latent = c.kv_lora_rank, rope = c.qk_rope_head_dim;
  const std::string a = p + "self_attn.";
  // A gain of 2 on queries sharpens attention so positions matter.
  if (c.q_lora_rank > 0) {
    plan->push_back({a + "q_a_proj.weight", {c.q_lora_rank, H}, TensorPlan::kUniform, FanIn(H)});
    if (c.qkv_bias) {
      plan->push_back({a + "q_a_proj.bias", {c.q_lora_rank}, TensorPlan::kUniform, 0.1});
    }
    plan->push_back({a + "q_a_layernorm.weight", {c.q_lora_rank}, TensorPlan::kNorm, 0});
    plan->push_back({a + "q_b_proj.weight",
                     {nh * qk, c.q_lora_rank},
                     TensorPlan::kUniform,
                     2 * FanIn(c.q_lora_rank)});
  } else {
    plan->push_back({a + "q_proj.weight", {nh * qk, H}, TensorPlan::kUniform, 2 * FanIn(H)});
  }
  plan->push_back(
      {a + "kv_a_proj_with_mqa.weight", {latent + rope, H}, TensorPlan::kUniform, FanIn(H)});
  if (c.qkv_bias) {
    plan->push_back({a + "kv_a_proj_with_mqa.bias", {latent + rope}, TensorPlan::kUniform, 0.1});
  }
  plan->push_back({a + "kv_a_layernorm.weight", {latent}, TensorPlan::kNorm, 0});
  plan->push_back({a + "kv_b_proj.weight",
                   {nh * (c.qk_nope_head_dim + c.v_head_dim), latent},
                   TensorPlan::kUniform,
                   FanIn(latent)});
  plan->push_back({a + "o_proj.weight",
                   {H, nh * c.v_head_dim},
                   TensorPlan::kUniform,
                   FanIn(nh * c.v_head_dim)});
  if (c.o_bias) plan->push_back({a + "o_proj.bias", {H}, TensorPlan::kUniform, 0.1});
}

// The weight tensors of a model with `c`'s shapes, in the order checkpoints
// list them; the multi-token-prediction layers only when asked (a written
// checkpoint has them, the engine never reads them).
std::vector<TensorPlan> PlanTensors(const ModelConfig& c, bool with_mtp_layers) {
  const int64_t H = c.hidden_size, I = c.intermediate_size, hd = c.head_dim, V = c.vocab_size;
  const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
  const double h_std = 1.0 / std::sqrt(static_cast<double>(H));
  std::vector<TensorPlan> plan;
  // Gemma scales the embeddings by sqrt(hidden): rows of rms 1 / sqrt(hidden)
  // come out of it at about 1, as in the other families.
  plan.push_back(
      {"model.embed_tokens.weight", {V, H}, TensorPlan::kUniform, c.gemma ? h_std : 1.0});
  // Gemma's norms multiply by (1 + weight): their weights are offsets.
  const TensorPlan::Kind norm = c.gemma ? TensorPlan::kNormOffset : TensorPlan::kNorm;
  // DeepSeek-V3 checkpoints store num_nextn_predict_layers multi-token-
  // prediction layers after the last one: a decoder layer plus its own
  // embedding, input norms, projection and head. The causal LM ignores them.
  const int64_t stored_layers = c.num_layers + (with_mtp_layers ? c.num_nextn_predict_layers : 0);
  for (int64_t l = 0; l < stored_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    if (l >= c.num_layers) {
      plan.push_back({p + "embed_tokens.weight", {V, H}, TensorPlan::kUniform, 1.0});
      plan.push_back({p + "enorm.weight", {H}, TensorPlan::kNorm, 0});
      plan.push_back({p + "hnorm.weight", {H}, TensorPlan::kNorm, 0});
      plan.push_back({p + "eh_proj.weight", {H, 2 * H}, TensorPlan::kUniform, FanIn(2 * H)});
      plan.push_back({p + "shared_head.norm.weight", {H}, TensorPlan::kNorm, 0});
      plan.push_back({p + "shared_head.head.weight", {V, H}, TensorPlan::kUniform, 3 * h_std});
    }
    plan.push_back({p + "input_layernorm.weight", {H}, norm, 0});
    if (c.is_mla()) {
      PlanMlaAttention(c, p, &plan);
    } else {
      // A gain of 2 on queries sharpens attention so positions matter.
      plan.push_back({p + "self_attn.q_proj.weight", {q_out, H}, TensorPlan::kUniform, 2 * h_std});
      plan.push_back({p + "self_attn.k_proj.weight", {kv_out, H}, TensorPlan::kUniform, h_std});
      plan.push_back({p + "self_attn.v_proj.weight", {kv_out, H}, TensorPlan::kUniform, h_std});
      if (c.qkv_bias) {
        plan.push_back({p + "self_attn.q_proj.bias", {q_out}, TensorPlan::kUniform, 0.1});
        plan.push_back({p + "self_attn.k_proj.bias", {kv_out}, TensorPlan::kUniform, 0.1});
        plan.push_back({p + "self_attn.v_proj.bias", {kv_out}, TensorPlan::kUniform, 0.1});
      }
      plan.push_back(
          {p + "self_attn.o_proj.weight", {H, q_out}, TensorPlan::kUniform, FanIn(q_out)});
      if (c.o_bias) plan.push_back({p + "self_attn.o_proj.bias", {H}, TensorPlan::kUniform, 0.1});
      if (c.qk_norm) {
        plan.push_back({p + "self_attn.q_norm.weight", {hd}, norm, 0});
        plan.push_back({p + "self_attn.k_norm.weight", {hd}, norm, 0});
      }
    }
    plan.push_back({p + "post_attention_layernorm.weight", {H}, norm, 0});
    if (c.gemma) {
      plan.push_back({p + "pre_feedforward_layernorm.weight", {H}, norm, 0});
      plan.push_back({p + "post_feedforward_layernorm.weight", {H}, norm, 0});
    }
    if (c.IsSparseLayer(l)) {
      const std::string b = p + (c.mixtral_names ? "block_sparse_moe." : "mlp.");
      const int64_t MI = c.moe_intermediate_size;
      // A router gain of 3 makes the routing differ between tokens.
      plan.push_back({b + "gate.weight", {c.num_experts, H}, TensorPlan::kUniform, 3 * h_std});
      if (c.moe_topk_method == kernels::MoeTopkMethod::kNoAuxTc) {
        // Large enough against sigmoid scores in (0, 1) to change choices.
        plan.push_back({b + "gate.e_score_correction_bias",
                        {c.num_experts},
                        TensorPlan::kUniform,
                        0.2,
                        /*keep_f32=*/true});
      }
      if (c.num_shared_experts > 0) {
        const int64_t SI = MI * c.num_shared_experts;
        const std::string x = b + "shared_experts.";
        plan.push_back({x + "gate_proj.weight", {SI, H}, TensorPlan::kUniform, h_std});
        plan.push_back({x + "up_proj.weight", {SI, H}, TensorPlan::kUniform, h_std});
        plan.push_back({x + "down_proj.weight", {H, SI}, TensorPlan::kUniform, FanIn(SI)});
      }
      for (int64_t e = 0; e < c.num_experts; ++e) {
        const std::string x = b + "experts." + std::to_string(e) + ".";
        const bool m = c.mixtral_names;
        plan.push_back(
            {x + (m ? "w1" : "gate_proj") + ".weight", {MI, H}, TensorPlan::kUniform, h_std});
        plan.push_back({x + (m ? "w2" : "down_proj") + ".weight",
                        {H, MI},
                        TensorPlan::kUniform,
                        1.0 / std::sqrt(static_cast<double>(MI))});
        plan.push_back(
            {x + (m ? "w3" : "up_proj") + ".weight", {MI, H}, TensorPlan::kUniform, h_std});
      }
      continue;
    }
    plan.push_back({p + "mlp.gate_proj.weight", {I, H}, TensorPlan::kUniform, h_std});
    plan.push_back({p + "mlp.up_proj.weight", {I, H}, TensorPlan::kUniform, h_std});
    plan.push_back({p + "mlp.down_proj.weight",
                    {H, I},
                    TensorPlan::kUniform,
                    1.0 / std::sqrt(static_cast<double>(I))});
    if (c.mlp_bias) {
      plan.push_back({p + "mlp.gate_proj.bias", {I}, TensorPlan::kUniform, 0.1});
      plan.push_back({p + "mlp.up_proj.bias", {I}, TensorPlan::kUniform, 0.1});
      plan.push_back({p + "mlp.down_proj.bias", {H}, TensorPlan::kUniform, 0.1});
    }
  }
  plan.push_back({"model.norm.weight", {H}, norm, 0});
  if (!c.tie_word_embeddings) {
    // Logit spread of about 3: peaked enough to be a "model", not one token.
    plan.push_back({"lm_head.weight", {V, H}, TensorPlan::kUniform, 3 * h_std});
  }

  return plan;
}

// A float tensor of `dtype` (fp32, bf16 or fp16) holding `values`, rounded.
TensorToWrite FloatTensor(std::string name, std::vector<int64_t> shape,
                          const std::vector<float>& values, DType dtype) {
  const int64_t n = static_cast<int64_t>(values.size());
  TensorToWrite t;
  t.name = std::move(name);
  t.shape = std::move(shape);
  switch (dtype) {
    case DType::kBF16:
    case DType::kF16: {
      t.dtype_name = dtype == DType::kBF16 ? "BF16" : "F16";
      t.data.resize(n * 2);
      for (int64_t i = 0; i < n; ++i) {
        const uint16_t h =
            dtype == DType::kBF16 ? kernels::F32ToBf16(values[i]) : kernels::F32ToF16(values[i]);
        t.data[2 * i] = static_cast<uint8_t>(h);
        t.data[2 * i + 1] = static_cast<uint8_t>(h >> 8);
      }
      break;
    }
    default:
      t.dtype_name = "F32";
      t.data.resize(n * 4);
      std::memcpy(t.data.data(), values.data(), n * 4);
      break;
  }
  return t;
}

// The weight `name` ([rows, cols] `values`) of an FP8 checkpoint in
// `q`'s format: the e4m3 codes, the scales and, for static activations, an
// input_scale of 1 (random models have no calibration data).
void AppendFp8(const std::string& name, int64_t rows, int64_t cols, const float* values,
               const WeightQuantConfig& q, std::vector<TensorToWrite>* out) {
  Fp8Matrix m = QuantizeFp8(values, rows, cols, q);
  const std::string module = name.substr(0, name.rfind('.'));
  TensorToWrite w;
  w.name = name;
  w.dtype_name = "F8_E4M3";
  w.shape = {rows, cols};
  w.data = std::move(m.codes);
  out->push_back(std::move(w));
  TensorToWrite s;
  s.name = module + "." + q.scale_suffix();
  s.dtype_name = "F32";
  s.shape = ScaleShape(q, rows, cols);
  s.data.resize(m.scales.size() * 4);
  std::memcpy(s.data.data(), m.scales.data(), s.data.size());
  out->push_back(std::move(s));
  if (q.static_activations()) {
    const float one = 1.0f;
    TensorToWrite in;
    in.name = module + ".input_scale";
    in.dtype_name = "F32";
    in.shape = {};
    in.data.resize(4);
    std::memcpy(in.data.data(), &one, 4);
    out->push_back(std::move(in));
  }
}

// The plan's tensor, random, in `dtype`; a Linear weight that `q`
// quantises as the fp8 codes of those values (rounded to `dtype` first, as
// a quantiser reading a checkpoint of that dtype sees them) and its scales.
void MakeTensors(const TensorPlan& p, uint64_t seed, DType dtype, const ModelConfig& c,
                 std::vector<TensorToWrite>* out) {
  if (p.keep_f32) dtype = DType::kF32;
  Rng rng(seed ^ NameHash(p.name));
  int64_t n = 1;
  for (int64_t d : p.shape) n *= d;
  std::vector<float> values(n);
  const double a = std::sqrt(3.0) * p.std;  // uniform(-a, a) has std a / sqrt(3)
  for (auto& v : values) {
    v = p.kind == TensorPlan::kNorm         ? static_cast<float>(1.0 + 0.1 * rng.Uniform())
        : p.kind == TensorPlan::kNormOffset ? static_cast<float>(0.1 * rng.Uniform())
                                            : static_cast<float>(a * rng.Uniform());
  }
  const WeightQuantConfig& q = c.quant;
  if (q.quantized() && p.shape.size() == 2 && IsQuantizableLinear(p.name, c.num_layers) &&
      !q.Ignores(p.name.substr(0, p.name.rfind('.')))) {
    for (auto& v : values) {
      if (dtype == DType::kBF16) v = kernels::Bf16ToF32(kernels::F32ToBf16(v));
      if (dtype == DType::kF16) v = kernels::F16ToF32(kernels::F32ToF16(v));
    }
    AppendFp8(p.name, p.shape[0], p.shape[1], values.data(), q, out);
    return;
  }
  out->push_back(FloatTensor(p.name, p.shape, values, dtype));
}

Status WriteJson(const std::filesystem::path& path, const ordered_json& j) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) return Status::InvalidArgument(path.string() + ": cannot create");
  out << j.dump(2) << "\n";
  out.close();
  if (!out) return Status::Internal(path.string() + ": write failed");
  return Status::Ok();
}

}  // namespace

StatusOr<ModelSpec> PresetModelSpec(std::string_view preset) {
  ModelSpec s;
  if (preset == "tiny") return s;
  if (preset == "small") {
    s.name = "pdserve-small";
    s.num_merges = 2048 - 256 - 5;
    s.hidden_size = 512;
    s.intermediate_size = 1536;
    s.num_layers = 8;
    s.num_heads = 8;
    s.num_kv_heads = 2;
    s.max_position_embeddings = 8192;
    s.rope_theta = 500000.0;
    return s;
  }
  if (preset == "qwen3") {
    s.architecture = "Qwen3ForCausalLM";
    s.name = "pdserve-tiny-qwen3";
    s.head_dim = 32;
    s.rope_theta = 1000000.0;
    s.rms_norm_eps = 1e-6;
    return s;
  }
  if (preset == "qwen3-moe") {
    s.architecture = "Qwen3MoeForCausalLM";
    s.name = "pdserve-tiny-qwen3-moe";
    s.num_layers = 3;
    s.head_dim = 32;
    s.rope_theta = 1000000.0;
    s.rms_norm_eps = 1e-6;
    s.num_experts = 8;
    s.num_experts_per_tok = 2;
    s.moe_intermediate_size = 48;
    s.norm_topk_prob = true;
    s.mlp_only_layers = {1};
    return s;
  }
  if (preset == "mixtral") {
    s.architecture = "MixtralForCausalLM";
    s.name = "pdserve-tiny-mixtral";
    s.intermediate_size = 96;  // each expert's width
    s.rope_theta = 1000000.0;
    s.num_experts = 8;
    s.num_experts_per_tok = 2;
    return s;
  }
  if (preset == "deepseek-v2-lite" || preset == "deepseek-v3") {
    const bool v3 = preset == "deepseek-v3";
    s.architecture = v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM";
    s.name = v3 ? "pdserve-tiny-deepseek-v3" : "pdserve-tiny-deepseek-v2-lite";
    s.num_layers = v3 ? 4 : 3;
    s.num_kv_heads = s.num_heads;
    s.intermediate_size = 128;  // the dense layers' MLP
    s.rms_norm_eps = 1e-6;
    s.q_lora_rank = v3 ? 48 : 0;
    s.kv_lora_rank = 32;
    s.qk_nope_head_dim = 16;
    s.qk_rope_head_dim = 16;
    s.v_head_dim = 16;
    s.num_experts = 8;
    s.num_experts_per_tok = 2;
    s.moe_intermediate_size = 32;
    s.num_shared_experts = v3 ? 1 : 2;
    s.first_k_dense_replace = v3 ? 2 : 1;
    if (v3) {
      s.topk_method = kernels::MoeTopkMethod::kNoAuxTc;
      s.n_group = 4;
      s.topk_group = 2;
      s.norm_topk_prob = true;
      s.routed_scaling_factor = 2.5;
      // DeepSeek-V3's yarn keys; max_position_embeddings = factor x the
      // original length, as in its config.json.
      s.rope_scaling.type = RopeScaling::Type::kYarn;
      s.rope_scaling.factor = 4;
      s.rope_scaling.original_max_position_embeddings = 1024;
      s.rope_scaling.beta_fast = 32;
      s.rope_scaling.beta_slow = 1;
      s.rope_scaling.mscale = 1;
      s.rope_scaling.mscale_all_dim = 1;
      s.max_position_embeddings = 4096;
      s.num_nextn_predict_layers = 1;
    }
    return s;
  }
  if (preset == "gemma2") {
    s.architecture = "Gemma2ForCausalLM";
    s.name = "pdserve-tiny-gemma2";
    s.chat_format = ChatFormat::kGemma;
    s.num_layers = 4;
    s.head_dim = 32;
    s.intermediate_size = 128;
    s.rms_norm_eps = 1e-6;
    s.sliding_window = 32;
    s.query_pre_attn_scalar = 24;
    s.attn_logit_softcapping = 2;
    s.final_logit_softcapping = 2;
    return s;
  }
  if (preset == "gemma3") {
    s.architecture = "Gemma3ForCausalLM";
    s.name = "pdserve-tiny-gemma3";
    s.chat_format = ChatFormat::kGemma;
    s.num_layers = 6;
    s.head_dim = 32;
    s.intermediate_size = 128;
    s.rms_norm_eps = 1e-6;
    s.sliding_window = 24;
    s.sliding_window_pattern = 3;
    s.query_pre_attn_scalar = 16;
    s.rope_theta = 1000000.0;
    s.rope_local_base_freq = 10000.0;
    s.rope_scaling.type = RopeScaling::Type::kLinear;
    s.rope_scaling.factor = 2;
    return s;
  }
  if (preset == "mistral-window") {
    s.architecture = "MistralForCausalLM";
    s.name = "pdserve-tiny-mistral-window";
    s.chat_format = ChatFormat::kMistral;
    s.sliding_window = 32;
    return s;
  }
  if (preset == "qwen2-window") {
    s.architecture = "Qwen2ForCausalLM";
    s.name = "pdserve-tiny-qwen2-window";
    s.chat_format = ChatFormat::kChatMl;
    s.num_layers = 4;
    s.rope_theta = 1000000.0;
    s.rms_norm_eps = 1e-6;
    s.sliding_window = 32;
    s.max_window_layers = 2;
    return s;
  }
  if (preset == "qwen3-window") {
    // Qwen3 (q/k norms, head_dim 32) windowing its layers from
    // max_window_layers on, as Qwen2; a window that crosses blocks of 16.
    s.architecture = "Qwen3ForCausalLM";
    s.name = "pdserve-tiny-qwen3-window";
    s.chat_format = ChatFormat::kChatMl;
    s.head_dim = 32;
    s.rope_theta = 1000000.0;
    s.rms_norm_eps = 1e-6;
    s.sliding_window = 24;
    s.max_window_layers = 1;
    return s;
  }
  return Status::InvalidArgument(
      "unknown preset '" + std::string(preset) +
      "' (tiny, small, qwen3, qwen3-moe, mixtral, deepseek-v2-lite, deepseek-v3, gemma2, "
      "gemma3, mistral-window, qwen2-window or qwen3-window)");
}

namespace {

// Writes a model folder's files into a staging folder inside `dir`, then
// moves them in (config.json last, which is what marks a folder as a model)
// and removes the weight files of the folder's earlier layout that the new
// one does not have. A failure leaves `dir` as it was, and no folder where
// there was none: an interrupted or failed write never leaves a model that
// looks complete (`up` reuses a folder with a config.json), nor wrecks an
// existing one.
Status WriteFolderStaged(const std::string& dir,
                         const std::function<Status(const std::filesystem::path&)>& write) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const bool existed = fs::exists(dir, ec);
  fs::create_directories(dir, ec);
  if (ec) return Status::InvalidArgument(dir + ": cannot create folder: " + ec.message());
  const fs::path root(dir);
  const fs::path staging = root / (".make-model-" + std::to_string(::getpid()));
  fs::remove_all(staging, ec);
  fs::create_directory(staging, ec);
  if (ec) return Status::InvalidArgument(dir + ": cannot create folder: " + ec.message());
  auto abandon = [&](Status st) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    if (!existed) fs::remove(root, ignored);  // only if empty: nothing else was there
    return st;
  };
  if (Status st = write(staging); !st.ok()) return abandon(st);
  std::set<std::string> written;
  for (const auto& entry : fs::directory_iterator(staging, ec)) {
    written.insert(entry.path().filename().string());
  }
  if (ec) return abandon(Status::Internal(dir + ": cannot list what was written: " + ec.message()));
  // What the new files replace, and the earlier layout's weights (one
  // file, or shards and their index: a folder never mixes both), go aside
  // first, config.json before the rest: from then on the folder is no model
  // until the new config.json is in, and a failure puts them back.
  const fs::path aside = staging / ".old";
  fs::create_directory(aside, ec);
  if (ec) return abandon(Status::Internal(dir + ": cannot create folder: " + ec.message()));
  std::vector<std::string> moved_aside;
  auto restore = [&](Status st) {
    std::error_code ignored;
    for (const std::string& name : written) {
      if (std::find(moved_aside.begin(), moved_aside.end(), name) == moved_aside.end()) {
        fs::remove(root / name, ignored);  // a new file that went in: not the old folder's
      }
    }
    for (auto it = moved_aside.rbegin(); it != moved_aside.rend(); ++it) {
      fs::rename(aside / *it, root / *it, ignored);
    }
    return abandon(st);
  };
  std::vector<std::string> old;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (entry.path() == staging) continue;
    if (written.count(name) || name.ends_with(".safetensors") ||
        name == "model.safetensors.index.json") {
      old.push_back(name);
    }
  }
  std::stable_partition(old.begin(), old.end(),
                        [](const std::string& n) { return n == "config.json"; });
  for (const std::string& name : old) {
    fs::rename(root / name, aside / name, ec);
    if (ec) {
      return restore(Status::Internal(dir + "/" + name + ": cannot move aside: " + ec.message()));
    }
    moved_aside.push_back(name);
  }
  for (const bool config : {false, true}) {
    for (const std::string& name : written) {
      if ((name == "config.json") != config) continue;
      fs::rename(staging / name, root / name, ec);
      if (ec) {
        return restore(
            Status::Internal(dir + "/" + name + ": cannot move into place: " + ec.message()));
      }
    }
  }
  fs::remove_all(staging, ec);
  return Status::Ok();
}

Status WriteModelFiles(const ModelSpec& spec, const std::filesystem::path& root);

}  // namespace

Status WriteModel(const ModelSpec& spec, const std::string& dir) {
  if (spec.dtype != DType::kF32 && spec.dtype != DType::kBF16 && spec.dtype != DType::kF16) {
    return Status::InvalidArgument("model dtype must be fp32, bf16 or fp16");
  }
  if (spec.num_merges < 0 || spec.shards < 1 || spec.num_heads % spec.num_kv_heads != 0) {
    return Status::InvalidArgument("inconsistent model spec");
  }
  return WriteFolderStaged(
      dir, [&](const std::filesystem::path& root) { return WriteModelFiles(spec, root); });
}

namespace {

Status WriteModelFiles(const ModelSpec& spec, const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  const bool qwen2 = spec.architecture == "Qwen2ForCausalLM";
  const bool qwen3 = spec.architecture == "Qwen3ForCausalLM";
  const bool llama = spec.architecture == "LlamaForCausalLM";
  const bool mistral = spec.architecture == "MistralForCausalLM";
  const bool qwen3_moe = spec.architecture == "Qwen3MoeForCausalLM";
  const bool mixtral = spec.architecture == "MixtralForCausalLM";
  const bool deepseek_v2 = spec.architecture == "DeepseekV2ForCausalLM";
  const bool deepseek_v3 = spec.architecture == "DeepseekV3ForCausalLM";
  const bool deepseek = deepseek_v2 || deepseek_v3;
  const bool gemma2 = spec.architecture == "Gemma2ForCausalLM";
  const bool gemma3 = spec.architecture == "Gemma3ForCausalLM";
  const bool gemma = gemma2 || gemma3;
  const int64_t H = spec.hidden_size, I = spec.intermediate_size;
  const int64_t hd = spec.head_dim > 0 ? spec.head_dim : H / spec.num_heads;
  const int64_t V = spec.vocab_size();

  // Tokenizer first: the vocab fixes the special token ids.
  const Bpe bpe = LearnBpe(spec.num_merges);
  const int base = static_cast<int>(bpe.vocab.size());
  const ChatShape& chat = ShapeOf(spec.chat_format);
  // ChatML has no BOS; its config.json names <|endoftext|> as Qwen's does.
  const int bos_id = base + std::max(chat.bos, 0);
  ordered_json eos_ids = ordered_json::array();
  for (int i : chat.config_eos) eos_ids.push_back(base + i);
  PDSERVE_RETURN_IF_ERROR(WriteJson(root / "tokenizer.json", TokenizerJson(bpe, chat)));
  ordered_json added_decoder = ordered_json::object();
  for (int i = 0; i < 5; ++i) {
    added_decoder[std::to_string(base + i)] = {{"content", chat.specials[i]}, {"lstrip", false},
                                               {"normalized", false},         {"rstrip", false},
                                               {"single_word", false},        {"special", true}};
  }
  PDSERVE_RETURN_IF_ERROR(WriteJson(
      root / "tokenizer_config.json",
      {{"add_bos_token", chat.bos >= 0},
       {"add_eos_token", false},
       {"added_tokens_decoder", added_decoder},
       {"bos_token", chat.bos >= 0 ? ordered_json(chat.specials[chat.bos]) : ordered_json()},
       {"chat_template", chat.chat_template},
       {"clean_up_tokenization_spaces", false},
       {"eos_token", chat.specials[chat.eos]},
       {"model_max_length", spec.max_position_embeddings},
       {"tokenizer_class", "PreTrainedTokenizerFast"}}));

  ordered_json config = {{"_name_or_path", spec.name},
                         {"architectures", {spec.architecture}},
                         {"model_type", qwen2         ? "qwen2"
                                        : qwen3       ? "qwen3"
                                        : qwen3_moe   ? "qwen3_moe"
                                        : mistral     ? "mistral"
                                        : mixtral     ? "mixtral"
                                        : deepseek_v2 ? "deepseek_v2"
                                        : deepseek_v3 ? "deepseek_v3"
                                        : gemma2      ? "gemma2"
                                        : gemma3      ? "gemma3_text"
                                                      : "llama"},
                         {"vocab_size", V},
                         {"hidden_size", H},
                         {"intermediate_size", I},
                         {"num_hidden_layers", spec.num_layers},
                         {"num_attention_heads", spec.num_heads},
                         {"num_key_value_heads", spec.num_kv_heads},
                         {"head_dim", hd},
                         {"hidden_act", "silu"},
                         {"max_position_embeddings", spec.max_position_embeddings},
                         {"rms_norm_eps", spec.rms_norm_eps},
                         {"rope_theta", spec.rope_theta},
                         {"tie_word_embeddings", spec.tie_word_embeddings},
                         {"bos_token_id", bos_id},
                         {"eos_token_id", eos_ids},
                         {"torch_dtype", spec.dtype == DType::kBF16  ? "bfloat16"
                                         : spec.dtype == DType::kF16 ? "float16"
                                                                     : "float32"}};
  if (deepseek) {
    // DeepSeek's config.json has no head_dim (transformers derives it from
    // qk_rope_head_dim) and repeats the head count as num_key_value_heads.
    config.erase("head_dim");
    config["num_key_value_heads"] = spec.num_heads;
    config["q_lora_rank"] = spec.q_lora_rank > 0 ? ordered_json(spec.q_lora_rank) : ordered_json();
    config["kv_lora_rank"] = spec.kv_lora_rank;
    config["qk_nope_head_dim"] = spec.qk_nope_head_dim;
    config["qk_rope_head_dim"] = spec.qk_rope_head_dim;
    config["v_head_dim"] = spec.v_head_dim;
    if (deepseek_v3) config["rope_interleave"] = spec.rope_interleave;
    config["n_routed_experts"] = spec.num_experts;
    config["n_shared_experts"] = spec.num_shared_experts;
    config["num_experts_per_tok"] = spec.num_experts_per_tok;
    config["moe_intermediate_size"] = spec.moe_intermediate_size;
    config["first_k_dense_replace"] = spec.first_k_dense_replace;
    config["moe_layer_freq"] = spec.moe_layer_freq;
    config["scoring_func"] = deepseek_v3 ? "sigmoid" : "softmax";
    config["topk_method"] = spec.topk_method == kernels::MoeTopkMethod::kNoAuxTc ? "noaux_tc"
                            : spec.topk_method == kernels::MoeTopkMethod::kGroupLimitedGreedy
                                ? "group_limited_greedy"
                                : "greedy";
    config["n_group"] = spec.n_group;
    config["topk_group"] = spec.topk_group;
    config["norm_topk_prob"] = spec.norm_topk_prob;
    config["routed_scaling_factor"] = spec.routed_scaling_factor;
    config["aux_loss_alpha"] = 0.001;  // training only
    config["seq_aux"] = true;          // training only
    if (deepseek_v3) config["num_nextn_predict_layers"] = spec.num_nextn_predict_layers;
  }
  if (llama || qwen3 || qwen3_moe || deepseek || gemma) {
    config["attention_bias"] = spec.attention_bias;
  }
  if (llama) config["mlp_bias"] = spec.mlp_bias;
  const ordered_json window =
      spec.sliding_window > 0 ? ordered_json(spec.sliding_window) : ordered_json();
  if (qwen2 || qwen3 || qwen3_moe || mistral || mixtral || gemma) config["sliding_window"] = window;
  if (qwen2 || qwen3 || qwen3_moe) {
    config["use_sliding_window"] = spec.sliding_window > 0;
    config["max_window_layers"] =
        spec.sliding_window > 0 ? spec.max_window_layers : spec.num_layers;
  }
  if (gemma) {
    // Gemma2MLP / Gemma3MLP read hidden_activation; the published configs
    // repeat it as hidden_act.
    config["hidden_act"] = "gelu_pytorch_tanh";
    config["hidden_activation"] = "gelu_pytorch_tanh";
    config["query_pre_attn_scalar"] = spec.query_pre_attn_scalar;
    auto cap = [](double v) { return v > 0 ? ordered_json(v) : ordered_json(); };
    config["attn_logit_softcapping"] = cap(spec.attn_logit_softcapping);
    config["final_logit_softcapping"] = cap(spec.final_logit_softcapping);
    config["cache_implementation"] = "hybrid";
    if (gemma3) {
      config["sliding_window_pattern"] = spec.sliding_window_pattern;
      config["rope_local_base_freq"] = spec.rope_local_base_freq;
    }
  }
  if (qwen3_moe) {
    config["num_experts"] = spec.num_experts;
    config["num_experts_per_tok"] = spec.num_experts_per_tok;
    config["moe_intermediate_size"] = spec.moe_intermediate_size;
    config["norm_topk_prob"] = spec.norm_topk_prob;
    config["decoder_sparse_step"] = spec.decoder_sparse_step;
    config["mlp_only_layers"] = spec.mlp_only_layers;
  }
  if (mixtral) {
    config["num_local_experts"] = spec.num_experts;
    config["num_experts_per_tok"] = spec.num_experts_per_tok;
    config["router_jitter_noise"] = 0.0;
  }
  if (qwen3_moe || mixtral) {
    config["output_router_logits"] = false;
    config["router_aux_loss_coef"] = 0.001;
  }
  switch (spec.rope_scaling.type) {
    case RopeScaling::Type::kNone:
      config["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      config["rope_scaling"] = {{"rope_type", "linear"}, {"factor", spec.rope_scaling.factor}};
      break;
    case RopeScaling::Type::kLlama3:
      config["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", spec.rope_scaling.factor},
          {"low_freq_factor", spec.rope_scaling.low_freq_factor},
          {"high_freq_factor", spec.rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", spec.rope_scaling.original_max_position_embeddings}};
      break;
    case RopeScaling::Type::kYarn:
      // DeepSeek's published form (keys as in DeepSeek-V3's config.json).
      config["rope_scaling"] = {
          {"type", "yarn"},
          {"factor", spec.rope_scaling.factor},
          {"original_max_position_embeddings", spec.rope_scaling.original_max_position_embeddings},
          {"beta_fast", spec.rope_scaling.beta_fast},
          {"beta_slow", spec.rope_scaling.beta_slow},
          {"mscale", spec.rope_scaling.mscale},
          {"mscale_all_dim", spec.rope_scaling.mscale_all_dim}};
      break;
  }
  if (spec.quant != kernels::WeightScheme::kNone) {
    config["quantization_config"] = ordered_json::parse(QuantizationConfigJson(spec.quant).dump());
  }
  PDSERVE_RETURN_IF_ERROR(WriteJson(root / "config.json", config));
  PDSERVE_RETURN_IF_ERROR(WriteJson(root / "generation_config.json",
                                    {{"bos_token_id", bos_id}, {"eos_token_id", eos_ids}}));

  // The tensors follow from the config exactly as the loader reads it.
  auto shapes = ParseModelConfig(config.dump(), "make-model config");
  if (!shapes.ok()) return shapes.status();
  const std::vector<TensorPlan> plan = PlanTensors(*shapes, /*with_mtp_layers=*/true);

  const int shards = std::min<int>(spec.shards, static_cast<int>(plan.size()));
  if (shards == 1) {
    std::vector<TensorToWrite> tensors;
    for (const auto& p : plan) MakeTensors(p, spec.seed, spec.dtype, *shapes, &tensors);
    return WriteSafetensors((root / "model.safetensors").string(), tensors);
  }
  ordered_json weight_map = ordered_json::object();
  int64_t total_bytes = 0;
  const size_t per_shard = (plan.size() + shards - 1) / shards;
  for (int s = 0; s < shards; ++s) {
    char name[64];
    std::snprintf(name, sizeof(name), "model-%05d-of-%05d.safetensors", s + 1, shards);
    std::vector<TensorToWrite> tensors;
    for (size_t i = s * per_shard; i < std::min(plan.size(), (s + 1) * per_shard); ++i) {
      const size_t first = tensors.size();
      MakeTensors(plan[i], spec.seed, spec.dtype, *shapes, &tensors);
      for (size_t t = first; t < tensors.size(); ++t) {
        weight_map[tensors[t].name] = name;
        total_bytes += static_cast<int64_t>(tensors[t].data.size());
      }
    }
    PDSERVE_RETURN_IF_ERROR(WriteSafetensors((root / name).string(), tensors));
  }
  return WriteJson(root / "model.safetensors.index.json",
                   {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}});
}

}  // namespace

StatusOr<std::unique_ptr<WeightFiles>> RandomWeights(const ModelConfig& config, DType dtype,
                                                     uint64_t seed) {
  if (dtype != DType::kF32 && dtype != DType::kBF16 && dtype != DType::kF16) {
    return Status::InvalidArgument("dummy weights must be fp32, bf16 or fp16");
  }
  const std::vector<TensorPlan> plan = PlanTensors(config, /*with_mtp_layers=*/false);
  std::vector<std::vector<TensorToWrite>> made(plan.size());
  // Billions of values for real shapes: fill tensors on every core.
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < plan.size();) {
      MakeTensors(plan[i], seed, dtype, config, &made[i]);
    }
  };
  std::vector<std::thread> threads;
  const unsigned n = std::max(1u, std::thread::hardware_concurrency());
  for (unsigned t = 1; t < n; ++t) threads.emplace_back(work);
  work();
  for (auto& t : threads) t.join();
  std::vector<TensorToWrite> tensors;
  for (auto& m : made) {
    for (auto& t : m) tensors.push_back(std::move(t));
  }
  return WeightFiles::FromMemory(std::move(tensors), "dummy weights");
}

int64_t CountParameters(const ModelConfig& config) {
  int64_t total = 0;
  for (const TensorPlan& p : PlanTensors(config, /*with_mtp_layers=*/false)) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    total += n;
  }
  return total;
}

int64_t ConfigWeightBytes(const ModelConfig& config, DType dtype) {
  const int64_t width = DTypeBits(dtype) / 8;
  const WeightQuantConfig& q = config.quant;
  int64_t total = 0;
  for (const TensorPlan& p : PlanTensors(config, /*with_mtp_layers=*/false)) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    if (q.quantized() && p.shape.size() == 2 && IsQuantizableLinear(p.name, config.num_layers) &&
        !q.Ignores(p.name.substr(0, p.name.rfind('.')))) {
      int64_t scales = 1;
      for (int64_t d : ScaleShape(q, p.shape[0], p.shape[1])) scales *= d;
      total += n + 4 * scales;
      continue;
    }
    total += n * (p.keep_f32 ? 4 : width);
  }
  return total;
}

Status QuantizeModel(const std::string& from, kernels::WeightScheme scheme,
                     const std::string& dir) {
  namespace fs = std::filesystem;
  if (scheme == kernels::WeightScheme::kNone) {
    return Status::InvalidArgument("quantize: no fp8 scheme given");
  }
  const fs::path src(from), root(dir);
  std::error_code ec;
  if (fs::exists(root) && fs::equivalent(src, root, ec)) {
    return Status::InvalidArgument(dir + ": the quantised model needs a folder of its own");
  }
  std::ifstream in(src / "config.json");
  if (!in) return Status::NotFound(from + ": no config.json");
  ordered_json config = ordered_json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (config.is_discarded() || !config.is_object()) {
    return Status::InvalidArgument(from + "/config.json: not a JSON object");
  }
  if (config.contains("quantization_config") && !config["quantization_config"].is_null()) {
    return Status::InvalidArgument(from + "/config.json: the model is quantised already");
  }
  config["quantization_config"] = ordered_json::parse(QuantizationConfigJson(scheme).dump());
  auto parsed = ParseModelConfig(config.dump(), from + "/config.json");
  if (!parsed.ok()) return parsed.status();
  auto files = WeightFiles::Open(from);
  if (!files.ok()) return files.status();
  // Every tensor the config names has the shape the loader expects: a
  // source it would refuse is refused here, before anything is written.
  std::map<std::string, std::vector<int64_t>> expected;
  for (const TensorPlan& p : PlanTensors(*parsed, /*with_mtp_layers=*/true)) {
    expected.emplace(p.name, p.shape);
  }
  for (const auto& [name, t] : (*files)->tensors()) {
    if (auto it = expected.find(name); it != expected.end() && it->second != t->shape) {
      return Status::InvalidArgument(from + ": tensor " + name + " has shape " + t->ShapeString() +
                                     ", the config expects another");
    }
  }
  std::vector<TensorToWrite> tensors;
  int64_t quantised = 0;
  for (const auto& [name, t] : (*files)->tensors()) {
    const bool linear = t->shape.size() == 2 && IsQuantizableLinear(name, parsed->num_layers) &&
                        !parsed->quant.Ignores(name.substr(0, name.rfind('.')));
    if (linear && t->dtype && *t->dtype != DType::kFP8E4M3) {
      std::vector<float> values(t->numel());
      for (int64_t i = 0; i < t->numel(); ++i) {
        uint16_t h;
        switch (*t->dtype) {
          case DType::kBF16:
            std::memcpy(&h, t->data + 2 * i, 2);
            values[i] = kernels::Bf16ToF32(h);
            break;
          case DType::kF16:
            std::memcpy(&h, t->data + 2 * i, 2);
            values[i] = kernels::F16ToF32(h);
            break;
          default:
            std::memcpy(&values[i], t->data + 4 * i, 4);
            break;
        }
      }
      AppendFp8(name, t->shape[0], t->shape[1], values.data(), parsed->quant, &tensors);
      ++quantised;
      continue;
    }
    TensorToWrite copy;
    copy.name = name;
    copy.dtype_name = t->dtype_name;
    copy.shape = t->shape;
    copy.data.assign(t->data, t->data + t->bytes);
    tensors.push_back(std::move(copy));
  }
  if (quantised == 0) return Status::InvalidArgument(from + ": no Linear weights to quantise");
  return WriteFolderStaged(dir, [&](const fs::path& staging) {
    std::error_code copy_ec;
    // Everything else of the folder (tokenizer, generation config) as it is.
    for (const auto& entry : fs::directory_iterator(src)) {
      const std::string file = entry.path().filename().string();
      if (!entry.is_regular_file() || file == "config.json" || file.ends_with(".safetensors") ||
          file == "model.safetensors.index.json") {
        continue;
      }
      fs::copy_file(entry.path(), staging / file, fs::copy_options::overwrite_existing, copy_ec);
      if (copy_ec)
        return Status::Internal(dir + "/" + file + ": copy failed: " + copy_ec.message());
    }
    PDSERVE_RETURN_IF_ERROR(WriteJson(staging / "config.json", config));
    return WriteSafetensors((staging / "model.safetensors").string(), tensors);
  });
}

}  // namespace pdserve
