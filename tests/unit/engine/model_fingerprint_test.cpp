// engine/model_fingerprint.h: a model folder's fingerprint follows what its
// KV depends on and nothing else. Copies of a folder elsewhere agree; other
// weights of the same name and shapes (another seed, one tensor rewritten),
// another RoPE setting or another tokenizer differ; dummy weights differ
// from the folder's real ones; a folder without weights is an error.
#include "engine/model_fingerprint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>

#include "engine/safetensors.h"
#include "tests/support/test_models.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

std::string Write(const std::string& name, const ModelSpec& spec) {
  const std::string dir = testing::NewTempDir(name) + "/model";
  const Status st = WriteModel(spec, dir);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return dir;
}

uint64_t Fingerprint(const std::string& dir, LoadFormat format = LoadFormat::kSafetensors) {
  auto f = ModelFingerprint(dir, format);
  EXPECT_TRUE(f.ok()) << f.status().ToString();
  return f.ok() ? *f : 0;
}

TEST(ModelFingerprintTest, FollowsWeightsConfigAndTokenizerNotThePath) {
  const ModelSpec spec;
  const std::string a = Write("fp-a", spec);
  const uint64_t base = Fingerprint(a);
  // The same files elsewhere: the same model.
  const std::string copy = testing::NewTempDir("fp-copy") + "/elsewhere";
  fs::copy(a, copy, fs::copy_options::recursive);
  EXPECT_EQ(Fingerprint(copy), base);

  // A fine-tune: same name, same shapes, other weights.
  ModelSpec tuned = spec;
  tuned.seed = 7;
  EXPECT_NE(Fingerprint(Write("fp-seed", tuned)), base);

  // Another RoPE base: the same weights compute other keys.
  ModelSpec rope = spec;
  rope.rope_theta = 500000.0;
  EXPECT_NE(Fingerprint(Write("fp-rope", rope)), base);

  // Another tokenizer: the same text gives other token ids.
  const std::string tok = testing::NewTempDir("fp-tok") + "/model";
  fs::copy(a, tok, fs::copy_options::recursive);
  { std::ofstream(tok + "/tokenizer_config.json", std::ios::app) << " "; }
  EXPECT_NE(Fingerprint(tok), base);

  // Dummy weights are not the folder's weights.
  EXPECT_NE(Fingerprint(a, LoadFormat::kDummy), base);
  EXPECT_EQ(Fingerprint(a, LoadFormat::kDummy), Fingerprint(copy, LoadFormat::kDummy));
}

// Every tensor of a one-file model, to write back edited.
std::vector<TensorToWrite> ReadTensors(const std::string& dir) {
  auto files = WeightFiles::Open(dir);
  EXPECT_TRUE(files.ok()) << files.status().ToString();
  std::vector<TensorToWrite> tensors;
  if (!files.ok()) return tensors;
  for (const auto& [name, t] : (*files)->tensors()) {
    tensors.push_back(
        {name, t->dtype_name, t->shape, std::vector<uint8_t>(t->data, t->data + t->bytes)});
  }
  return tensors;
}

TEST(ModelFingerprintTest, OneRewrittenTensorChangesIt) {
  ModelSpec wide;  // MLP matrices past the size hashed whole
  wide.intermediate_size = 1024;
  const std::string a = Write("fp-tensor", wide);
  const uint64_t base = Fingerprint(a);
  // Rewrite one tensor of the file (the largest that is no token table,
  // sampled rather than read whole) with other values of the same dtype
  // and shape, as a fine-tune of that one matrix would.
  std::vector<TensorToWrite> tensors = ReadTensors(a);
  std::string largest;
  size_t largest_bytes = 0;
  for (const auto& t : tensors) {
    if (t.data.size() > largest_bytes && t.name.find("embed") == std::string::npos &&
        t.name.find("lm_head") == std::string::npos) {
      largest_bytes = t.data.size();
      largest = t.name;
    }
  }
  ASSERT_GT(largest_bytes, 64u << 10) << "the tensor should be sampled, not hashed whole";
  for (auto& t : tensors) {
    if (t.name != largest) continue;
    for (size_t i = 0; i < t.data.size(); i += 4) t.data[i] ^= 0x01;  // each fp32's lowest bit
  }
  ASSERT_TRUE(WriteSafetensors(a + "/model.safetensors", tensors).ok());
  EXPECT_NE(Fingerprint(a), base);
}

// One token's embedding row retrained (a new special token, PEFT's
// trainable tokens merged in): a change no sampled window covers, which the
// token table's whole hash sees.
TEST(ModelFingerprintTest, OneEditedRowOfTheTokenTableChangesIt) {
  const std::string a = Write("fp-row", ModelSpec{});
  const uint64_t base = Fingerprint(a);
  std::vector<TensorToWrite> tensors = ReadTensors(a);
  bool edited = false;
  for (auto& t : tensors) {
    if (t.name != "model.embed_tokens.weight") continue;
    ASSERT_GT(t.data.size(), 64u << 10) << "a table past the size hashed whole anyway";
    // Halfway between two of the 16 sampled windows.
    const size_t last = t.data.size() - 256;
    const size_t at = (last * 7 / 15 + last * 8 / 15) / 2;
    t.data[at] ^= 0x01;
    edited = true;
  }
  ASSERT_TRUE(edited);
  ASSERT_TRUE(WriteSafetensors(a + "/model.safetensors", tensors).ok());
  EXPECT_NE(Fingerprint(a), base);
}

TEST(ModelFingerprintTest, AFolderWithoutWeightsIsAnError) {
  const std::string dir = testing::NewTempDir("fp-empty");
  { std::ofstream(dir + "/config.json") << "{}"; }
  auto f = ModelFingerprint(dir);
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().code(), StatusCode::kNotFound);
}

// A folder where a fingerprinted file is a directory: an error naming it,
// never an exception out of the read (the worker aborted at start).
TEST(ModelFingerprintTest, ADirectoryInPlaceOfAFileIsAnError) {
  const std::string dir = Write("fp-dir", ModelSpec{});
  fs::remove(dir + "/tokenizer_config.json");
  fs::create_directory(dir + "/tokenizer_config.json");
  auto f = ModelFingerprint(dir, LoadFormat::kDummy);
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("tokenizer_config.json"), std::string::npos)
      << f.status().ToString();
  // An empty file is a file.
  fs::remove(dir + "/tokenizer_config.json");
  { std::ofstream(dir + "/tokenizer_config.json"); }
  EXPECT_TRUE(ModelFingerprint(dir, LoadFormat::kDummy).ok());
}

}  // namespace
}  // namespace pdserve
