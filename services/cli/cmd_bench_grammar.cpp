// pdserve bench grammar: what structured outputs cost. For a set of schemas
// (flat, nested, recursive, enum-heavy, long patterns, any JSON object) on a
// 128k-token vocabulary: the time to compile a constraint with its token
// masks (what a worker's compiler thread spends once per schema), and the
// time of one decode step's mask (what the engine spends per token), p50 and
// p99 over random walks through the grammar. Then, on the small preset
// model, decode tokens/s with a schema against the same sampling without
// one.
//
// The vocabulary is synthesised deterministically in the shape of Llama-3's
// byte-level BPE (128,256 entries: the 256 bytes, English words with and
// without a leading space and capitalised, numbers of up to three digits,
// whitespace runs, punctuation and JSON/code fragments with quotes in every
// position, CJK, Cyrillic, accented and emoji text, and partial UTF-8
// sequences), since the real tokenizer.json is not available offline.
#include <time.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "common/flags.h"
#include "common/logging.h"
#include "common/structured/structured.h"
#include "common/tokenizer/tokenizer.h"
#include "common/utf8.h"
#include "engine/engine.h"
#include "engine/make_model.h"
#include "kernels/backend_factory.h"
#include "services/cli/bench_util.h"
#include "services/cli/command.h"

namespace pdserve::cli {
namespace {

using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

double Micros(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::micro>(b - a).count();
}

// CPU time of the calling thread.
double ThreadCpuMs() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e3 + static_cast<double>(ts.tv_nsec) * 1e-6;
}

double LoadAverage() {
  std::ifstream in("/proc/loadavg");
  double load = -1;
  in >> load;
  return in ? load : -1;
}

// ---------------------------------------------------------------- vocabulary

std::vector<std::optional<std::string>> SyntheticVocabulary(size_t size, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto pick = [&](size_t n) { return static_cast<size_t>(rng() % n); };
  std::set<std::string> seen;
  std::vector<std::optional<std::string>> out;
  auto add = [&](const std::string& s) {
    if (!s.empty() && out.size() + 256 < size && seen.insert(s).second) out.push_back(s);
  };
  for (int b = 0; b < 256; ++b) {
    seen.insert(std::string(1, static_cast<char>(b)));
    out.push_back(std::string(1, static_cast<char>(b)));
  }
  static const char* kOnsets[] = {"",   "b",  "c",  "d",  "f",  "g",  "h",   "j",  "k",
                                  "l",  "m",  "n",  "p",  "r",  "s",  "t",   "v",  "w",
                                  "y",  "z",  "br", "ch", "cl", "cr", "dr",  "fl", "gr",
                                  "pl", "pr", "sh", "sl", "sp", "st", "str", "th", "tr"};
  static const char* kVowels[] = {"a",  "e",  "i",  "o",  "u",  "ai", "ea",
                                  "ee", "ie", "io", "oo", "ou", "y"};
  static const char* kCodas[] = {"",   "",     "n",    "r",   "s",  "t",  "l",
                                 "d",  "m",    "ng",   "nd",  "st", "ck", "ll",
                                 "ss", "tion", "ment", "ing", "er", "ed", "ly"};
  auto word = [&] {
    std::string w;
    const size_t syllables = 1 + pick(3);
    for (size_t i = 0; i < syllables; ++i) {
      w += kOnsets[pick(std::size(kOnsets))];
      w += kVowels[pick(std::size(kVowels))];
      w += kCodas[pick(std::size(kCodas))];
    }
    return w;
  };
  // Numbers: every 1-3 digit string, as Llama-3 has them.
  for (int n = 0; n < 1000; ++n) {
    add(std::to_string(n));
    if (n < 100) add((n < 10 ? "00" : "0") + std::to_string(n));
  }
  // Whitespace runs.
  for (int n = 1; n <= 16; ++n) {
    add(std::string(n, ' '));
    add("\n" + std::string(n, ' '));
    add(std::string(n, '\t'));
    add(std::string(n % 4 + 1, '\n'));
  }
  // Punctuation, JSON and code fragments, quotes everywhere.
  static const char* kPunct[] = {"{", "}",  "[", "]", "(", ")", ":", ",", ".", ";", "\"",
                                 "'", "\\", "/", "-", "_", "=", "+", "*", "&", "?", "!",
                                 "<", ">",  "#", "@", "$", "%", "|", "~", "`", "^"};
  for (const char* a : kPunct) {
    for (const char* b : kPunct) {
      add(std::string(a) + b);
      if (pick(4) == 0) add(std::string(a) + b + kPunct[pick(std::size(kPunct))]);
      if (pick(6) == 0) add(std::string(" ") + a + b);
      if (pick(6) == 0) add(std::string(a) + b + "\n");
    }
  }
  static const char* kJson[] = {"\":",   "\": ",  "\",",    "\", \"", "\"}",     "\"},",   "\"]",
                                "\"],",  "{\"",   "[{\"",   "\":\"",  "\": \"",  "\":[",   "\": [",
                                "\":{",  "\": {", "},{",    "}, {",   "}]",      "]}",     "\"\n",
                                "\",\n", "\"\n}", "\")",    "\");",   "\">",     "\"/>",   "='",
                                "=\"",   "\\\"",  "\\n",    "\\\\",   "\\u00",   "null",   "true",
                                "false", ":true", ":false", ":null",  "\":true", "\":null"};
  for (const char* j : kJson) add(j);
  // Words: bare, with a leading space, capitalised; some with punctuation
  // or a quote attached (a third of real BPE vocabularies is such tokens).
  while (out.size() + 256 < size * 80 / 100) {
    std::string w = word();
    switch (pick(10)) {
      case 0:
      case 1:
      case 2:
        add(" " + w);
        break;
      case 3:
        w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
        add(" " + w);
        break;
      case 4:
        w[0] = static_cast<char>(std::toupper(static_cast<unsigned char>(w[0])));
        add(w);
        break;
      case 5:
        add(w + kPunct[pick(std::size(kPunct))]);
        break;
      case 6:
        add(pick(2) ? "\"" + w : w + "\"");
        break;
      case 7:
        add("_" + w);
        break;
      default:
        add(w);
    }
  }
  // Other scripts: CJK (3 bytes), Cyrillic and accented Latin (2), emoji
  // (4), and pieces of their UTF-8 sequences.
  auto utf8 = [](uint32_t cp) {
    std::string s;
    AppendUtf8(cp, &s);
    return s;
  };
  while (out.size() + 256 < size * 97 / 100) {
    switch (pick(6)) {
      case 0:
        add(utf8(0x4E00 + static_cast<uint32_t>(pick(20000))));
        break;
      case 1:
        add(utf8(0x4E00 + static_cast<uint32_t>(pick(20000))) +
            utf8(0x4E00 + static_cast<uint32_t>(pick(20000))));
        break;
      case 2: {
        std::string w = pick(2) ? " " : "";
        for (size_t i = 0, n = 2 + pick(6); i < n; ++i)
          w += utf8(0x430 + static_cast<uint32_t>(pick(32)));
        add(w);
        break;
      }
      case 3:
        add(word() + utf8(0xE0 + static_cast<uint32_t>(pick(32))) + word());
        break;
      case 4:
        add(utf8(0x1F600 + static_cast<uint32_t>(pick(80))));
        break;
      default: {
        const std::string c = utf8(0x4E00 + static_cast<uint32_t>(pick(20000)));
        add(pick(2) ? c.substr(0, 2) : c.substr(1));
      }
    }
  }
  // Code: identifiers and operators.
  while (out.size() + 256 < size) {
    add(pick(2) ? "." + word() + "(" : word() + "_" + word());
  }
  while (out.size() < size) out.push_back(std::nullopt);  // special tokens, EOS among them
  return out;
}

// ---------------------------------------------------------------- schemas

struct NamedSchema {
  std::string name;
  OutputConstraint constraint;
};

std::vector<NamedSchema> Schemas() {
  using Kind = OutputConstraint::Kind;
  std::string cities = "[";
  for (int i = 0; i < 1000; ++i)
    cities += (i ? ",\"" : "\"") + std::string("city-") + std::to_string(1000 + i) + "\"";
  cities += "]";
  return {
      // What OpenAI's strict mode takes (and the openai client's zod helper
      // writes): strings, numbers, enums, arrays, nested objects, no bounds.
      {"typical", {Kind::kJsonSchema, R"({"type":"object","properties":{
          "name":{"type":"string"},"age":{"type":"integer"},"email":{"type":"string"},
          "role":{"type":"string","enum":["admin","user","guest"]},"score":{"type":"number"},
          "tags":{"type":"array","items":{"type":"string"}},"verified":{"type":"boolean"},
          "address":{"type":"object","properties":{"street":{"type":"string"},"city":{"type":"string"},
            "country":{"type":"string"}},"required":["street","city","country"],"additionalProperties":false},
          "manager":{"anyOf":[{"type":"string"},{"type":"null"}]}},
          "required":["name","age","email","role","score","tags","verified","address","manager"],
          "additionalProperties":false})"}},
      {"flat", {Kind::kJsonSchema, R"({"type":"object","properties":{
          "name":{"type":"string"},"age":{"type":"integer","minimum":0,"maximum":150},
          "email":{"type":"string","format":"email"},"score":{"type":"number"},
          "active":{"type":"boolean"},"role":{"enum":["admin","user","guest"]},
          "nickname":{"type":"string","maxLength":20},"created":{"type":"string","format":"date"}},
          "required":["name","age","email","active","role"],"additionalProperties":false})"}},
      {"nested", {Kind::kJsonSchema, R"({"type":"object","properties":{
          "order":{"type":"object","properties":{"id":{"type":"string","format":"uuid"},
            "customer":{"type":"object","properties":{"name":{"type":"string"},
              "address":{"type":"object","properties":{"street":{"type":"string"},"city":{"type":"string"},
                "zip":{"type":"string","pattern":"^[0-9]{5}$"}},"required":["street","city","zip"],
                "additionalProperties":false}},"required":["name","address"],"additionalProperties":false},
            "items":{"type":"array","items":{"type":"object","properties":{"sku":{"type":"string"},
              "qty":{"type":"integer","minimum":1},"price":{"type":"number","minimum":0}},
              "required":["sku","qty","price"],"additionalProperties":false},"minItems":1,"maxItems":20}},
            "required":["id","customer","items"],"additionalProperties":false},
          "notes":{"type":"array","items":{"type":"string"}}},"required":["order"],
          "additionalProperties":false})"}},
      {"recursive", {Kind::kJsonSchema, R"({"$defs":{"node":{"type":"object","properties":{
          "name":{"type":"string"},"value":{"anyOf":[{"type":"number"},{"type":"string"},{"type":"null"}]},
          "children":{"type":"array","items":{"$ref":"#/$defs/node"}}},"required":["name"],
          "additionalProperties":false}},"$ref":"#/$defs/node"})"}},
      {"enum_heavy",
       {Kind::kJsonSchema,
        R"({"type":"object","properties":{"from":{"enum":)" + cities + R"(},"to":{"enum":)" +
            cities + R"(},"via":{"type":"array","items":{"enum":)" + cities +
            R"(},"maxItems":5}},"required":["from","to"],"additionalProperties":false})"}},
      {"long_patterns", {Kind::kJsonSchema, R"J({"type":"object","properties":{
          "code":{"type":"string","pattern":"^[A-Z]{3}-[0-9]{4}-[a-z]{2,8}(\\.[a-z]{2,4}){1,3}$"},
          "phone":{"type":"string","pattern":"^\\+?[0-9]{1,3}[ -]?\\(?[0-9]{2,4}\\)?([ -]?[0-9]{2,4}){2,3}$"},
          "when":{"type":"string","format":"date-time"},"id":{"type":"string","format":"uuid"},
          "title":{"type":"string","minLength":5,"maxLength":64}},
          "required":["code","phone","when","id","title"],"additionalProperties":false})J"}},
      {"json_object", {Kind::kJsonObject, ""}},
  };
}

// ---------------------------------------------------------------- benches

nlohmann::json Line(const std::string& kind) {
  return {
      {"bench", "grammar"}, {"kind", kind}, {"machine", MachineJson()}, {"load_1m", LoadAverage()}};
}

void Emit(const nlohmann::json& j) {
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

// Mask time along random walks: at each step the mask, then a random
// allowed token (uniformly among the allowed), until EOS, a dead end or the
// step limit.
void MaskWalks(const std::string& name, const std::shared_ptr<const structured::CompiledGrammar>& g,
               int walks, int steps, uint64_t seed, nlohmann::json* out) {
  std::mt19937_64 rng(seed);
  std::vector<double> fill_us, accept_us;
  std::vector<uint64_t> mask(g->mask_words());
  std::vector<TokenId> allowed;
  int64_t finished = 0;
  for (int w = 0; w < walks; ++w) {
    structured::Matcher m(g);
    for (int s = 0; s < steps; ++s) {
      const auto t0 = Clock::now();
      const bool any = m.FillNextTokenBitmask(mask);
      const auto t1 = Clock::now();
      fill_us.push_back(Micros(t0, t1));
      if (!any) break;
      allowed.clear();
      for (size_t k = 0; k < mask.size(); ++k) {
        for (uint64_t bits = mask[k]; bits; bits &= bits - 1) {
          allowed.push_back(
              static_cast<TokenId>(k * 64 + static_cast<size_t>(__builtin_ctzll(bits))));
        }
      }
      // Once the document may end, end it often, as a model would.
      TokenId t = allowed[rng() % allowed.size()];
      if (m.CanEnd() && rng() % 2 == 0) t = g->vocab().eos().front();
      const auto t2 = Clock::now();
      m.AcceptToken(t);
      accept_us.push_back(Micros(t2, Clock::now()));
      if (m.IsTerminated()) {
        ++finished;
        break;
      }
    }
  }
  (*out)["schema"] = name;
  (*out)["steps"] = fill_us.size();
  (*out)["walks_completed"] = finished;
  (*out)["mask_us_p50"] = Percentile(fill_us, 0.5);
  (*out)["mask_us_p99"] = Percentile(fill_us, 0.99);
  (*out)["mask_us_max"] = Percentile(fill_us, 1.0);
  (*out)["accept_us_p50"] = Percentile(accept_us, 0.5);
  (*out)["accept_us_p99"] = Percentile(accept_us, 0.99);
}

// Decode tokens/s of one sequence at a time on `model`, constrained by `c`
// or not; only decode steps are timed (the prompt's step is not).
nlohmann::json DecodeRate(Model* model, const Tokenizer& tok,
                          const std::optional<OutputConstraint>& c, float temperature,
                          int64_t min_tokens) {
  EngineOptions eo;
  eo.kv_cache_bytes = 64 << 20;
  auto engine = Engine::Create(model, eo, &tok);
  if (!engine.ok()) {
    return {{"error", engine.status().message()}};
  }
  std::shared_ptr<const structured::CompiledGrammar> grammar;
  if (c) {
    structured::GrammarCache cache(
        structured::Vocabulary::FromTokenizer(tok, model->config().eos_token_ids),
        structured::CompileOptions{});
    auto g = cache.Get(*c);
    if (!g.ok()) return {{"error", g.status().message()}};
    grammar = *g;
  }
  int64_t tokens = 0, requests = 0;
  double seconds = 0;
  for (RequestId id = 1; tokens < min_tokens; ++id) {
    EngineRequest r;
    r.id = id;
    r.prompt = tok.Encode("Here is the record as JSON:", true);
    r.params.temperature = temperature;
    r.params.seed = id;
    r.params.max_tokens = 256;
    r.params.constraint = c;
    r.grammar = grammar;
    if (!(*engine)->AddRequest(r).ok()) break;
    (void)(*engine)->Step();  // prefill and the first token
    while ((*engine)->HasUnfinished()) {
      const auto t0 = Clock::now();
      auto out = (*engine)->Step();
      seconds += Micros(t0, Clock::now()) * 1e-6;
      if (!out.ok()) break;
      for (const auto& o : *out) tokens += static_cast<int64_t>(o.new_token_ids.size());
    }
    ++requests;
  }
  return {{"decode_tokens", tokens},
          {"requests", requests},
          {"tokens_per_second", seconds > 0 ? static_cast<double>(tokens) / seconds : 0.0}};
}

int RunBenchGrammar(int argc, char** argv) {
  FlagSet flags("bench grammar",
                "Structured outputs: constraint compile time, per-token mask time (p50/p99) on a "
                "synthetic 128k-token vocabulary, and decode tokens/s with a schema on the small "
                "preset. One JSON line per result.");
  int64_t vocab_size = 128256, repeats = 3, walks = 20, steps = 300, decode_tokens = 1024,
          threads = 2;
  int64_t max_whitespace = structured::JsonSchemaOptions{}.max_whitespace;
  int64_t rounds = 5;
  std::string only;
  bool decode = true;
  flags.AddInt("vocab", &vocab_size, "entries of the synthetic vocabulary");
  flags.AddInt("repeats", &repeats, "compilations per schema after the first (median reported)");
  flags.AddInt("walks", &walks, "random walks per schema for the mask time");
  flags.AddInt("steps", &steps, "steps per walk at most");
  flags.AddString("schema", &only,
                  "only this schema (typical, flat, nested, recursive, enum_heavy, long_patterns, "
                  "json_object)");
  flags.AddBool("decode", &decode, "also measure decode tokens/s on the small preset");
  flags.AddInt("decode-tokens", &decode_tokens, "decode tokens per measurement");
  flags.AddInt("threads", &threads, "CPU threads of the decode measurement");
  flags.AddInt("rounds", &rounds,
               "decode measurements with and without a schema, interleaved (the machine may be "
               "shared: the summary takes the median ratio)");
  flags.AddInt("max-whitespace", &max_whitespace,
               "whitespace characters allowed between JSON tokens (as --grammar-max-whitespace)");
  ParseFlagsOrExit(flags, argc, argv);
  if (vocab_size < 512 || vocab_size > 1 << 20)
    UsageError("bench grammar", "--vocab must be in [512, 1048576]");
  if (repeats < 1 || walks < 1 || steps < 1 || decode_tokens < 1 || threads < 1 || rounds < 1)
    UsageError("bench grammar", "counts must be positive");

  const auto vt0 = Clock::now();
  auto tokens = SyntheticVocabulary(static_cast<size_t>(vocab_size), 20261126);
  const TokenId eos = static_cast<TokenId>(vocab_size - 1);
  auto vocab = structured::Vocabulary::Create(std::move(tokens), {eos});
  nlohmann::json v = Line("vocabulary");
  v["tokens"] = vocab->size();
  v["trie_nodes"] = vocab->trie().size();
  v["max_token_bytes"] = vocab->max_token_bytes();
  v["build_ms"] = Micros(vt0, Clock::now()) / 1e3;
  v["synthetic"] =
      "deterministic, Llama-3-shaped byte-level BPE (the real tokenizer.json is not available "
      "offline)";
  Emit(v);

  // Three compile times per schema: cold (no position shared from an
  // earlier grammar), after a worker's warm-up (JSON's strings, numbers and
  // any-value precomputed, as GrammarCompiler does at start), and again
  // (every position of its own plain rules shared).
  structured::CompileOptions options;
  options.json.max_whitespace = static_cast<int>(max_whitespace);
  // Wall and thread CPU milliseconds: on a shared machine the CPU time is
  // what the compile itself costs, the wall time what a request waited.
  struct Times {
    double grammar_ms = 0, total_ms = 0, grammar_cpu_ms = 0, total_cpu_ms = 0;
  };
  auto compile = [&](const NamedSchema& s,
                     Times* t) -> StatusOr<std::shared_ptr<const structured::CompiledGrammar>> {
    const auto t0 = Clock::now();
    const double c0 = ThreadCpuMs();
    auto g = structured::ConstraintGrammar(s.constraint, options);
    const auto t1 = Clock::now();
    const double c1 = ThreadCpuMs();
    if (!g.ok()) return g.status();
    auto c = structured::CompiledGrammar::Create(*g, vocab);
    t->grammar_ms = Micros(t0, t1) / 1e3;
    t->total_ms = Micros(t0, Clock::now()) / 1e3;
    t->grammar_cpu_ms = c1 - c0;
    t->total_cpu_ms = ThreadCpuMs() - c0;
    return c;
  };
  for (const NamedSchema& s : Schemas()) {
    if (!only.empty() && s.name != only) continue;
    Times cold_t, warm_t, ignored;
    std::vector<double> again_ms, again_cpu_ms, again_grammar_cpu_ms;
    structured::ClearSharedPositionCache();
    auto cold = compile(s, &cold_t);
    if (!cold.ok()) {
      std::fprintf(stderr, "bench grammar: %s: %s\n", s.name.c_str(),
                   cold.status().message().c_str());
      return 1;
    }
    const structured::CompiledGrammar::Stats cold_stats = (*cold)->stats();
    structured::ClearSharedPositionCache();
    (void)compile({"warm-up", {OutputConstraint::Kind::kJsonObject, ""}}, &ignored);
    auto warm = compile(s, &warm_t);
    std::shared_ptr<const structured::CompiledGrammar> compiled = *warm;
    for (int64_t rep = 0; rep < repeats; ++rep) {
      Times t;
      auto again = compile(s, &t);
      again_ms.push_back(t.total_ms);
      again_cpu_ms.push_back(t.total_cpu_ms);
      again_grammar_cpu_ms.push_back(t.grammar_cpu_ms);
      compiled = *again;
    }
    nlohmann::json j = Line("compile");
    j["schema"] = s.name;
    j["vocab"] = vocab->size();
    j["max_whitespace"] = max_whitespace;
    j["grammar_states"] = compiled->grammar().num_states();
    j["grammar_ms"] = cold_t.grammar_ms;
    j["compile_ms_cold"] = cold_t.total_ms;
    j["compile_ms_after_warmup"] = warm_t.total_ms;
    j["compile_ms_again_median"] = Percentile(again_ms, 0.5);
    j["compile_cpu_ms_cold"] = cold_t.total_cpu_ms;
    j["compile_cpu_ms_after_warmup"] = warm_t.total_cpu_ms;
    j["compile_cpu_ms_again_median"] = Percentile(again_cpu_ms, 0.5);
    j["grammar_cpu_ms_again_median"] = Percentile(again_grammar_cpu_ms, 0.5);
    j["trie_visits_cold"] = cold_stats.work;
    j["mask_kib"] = compiled->stats().bytes / 1024;
    j["dense_positions"] = compiled->stats().dense_positions;
    j["suffix_groups"] = compiled->stats().suffix_groups;
    j["uncertain_tokens"] = compiled->stats().uncertain_tokens;
    Emit(j);
    nlohmann::json m = Line("mask");
    m["vocab"] = vocab->size();
    MaskWalks(s.name, compiled, static_cast<int>(walks), static_cast<int>(steps), 7, &m);
    Emit(m);
  }

  if (decode) {
    // The small preset, written once to a temporary folder.
    const fs::path dir =
        fs::temp_directory_path() / ("pdserve-bench-grammar-" + std::to_string(::getpid()));
    auto spec = PresetModelSpec("small");
    if (!spec.ok() || !WriteModel(*spec, dir.string()).ok()) {
      std::fprintf(stderr, "bench grammar: cannot write the small preset\n");
      return 1;
    }
    auto backend = kernels::CreateBackend("cpu", static_cast<int>(threads));
    auto model = backend.ok() ? Model::Load(dir.string(), backend->get())
                              : StatusOr<std::unique_ptr<Model>>(backend.status());
    auto tok = Tokenizer::Load(dir.string());
    if (!model.ok() || !tok.ok()) {
      std::fprintf(stderr, "bench grammar: cannot load the small preset\n");
      return 1;
    }
    const OutputConstraint schema{OutputConstraint::Kind::kJsonSchema,
                                  R"({"type":"object","properties":{"text":{"type":"string"},
                                      "n":{"type":"array","items":{"type":"integer"}}},
                                      "required":["text","n"],"additionalProperties":false})"};
    std::vector<double> ratios;
    for (int64_t round = 0; round < rounds; ++round) {  // interleaved: the machine may be shared
      double rate[2] = {0, 0};
      for (bool constrained : {false, true}) {
        nlohmann::json d = Line("decode");
        d["model"] = "small preset";
        d["threads"] = threads;
        d["round"] = round;
        d["constrained"] = constrained;
        d["temperature"] = 1.0;
        d.update(DecodeRate(model->get(), **tok,
                            constrained ? std::optional<OutputConstraint>(schema) : std::nullopt,
                            1.0f, decode_tokens));
        rate[constrained] = d.value("tokens_per_second", 0.0);
        Emit(d);
      }
      if (rate[0] > 0) ratios.push_back(rate[1] / rate[0]);
    }
    nlohmann::json summary = Line("decode_summary");
    summary["model"] = "small preset";
    summary["rounds"] = rounds;
    summary["constrained_over_unconstrained_median"] = Percentile(ratios, 0.5);
    summary["constrained_over_unconstrained_min"] = Percentile(ratios, 0.0);
    summary["constrained_over_unconstrained_max"] = Percentile(ratios, 1.0);
    Emit(summary);
    std::error_code ec;
    fs::remove_all(dir, ec);
  }
  return 0;
}

}  // namespace

PDSERVE_COMMAND("bench grammar",
                "structured outputs: compile time, per-token mask time, decode tok/s with a schema",
                RunBenchGrammar);

}  // namespace pdserve::cli
