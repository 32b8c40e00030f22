// pdserve tokenize: text → ids (or ids → text) with a Hugging Face tokenizer.
#include <cstdio>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/tokenizer/tokenizer.h"
#include "services/cli/command.h"

namespace pdserve::cli {
namespace {

int RunTokenize(int argc, char** argv) {
  FlagSet flags("tokenize", "Turn text into token ids, or ids back into text.");
  std::string tokenizer_path;
  std::string text;
  std::vector<int64_t> decode;
  bool add_special_tokens = false;
  bool skip_special_tokens = false;
  bool json = false;
  flags.AddString(
      "tokenizer", &tokenizer_path,
      "folder with tokenizer.json (+ tokenizer_config.json), or the tokenizer.json file");
  flags.AddString("text", &text, "text to encode; '-' reads it from stdin");
  flags.AddIntList("decode", &decode, "comma-separated ids to decode instead of encoding");
  flags.AddBool("add-special-tokens", &add_special_tokens,
                "add BOS/EOS as the tokenizer's post-processor and config prescribe");
  flags.AddBool("skip-special-tokens", &skip_special_tokens,
                "with --decode: leave special tokens out of the text");
  flags.AddBool("json", &json, "print one JSON object: {\"ids\": [...]} or {\"text\": ...}");
  flags.SetEnvPrefix("PDSERVE_");
  flags.SetEpilog(
      "Examples:\n"
      "  pdserve tokenize --tokenizer models/llama3 --text 'Hello world' --json\n"
      "  pdserve tokenize --tokenizer models/llama3 --decode 9906,1917");
  ParseFlagsOrExit(flags, argc, argv);

  if (tokenizer_path.empty()) UsageError("tokenize", "--tokenizer is required");
  const bool encoding = flags.WasSet("text");
  if (encoding == flags.WasSet("decode")) {
    UsageError("tokenize", "give exactly one of --text and --decode");
  }
  auto tokenizer = Tokenizer::Load(tokenizer_path);
  // A missing or malformed tokenizer is bad input (exit 2), as for generate.
  if (!tokenizer.ok()) UsageError("tokenize", tokenizer.status().message());

  if (encoding) {
    if (text == "-") {
      text.assign(std::istreambuf_iterator<char>(std::cin), std::istreambuf_iterator<char>());
    }
    const std::vector<TokenId> ids = (*tokenizer)->Encode(text, add_special_tokens);
    if (json) {
      std::printf("%s\n", nlohmann::json({{"ids", ids}}).dump().c_str());
    } else {
      std::string line;
      for (size_t k = 0; k < ids.size(); ++k) {
        if (k) line += ',';
        line += std::to_string(ids[k]);
      }
      std::printf("%s\n", line.c_str());
    }
    return 0;
  }

  std::vector<TokenId> ids;
  for (int64_t id : decode) {
    if (id < 0 || static_cast<size_t>(id) >= (*tokenizer)->vocab_size()) {
      UsageError("tokenize", "--decode: id " + std::to_string(id) + " is outside the vocabulary (" +
                                 std::to_string((*tokenizer)->vocab_size()) + " ids)");
    }
    ids.push_back(static_cast<TokenId>(id));
  }
  const std::string decoded = (*tokenizer)->Decode(ids, skip_special_tokens);
  if (json) {
    std::printf("%s\n", nlohmann::json({{"text", decoded}})
                            .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace)
                            .c_str());
  } else {
    std::printf("%s\n", decoded.c_str());
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("tokenize", "encode text to token ids or decode ids to text", RunTokenize);

}  // namespace pdserve::cli
