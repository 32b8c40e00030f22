// Loading and running Hugging Face tokenizer.json BPE tokenizers.
//
// Pipeline (as in `tokenizers`): split out added tokens on the raw text →
// normalize each remaining segment → split out "normalized" added tokens →
// pre-tokenize → BPE → post-process (BOS/EOS). Decoding maps ids to token
// strings and runs the decoder chain.
#include "common/tokenizer/tokenizer.h"
#include "common/read_file.h"

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "common/tokenizer/detail/bpe.h"
#include "common/tokenizer/detail/pipeline.h"
#include "common/tokenizer/detail/unicode.h"

namespace pdserve {
namespace {

using nlohmann::json;
using namespace tokenizer_detail;
namespace fs = std::filesystem;

// Token ids a tokenizer file may name: those of a vocabulary the model
// config allows (2^22 entries), so that an id never sizes a table past it.
constexpr int64_t kMaxTokenId = (int64_t{1} << 22) - 1;
constexpr const char* kTokenIdRange = "integer in [0, 4194303]";
bool IsTokenId(const json& id) {
  return id.is_number_integer() && id.get<int64_t>() >= 0 && id.get<int64_t>() <= kMaxTokenId;
}

// Whether a decoder (or a Sequence of them) contains ByteFallback.
bool HasByteFallback(const json& decoder) {
  if (!decoder.is_object()) return false;
  const auto type = decoder.find("type");
  if (type != decoder.end() && *type == "ByteFallback") return true;
  const auto parts = decoder.find("decoders");
  if (parts == decoder.end() || !parts->is_array()) return false;
  return std::any_of(parts->begin(), parts->end(), HasByteFallback);
}

// "<0xNN>", the form ByteFallback turns back into a byte.
bool IsByteFallbackToken(std::string_view s) {
  auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
  return s.size() == 6 && s.starts_with("<0x") && s[5] == '>' && hex(s[3]) && hex(s[4]);
}

struct AddedToken {
  TokenId id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;
  bool rstrip = false;
  bool single_word = false;
  bool normalized = false;
};

// Leftmost-longest matching of added tokens, with the lstrip / rstrip /
// single_word rules of `tokenizers`' AddedVocabulary.
class AddedTokenMatcher {
 public:
  struct Split {
    size_t begin, end;
    const AddedToken* token;  // nullptr: plain text to tokenize
  };

  void Add(const AddedToken* token, std::string_view pattern) {
    if (pattern.empty()) return;
    if (nodes_.empty()) nodes_.emplace_back();
    int node = 0;
    for (char c : pattern) {
      const auto byte = static_cast<unsigned char>(c);
      int next = -1;
      for (auto [b, child] : nodes_[node].children)
        if (b == byte) next = child;
      if (next < 0) {
        next = static_cast<int>(nodes_.size());
        nodes_[node].children.emplace_back(byte, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    nodes_[node].token = token;
    first_byte_[static_cast<unsigned char>(pattern[0])] = true;
  }

  bool empty() const { return nodes_.empty(); }

  void SplitText(std::string_view text, std::vector<Split>* out) const {
    size_t plain_start = 0;
    size_t i = 0;
    while (i < text.size()) {
      if (!first_byte_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      const AddedToken* found = nullptr;
      size_t found_end = 0;
      int node = 0;
      for (size_t k = i; k < text.size(); ++k) {
        const auto byte = static_cast<unsigned char>(text[k]);
        int next = -1;
        for (auto [b, child] : nodes_[node].children)
          if (b == byte) next = child;
        if (next < 0) break;
        node = next;
        if (nodes_[node].token) {
          found = nodes_[node].token;
          found_end = k + 1;
        }
      }
      if (!found) {
        ++i;
        continue;
      }
      size_t start = i, stop = found_end;
      i = found_end;  // matches never overlap, even a rejected one
      if (found->single_word) {
        const bool start_ok = start == 0 || !IsWordChar(LastChar(text.substr(0, start)));
        const bool stop_ok = stop == text.size() || !IsWordChar(FirstChar(text.substr(stop)));
        if (!start_ok || !stop_ok) continue;
      }
      if (found->lstrip) {
        size_t s = start;
        while (s > plain_start) {
          size_t p = s - 1;
          while (p > 0 && (static_cast<unsigned char>(text[p]) & 0xC0) == 0x80) --p;
          size_t probe = p;
          if (!IsWhitespace(NextCodepoint(text, &probe))) break;
          s = p;
        }
        start = s;
      }
      if (found->rstrip) {
        while (stop < text.size()) {
          size_t probe = stop;
          if (!IsWhitespace(NextCodepoint(text, &probe))) break;
          stop = probe;
        }
        i = std::max(i, stop);
      }
      if (start > plain_start) out->push_back({plain_start, start, nullptr});
      out->push_back({start, stop, found});
      plain_start = stop;
    }
    if (plain_start < text.size()) out->push_back({plain_start, text.size(), nullptr});
  }

 private:
  static char32_t LastChar(std::string_view s) {
    size_t p = s.size() - 1;
    while (p > 0 && (static_cast<unsigned char>(s[p]) & 0xC0) == 0x80) --p;
    return NextCodepoint(s, &p);
  }
  static char32_t FirstChar(std::string_view s) {
    size_t p = 0;
    return NextCodepoint(s, &p);
  }
  struct Node {
    std::vector<std::pair<unsigned char, int>> children;
    const AddedToken* token = nullptr;
  };
  std::vector<Node> nodes_;
  bool first_byte_[256] = {};
};

// What the post-processor wraps around the encoded text.
struct Template {
  std::vector<TokenId> prefix;
  std::vector<TokenId> suffix;
};

class HfBpeTokenizer final : public Tokenizer {
 public:
  std::vector<TokenId> Encode(std::string_view text, bool add_special_tokens) const override;
  std::string Decode(std::span<const TokenId> ids, bool skip_special_tokens) const override;
  size_t vocab_size() const override { return vocab_size_; }
  std::optional<TokenId> TokenToId(std::string_view token) const override;
  std::optional<std::string> IdToToken(TokenId id) const override;
  bool IsSpecial(TokenId id) const override {
    const AddedToken* a = AddedById(id);
    return a && a->special;
  }
  bool IsByteToken(TokenId id) const override {
    return id >= 0 && static_cast<size_t>(id) < byte_token_.size() && byte_token_[id];
  }
  std::optional<std::string> TokenBytes(TokenId id) const override;
  std::optional<TokenId> bos_token_id() const override { return bos_id_; }
  const std::vector<TokenId>& eos_token_ids() const override { return eos_ids_; }
  const std::string& bos_token() const override { return bos_token_; }
  const std::string& eos_token() const override { return eos_token_; }
  const std::string& chat_template() const override { return chat_template_; }
  const std::string& tool_use_chat_template() const override { return tool_use_template_; }
  void SetChatTemplate(std::string text) { chat_template_ = std::move(text); }
  void SetToolUseChatTemplate(std::string text) { tool_use_template_ = std::move(text); }

  Status LoadTokenizerJson(const json& j);
  Status LoadConfig(const json& config);
  void LoadGenerationConfig(const json& config);
  void Finish();

 private:
  void EncodeSegment(std::string_view segment, bool at_text_start, std::vector<TokenId>* ids) const;
  void PreTokenizeAndModel(std::string_view text, bool at_text_start,
                           std::vector<TokenId>* ids) const;
  const std::string* TokenString(TokenId id) const;
  const AddedToken* AddedById(TokenId id) const {
    return id >= 0 && static_cast<size_t>(id) < added_index_.size() ? added_index_[id] : nullptr;
  }
  Status ParsePostProcessor(const json& j, Template* out) const;

  std::unique_ptr<Normalizer> normalizer_;
  std::unique_ptr<PreTokenizer> pre_tokenizer_;
  std::unique_ptr<BpeModel> model_;
  std::unique_ptr<Decoder> decoder_;
  Template template_;

  std::vector<std::unique_ptr<AddedToken>> added_;
  std::unordered_map<TokenId, const AddedToken*> added_by_id_;
  std::vector<const AddedToken*> added_index_;  // by id, filled by Finish()
  bool byte_fallback_ = false;                  // the decoder chain has ByteFallback
  std::vector<bool> byte_token_;                // by id, filled by Finish()
  Vocab added_by_content_;
  AddedTokenMatcher raw_matcher_;         // tokens with normalized = false
  AddedTokenMatcher normalized_matcher_;  // tokens with normalized = true
  size_t vocab_size_ = 0;

  std::optional<TokenId> bos_id_;
  std::vector<TokenId> eos_ids_;
  std::string bos_token_;
  std::string eos_token_;
  std::string chat_template_;
  std::string tool_use_template_;
};

template <typename T>
T Get(const json& j, const char* key, T fallback) {
  if (!j.is_object() || !j.contains(key) || j[key].is_null()) return fallback;
  return j[key].get<T>();
}

// Special-token fields of tokenizer_config.json are a string, null, or an
// AddedToken object {"content": ...}.
std::string TokenField(const json& config, const char* key) {
  if (!config.contains(key)) return "";
  const json& v = config[key];
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) {
    return v["content"].get<std::string>();
  }
  return "";
}

Status HfBpeTokenizer::LoadTokenizerJson(const json& j) {
  if (!j.is_object()) return Status::InvalidArgument("tokenizer.json: top level is not an object");
  if (!j.contains("model") || !j["model"].is_object()) {
    return Status::InvalidArgument("tokenizer.json: no \"model\" object");
  }
  const json& m = j["model"];
  const std::string type = Get<std::string>(m, "type", "BPE");
  if (type != "BPE") {
    return Status::Unsupported("tokenizer.json: model type '" + type +
                               "' is not supported (only BPE)");
  }
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() != 0.0) {
    return Status::Unsupported("tokenizer.json: BPE dropout is not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (!Get<std::string>(m, key, "").empty()) {
      return Status::Unsupported(std::string("tokenizer.json: BPE ") + key + " is not supported");
    }
  }
  if (!m.contains("vocab") || !m["vocab"].is_object()) {
    return Status::InvalidArgument("tokenizer.json: BPE model without a vocab object");
  }
  if (!m.contains("merges") || !m["merges"].is_array()) {
    return Status::InvalidArgument("tokenizer.json: BPE model without a merges list");
  }
  BpeConfig bpe;
  bpe.vocab.reserve(m["vocab"].size());
  for (const auto& [token, id] : m["vocab"].items()) {
    if (!IsTokenId(id)) {
      return Status::InvalidArgument("tokenizer.json: vocab id of '" + token + "' is not an " +
                                     kTokenIdRange);
    }
    bpe.vocab.emplace(token, id.get<TokenId>());
  }
  bpe.merges.reserve(m["merges"].size());
  for (const auto& merge : m["merges"]) {
    if (merge.is_string()) {
      const std::string s = merge.get<std::string>();
      const size_t space = s.find(' ');
      if (space == std::string::npos || s.find(' ', space + 1) != std::string::npos) {
        return Status::InvalidArgument("tokenizer.json: merge '" + s + "' is not 'a b'");
      }
      bpe.merges.emplace_back(s.substr(0, space), s.substr(space + 1));
    } else if (merge.is_array() && merge.size() == 2 && merge[0].is_string() &&
               merge[1].is_string()) {
      bpe.merges.emplace_back(merge[0].get<std::string>(), merge[1].get<std::string>());
    } else {
      return Status::InvalidArgument("tokenizer.json: malformed merge " + merge.dump());
    }
  }
  bpe.unk_token = Get<std::string>(m, "unk_token", "");
  bpe.fuse_unk = Get<bool>(m, "fuse_unk", false);
  bpe.byte_fallback = Get<bool>(m, "byte_fallback", false);
  bpe.ignore_merges = Get<bool>(m, "ignore_merges", false);

  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    auto n = BuildNormalizer(j["normalizer"]);
    if (!n.ok()) return n.status();
    normalizer_ = std::move(*n);
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    bool folded = false;
    auto p = BuildPreTokenizer(j["pre_tokenizer"], /*fold_final_byte_level=*/true, &folded);
    if (!p.ok()) return p.status();
    pre_tokenizer_ = std::move(*p);
    bpe.byte_level_input = folded;
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    auto d = BuildDecoder(j["decoder"]);
    if (!d.ok()) return d.status();
    decoder_ = std::move(*d);
    byte_fallback_ = HasByteFallback(j["decoder"]);
  }
  auto model = BpeModel::Build(std::move(bpe));
  if (!model.ok()) return model.status();
  model_ = std::move(*model);

  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const auto& a : j["added_tokens"]) {
      if (!a.contains("id") || !a.contains("content") || !a["content"].is_string()) {
        return Status::InvalidArgument("tokenizer.json: added token without id/content: " +
                                       a.dump());
      }
      if (!IsTokenId(a["id"])) {
        return Status::InvalidArgument("tokenizer.json: added token id " + a["id"].dump() +
                                       " is not an " + kTokenIdRange);
      }
      auto token = std::make_unique<AddedToken>();
      token->id = a["id"].get<TokenId>();
      token->content = a["content"].get<std::string>();
      token->special = Get<bool>(a, "special", false);
      token->lstrip = Get<bool>(a, "lstrip", false);
      token->rstrip = Get<bool>(a, "rstrip", false);
      token->single_word = Get<bool>(a, "single_word", false);
      token->normalized = Get<bool>(a, "normalized", !token->special);
      if (token->content.empty()) continue;
      added_by_id_[token->id] = token.get();
      added_by_content_[token->content] = token->id;
      added_.push_back(std::move(token));
    }
  }
  for (const auto& token : added_) {
    if (token->normalized && normalizer_) {
      std::string pattern = token->content;
      normalizer_->Apply(&pattern);
      normalized_matcher_.Add(token.get(), pattern);
    } else if (token->normalized) {
      normalized_matcher_.Add(token.get(), token->content);
    } else {
      raw_matcher_.Add(token.get(), token->content);
    }
  }
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    PDSERVE_RETURN_IF_ERROR(ParsePostProcessor(j["post_processor"], &template_));
  }
  return Status::Ok();
}

Status HfBpeTokenizer::ParsePostProcessor(const json& j, Template* out) const {
  const std::string type = Get<std::string>(j, "type", "");
  if (type == "ByteLevel") return Status::Ok();  // only adjusts offsets
  if (type == "Sequence") {
    if (!j.contains("processors") || !j["processors"].is_array()) {
      return Status::InvalidArgument("tokenizer.json: Sequence post_processor without a list");
    }
    for (const auto& p : j["processors"]) {
      Template inner;
      PDSERVE_RETURN_IF_ERROR(ParsePostProcessor(p, &inner));
      // Each processor wraps the result of the previous one.
      out->prefix.insert(out->prefix.begin(), inner.prefix.begin(), inner.prefix.end());
      out->suffix.insert(out->suffix.end(), inner.suffix.begin(), inner.suffix.end());
    }
    return Status::Ok();
  }
  if (type == "TemplateProcessing") {
    if (!j.contains("single") || !j["single"].is_array()) {
      return Status::InvalidArgument("tokenizer.json: TemplateProcessing without 'single'");
    }
    std::unordered_map<std::string, std::vector<TokenId>> specials;
    if (j.contains("special_tokens") && j["special_tokens"].is_object()) {
      for (const auto& [name, value] : j["special_tokens"].items()) {
        specials[name] = value.value("ids", std::vector<TokenId>{});
      }
    }
    bool seen_sequence = false;
    for (const auto& item : j["single"]) {
      if (item.contains("Sequence")) {
        if (Get<std::string>(item["Sequence"], "id", "A") != "A" || seen_sequence) {
          return Status::Unsupported("tokenizer.json: TemplateProcessing 'single' with " +
                                     item.dump() + " is not supported");
        }
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = Get<std::string>(item["SpecialToken"], "id", "");
        auto it = specials.find(name);
        std::vector<TokenId> ids;
        if (it != specials.end()) {
          ids = it->second;
        } else if (auto id = TokenToId(name)) {
          ids = {*id};
        } else {
          return Status::InvalidArgument("tokenizer.json: TemplateProcessing special token '" +
                                         name + "' is unknown");
        }
        auto& side = seen_sequence ? out->suffix : out->prefix;
        side.insert(side.end(), ids.begin(), ids.end());
      } else {
        return Status::InvalidArgument("tokenizer.json: TemplateProcessing item " + item.dump());
      }
    }
    return Status::Ok();
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    auto id_of = [&](const char* key) -> std::optional<TokenId> {
      if (j.contains(key) && j[key].is_array() && j[key].size() == 2)
        return j[key][1].get<TokenId>();
      return std::nullopt;
    };
    auto cls = id_of("cls"), sep = id_of("sep");
    if (!cls || !sep)
      return Status::InvalidArgument("tokenizer.json: " + type + " without cls/sep");
    out->prefix.push_back(*cls);
    out->suffix.push_back(*sep);
    return Status::Ok();
  }
  return Status::Unsupported("tokenizer.json: post_processor type '" +
                             (type.empty() ? j.dump() : type) + "' is not supported");
}

Status HfBpeTokenizer::LoadConfig(const json& config) {
  if (!config.is_object()) return Status::InvalidArgument("tokenizer_config.json: not an object");
  bos_token_ = TokenField(config, "bos_token");
  eos_token_ = TokenField(config, "eos_token");
  if (config.contains("chat_template")) {
    const json& t = config["chat_template"];
    if (t.is_string()) {
      chat_template_ = t.get<std::string>();
    } else if (t.is_array()) {
      // Named templates: prefer "default", else the first; "tool_use" is
      // for requests with tools.
      for (const auto& named : t) {
        if (!named.is_object() || !named.contains("template")) continue;
        if (chat_template_.empty() || named.value("name", "") == "default") {
          chat_template_ = named["template"].get<std::string>();
        }
        if (named.value("name", "") == "tool_use") {
          tool_use_template_ = named["template"].get<std::string>();
        }
      }
    }
  }
  // transformers' Llama-style tokenizers rebuild the post-processor from
  // add_bos_token / add_eos_token when the config sets them.
  if (config.contains("add_bos_token") || config.contains("add_eos_token")) {
    Template t;
    auto bos = bos_token_.empty() ? std::nullopt : TokenToId(bos_token_);
    auto eos = eos_token_.empty() ? std::nullopt : TokenToId(eos_token_);
    if (Get<bool>(config, "add_bos_token", false) && bos) t.prefix.push_back(*bos);
    if (Get<bool>(config, "add_eos_token", false) && eos) t.suffix.push_back(*eos);
    template_ = std::move(t);
  }
  return Status::Ok();
}

void HfBpeTokenizer::LoadGenerationConfig(const json& config) {
  if (!config.is_object() || !config.contains("eos_token_id")) return;
  const json& e = config["eos_token_id"];
  if (IsTokenId(e)) eos_ids_.push_back(e.get<TokenId>());
  if (e.is_array()) {
    for (const auto& id : e)
      if (IsTokenId(id)) eos_ids_.push_back(id.get<TokenId>());
  }
}

void HfBpeTokenizer::Finish() {
  size_t size = model_->id_to_token().size();
  for (const auto& a : added_) size = std::max(size, static_cast<size_t>(a->id) + 1);
  vocab_size_ = size;
  added_index_.assign(size, nullptr);
  for (const auto& [id, token] : added_by_id_) added_index_[id] = token;
  byte_token_.assign(byte_fallback_ ? size : 0, false);
  for (size_t id = 0; id < byte_token_.size(); ++id) {
    const std::string* s = TokenString(static_cast<TokenId>(id));
    byte_token_[id] = s && IsByteFallbackToken(*s);
  }
  // Without a config, the BOS is what the post-processor puts first.
  if (bos_token_.empty() && !template_.prefix.empty()) {
    if (auto s = IdToToken(template_.prefix.front())) bos_token_ = *s;
  }
  if (!bos_token_.empty()) bos_id_ = TokenToId(bos_token_);
  std::vector<TokenId> eos;
  if (!eos_token_.empty()) {
    if (auto id = TokenToId(eos_token_)) eos.push_back(*id);
  }
  eos.insert(eos.end(), eos_ids_.begin(), eos_ids_.end());
  // End-of-turn markers of the common chat formats also end generation
  // (llama.cpp treats them the same way): Llama 3's <|eot_id|>, ChatML's <|im_end|>.
  for (const char* marker : {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|endoftext|>",
                             "<|end_of_text|>", "<end_of_turn>", "<|end|>"}) {
    auto it = added_by_content_.find(std::string_view(marker));
    if (it != added_by_content_.end() && IsSpecial(it->second)) eos.push_back(it->second);
  }
  eos_ids_.clear();
  for (TokenId id : eos)
    if (std::find(eos_ids_.begin(), eos_ids_.end(), id) == eos_ids_.end()) eos_ids_.push_back(id);
}

std::optional<TokenId> HfBpeTokenizer::TokenToId(std::string_view token) const {
  if (auto it = added_by_content_.find(token); it != added_by_content_.end()) return it->second;
  if (auto it = model_->vocab().find(token); it != model_->vocab().end()) return it->second;
  return std::nullopt;
}

const std::string* HfBpeTokenizer::TokenString(TokenId id) const {
  if (const AddedToken* a = AddedById(id)) return &a->content;
  const auto& table = model_->id_to_token();
  if (id >= 0 && static_cast<size_t>(id) < table.size() && !table[id].empty()) return &table[id];
  return nullptr;
}

std::optional<std::string> HfBpeTokenizer::IdToToken(TokenId id) const {
  const std::string* s = TokenString(id);
  if (!s) return std::nullopt;
  return *s;
}

void HfBpeTokenizer::PreTokenizeAndModel(std::string_view text, bool at_text_start,
                                         std::vector<TokenId>* ids) const {
  if (!pre_tokenizer_) return model_->Tokenize(text, ids);
  PreTokenized p;
  p.pieces.push_back(text);
  p.at_text_start = at_text_start;
  pre_tokenizer_->Apply(&p);
  for (std::string_view piece : p.pieces) model_->Tokenize(piece, ids);
}

void HfBpeTokenizer::EncodeSegment(std::string_view segment, bool at_text_start,
                                   std::vector<TokenId>* ids) const {
  std::string normalized;
  std::string_view text = segment;
  if (normalizer_) {
    normalized.assign(segment);
    normalizer_->Apply(&normalized);
    text = normalized;
  }
  if (text.empty()) return;
  if (normalized_matcher_.empty()) return PreTokenizeAndModel(text, at_text_start, ids);
  std::vector<AddedTokenMatcher::Split> splits;
  normalized_matcher_.SplitText(text, &splits);
  for (const auto& s : splits) {
    if (s.token) {
      ids->push_back(s.token->id);
    } else {
      PreTokenizeAndModel(text.substr(s.begin, s.end - s.begin), at_text_start && s.begin == 0,
                          ids);
    }
  }
}

std::vector<TokenId> HfBpeTokenizer::Encode(std::string_view text, bool add_special_tokens) const {
  // Regex matching assumes well-formed UTF-8; repair anything else up front.
  std::string repaired;
  if (!IsValidUtf8(text)) {
    repaired = Utf8Lossy(text);
    text = repaired;
  }
  std::vector<TokenId> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = template_.prefix;
  if (raw_matcher_.empty()) {
    EncodeSegment(text, true, &ids);
  } else {
    std::vector<AddedTokenMatcher::Split> splits;
    raw_matcher_.SplitText(text, &splits);
    for (const auto& s : splits) {
      if (s.token) {
        ids.push_back(s.token->id);
      } else {
        EncodeSegment(text.substr(s.begin, s.end - s.begin), s.begin == 0, &ids);
      }
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), template_.suffix.begin(), template_.suffix.end());
  return ids;
}

std::optional<std::string> HfBpeTokenizer::TokenBytes(TokenId id) const {
  const std::string* s = TokenString(id);
  if (s == nullptr || IsSpecial(id)) return std::nullopt;
  if (!decoder_) return " " + *s;  // joined by spaces, as Decode does
  // Decoded after an anchor, so that rules for the first token (a leading
  // space stripped) do not apply; the anchor's own text is then cut off.
  static const std::string kAnchor = "a";
  std::vector<std::string> alone{kAnchor}, both{kAnchor, *s};
  decoder_->ApplyRaw(&alone);
  decoder_->ApplyRaw(&both);
  std::string prefix, all;
  for (const auto& t : alone) prefix += t;
  for (const auto& t : both) all += t;
  if (all.compare(0, prefix.size(), prefix) != 0) return std::nullopt;
  return all.substr(prefix.size());
}

std::string HfBpeTokenizer::Decode(std::span<const TokenId> ids, bool skip_special_tokens) const {
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (TokenId id : ids) {
    if (skip_special_tokens && IsSpecial(id)) continue;
    if (const std::string* s = TokenString(id)) tokens.push_back(*s);
  }
  std::string out;
  if (!decoder_) {
    // No decoder: tokens joined by spaces, as `tokenizers` does.
    for (size_t k = 0; k < tokens.size(); ++k) {
      if (k) out += ' ';
      out += tokens[k];
    }
    return out;
  }
  decoder_->Apply(&tokens);
  for (const auto& t : tokens) out += t;
  return out;
}

StatusOr<json> ReadJson(const fs::path& path) {
  auto text = ReadRegularFile(path.string());
  if (!text.ok()) return text.status();
  json j = json::parse(*text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return Status::InvalidArgument(path.string() + ": not valid JSON");
  return j;
}

// A template file's text; nullopt when there is no such regular file.
std::optional<std::string> ReadTextFile(const fs::path& path) {
  auto text = ReadRegularFile(path.string());
  if (!text.ok()) return std::nullopt;
  return std::move(*text);
}

}  // namespace

StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  std::error_code ec;
  fs::path file = path, dir;
  if (fs::is_directory(path, ec)) {
    dir = path;
    file = dir / "tokenizer.json";
  } else {
    dir = file.parent_path();
  }
  if (!fs::exists(file, ec)) {
    return Status::NotFound(file.string() + ": no such file (need a tokenizer.json or its folder)");
  }
  auto j = ReadJson(file);
  if (!j.ok()) return j.status();
  auto tokenizer = std::make_unique<HfBpeTokenizer>();
  try {
    Status s = tokenizer->LoadTokenizerJson(*j);
    if (!s.ok()) return Status(s.code(), file.string() + ": " + s.message());
    const fs::path config_path = dir / "tokenizer_config.json";
    if (fs::exists(config_path, ec)) {
      auto config = ReadJson(config_path);
      if (!config.ok()) return config.status();
      s = tokenizer->LoadConfig(*config);
      if (!s.ok()) return Status(s.code(), config_path.string() + ": " + s.message());
    }
    // transformers (4.47 on) saves templates as files beside the config,
    // and loads them in its place.
    if (auto text = ReadTextFile(dir / "chat_template.jinja")) {
      tokenizer->SetChatTemplate(std::move(*text));
    }
    if (auto text = ReadTextFile(dir / "additional_chat_templates" / "tool_use.jinja")) {
      tokenizer->SetToolUseChatTemplate(std::move(*text));
    }
    const fs::path generation_path = dir / "generation_config.json";
    if (fs::exists(generation_path, ec)) {
      auto config = ReadJson(generation_path);
      if (!config.ok()) return config.status();
      tokenizer->LoadGenerationConfig(*config);
    }
  } catch (const json::exception& e) {
    // A field of the wrong JSON type somewhere in the files.
    return Status::InvalidArgument(file.string() + ": unexpected content: " + e.what());
  }
  tokenizer->Finish();
  return std::unique_ptr<Tokenizer>(std::move(tokenizer));
}

}  // namespace pdserve
