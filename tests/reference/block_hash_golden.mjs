// Independent implementation of block hash spec v1 (docs/architecture.md section 4)
// on top of the Rust xxHash port in @node-rs/xxhash, used to produce the golden
// vectors in tests/unit/block_hash_test.cpp. Run: node block_hash_golden.mjs
import { createRequire } from 'node:module';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const require = createRequire(path.join(here, '../../.deps/npm/package.json'));
const { xxh3 } = require('@node-rs/xxhash');

function seedOf(model, salt, lora) {
  return xxh3.xxh64(Buffer.concat([Buffer.from(model, 'utf8'), Buffer.from([0]),
    Buffer.from(salt, 'utf8'), Buffer.from([0]), Buffer.from(lora, 'utf8')]));
}

function hashPrompt(seed, tokens, B) {
  const out = [];
  for (let i = 0; (i + 1) * B <= tokens.length; i++) {
    const parts = [];
    if (i > 0) {
      const p = Buffer.alloc(8);
      p.writeBigUInt64LE(out[i - 1]);
      parts.push(p);
    }
    const t = Buffer.alloc(4 * B);
    for (let k = 0; k < B; k++) t.writeUInt32LE(tokens[i * B + k] >>> 0, 4 * k);
    parts.push(t);
    out.push(xxh3.xxh64(Buffer.concat(parts), seed));
  }
  return out;
}

const range = (n, start = 0) => Array.from({ length: n }, (_, i) => start + i);
const cases = [
  ['tiny', '', '', range(16), 16],
  ['tiny', '', '', range(40), 16],
  ['tiny', 'tenant-a', '', range(16), 16],
  ['tiny', '', 'adapter-x', range(16), 16],
  ['meta-llama/Llama-3.1-8B-Instruct', '', '', [128000, 9906, 11, 1917, 0, 151643, 7, 8], 4],
];
for (const [model, salt, lora, tokens, B] of cases) {
  const seed = seedOf(model, salt, lora);
  const hs = hashPrompt(seed, tokens, B);
  console.log(JSON.stringify({ model, salt, lora, B, n: tokens.length,
    seed: '0x' + seed.toString(16).padStart(16, '0'),
    hashes: hs.map((h) => '0x' + h.toString(16).padStart(16, '0')) }));
}
