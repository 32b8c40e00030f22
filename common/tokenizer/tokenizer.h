// Hugging Face `tokenizer.json` tokenizers: byte-level BPE (Llama 3, Qwen2/3)
// and SentencePiece-style BPE (Llama 2, Mistral: metaspace + byte fallback).
//
// Contract: a loaded Tokenizer is immutable and safe to use from many threads
// at once. Encode/Decode agree with the Hugging Face `tokenizers` library for
// the files they accept; anything they do not implement is refused at Load with
// a message naming the unsupported part, never silently mis-tokenized.
//
// Supported: model BPE (byte_fallback, fuse_unk, ignore_merges); normalizers
// Sequence, Prepend, Replace, NFC/NFD/NFKC/NFKD, Lowercase, Strip;
// pre-tokenizers Sequence, Split, ByteLevel, Metaspace, Digits; decoders
// Sequence, Replace, ByteFallback, Fuse, Strip, ByteLevel, Metaspace;
// post-processors TemplateProcessing, ByteLevel, Roberta/BertProcessing,
// Sequence. Decode is `tokenizers`' decode: transformers' optional
// clean_up_tokenization_spaces rewriting is never applied.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/block_hash.h"  // TokenId
#include "common/status.h"

namespace pdserve {

class Tokenizer {
 public:
  // `path` is a folder holding tokenizer.json (and optionally
  // tokenizer_config.json, which supplies BOS/EOS, add_bos_token and the chat
  // template) or the tokenizer.json file itself.
  static StatusOr<std::unique_ptr<Tokenizer>> Load(const std::string& path);
  virtual ~Tokenizer() = default;

  // Text → ids. With `add_special_tokens`, the post-processor's BOS (or
  // whatever tokenizer_config.json/tokenizer.json prescribe) is added; when
  // tokenizer_config.json sets add_bos_token / add_eos_token, those decide
  // (as transformers' Llama tokenizers do). Ill-formed UTF-8 is repaired
  // (U+FFFD) before tokenizing.
  // Added/special tokens appearing literally in `text` are matched first and
  // never split.
  virtual std::vector<TokenId> Encode(std::string_view text, bool add_special_tokens) const = 0;

  // Ids → text. Ids outside the vocabulary decode to nothing.
  virtual std::string Decode(std::span<const TokenId> ids, bool skip_special_tokens) const = 0;

  virtual size_t vocab_size() const = 0;  // largest id + 1, added tokens included
  virtual std::optional<TokenId> TokenToId(std::string_view token) const = 0;
  virtual std::optional<std::string> IdToToken(TokenId id) const = 0;
  virtual bool IsSpecial(TokenId id) const = 0;
  // True for a byte token ("<0xC3>") of a tokenizer whose decoder has
  // ByteFallback. A run of byte tokens decodes as a whole (a run that is not
  // valid UTF-8 becomes one U+FFFD per byte), so the text of a byte token is
  // final only once a token of another kind follows it.
  virtual bool IsByteToken(TokenId id) const = 0;
  // The exact bytes token `id` adds to the text when it follows other text
  // (not first: no start-of-text rule applies), before any UTF-8 repair: a
  // byte token is its byte, "▁hello" is " hello", a byte-level symbol its
  // bytes. nullopt for special tokens and ids outside the vocabulary.
  // (Structured outputs match grammars over these bytes.)
  virtual std::optional<std::string> TokenBytes(TokenId id) const = 0;

  virtual std::optional<TokenId> bos_token_id() const = 0;
  // End-of-sequence ids: eos_token, then generation_config.json's
  // eos_token_id(s) when that file sits next to tokenizer.json, then the
  // end-of-turn markers of common chat formats present as special tokens
  // (<|eot_id|>, <|eom_id|>, <|im_end|>, <|endoftext|>, <end_of_turn>, ...).
  // No duplicates; eos_token first.
  virtual const std::vector<TokenId>& eos_token_ids() const = 0;
  virtual const std::string& bos_token() const = 0;  // text form, "" if none
  virtual const std::string& eos_token() const = 0;
  // Jinja chat template ("" if none), as transformers loads it: the
  // folder's chat_template.jinja, else tokenizer_config.json's
  // chat_template (a string, or the "default" of named ones).
  virtual const std::string& chat_template() const = 0;
  // The template transformers renders a request with tools through: the
  // one named "tool_use" (additional_chat_templates/tool_use.jinja, or in
  // tokenizer_config.json's list); "" when there is none.
  virtual const std::string& tool_use_chat_template() const = 0;
};

// Streaming detokenizer: turns a token stream into text pieces that are safe
// to send one by one. Never emits half a UTF-8 character; without context the
// concatenation of all Push() results plus Flush() equals Decode(all ids).
// Text is held back while it may still change: an incomplete character, or a
// run of byte tokens (IsByteToken) that the next token may extend.
class IncrementalDetokenizer {
 public:
  // `context`: the ids the stream continues (a prompt's). Its last few ids
  // are decoded ahead of the stream and never emitted, so that the stream's
  // text is what it adds after them, as vLLM's detokenizer gives it: a
  // completion's first "▁little" is " little", where decoding the output on
  // its own would strip the space as SentencePiece does at the start of a
  // text. Context whose text ends in an unfinished character is dropped
  // back to where it ends cleanly.
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens,
                         std::span<const TokenId> context = {});
  // Appends one token; returns the text that became final (possibly empty).
  std::string Push(TokenId id);
  // End of stream: returns whatever is still held back.
  std::string Flush();

 private:
  // Decodes ids_[begin, end).
  std::string DecodeWindow(size_t begin, size_t end) const;

  const Tokenizer& tokenizer_;
  bool skip_special_tokens_;
  std::vector<TokenId> ids_;
  // The last id that decodes to something is a byte token: its run may go on.
  bool in_byte_run_ = false;
  // Text is decoded over the window [prefix_offset_, end): everything that
  // ids_[prefix_offset_, read_offset_) produces has been emitted and is cached
  // in prefix_text_; the new piece is the decoded window minus that prefix.
  // The window always starts with a token that produces text, so that
  // start-of-text rules (SentencePiece's leading-space strip) behave exactly
  // as in a full decode.
  size_t prefix_offset_ = 0;
  size_t read_offset_ = 0;
  std::string prefix_text_;
};

}  // namespace pdserve
