// The official `openai` npm client against a real local stack (router + one
// prefill + one decode worker on the tiny model). Greedy answers must equal
// the offline engine's (`pdserve generate`), streamed or not.
// Usage: node openai_client.mjs PDSERVE_BIN NODE_MODULES_DIR
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, openSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import test, { after } from 'node:test';
import assert from 'node:assert/strict';

const [bin, nodeModules] = process.argv.slice(2);
const require = createRequire(path.join(nodeModules, 'noop.js'));
const OpenAI = require('openai').default ?? require('openai');

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-openai-'));
const model = path.join(dir, 'tiny');
execFileSync(bin, ['make-model', '--preset', 'tiny', '--out', model]);
const children = [];
// The control plane is authenticated: every process proves this secret.
const secretFile = path.join(dir, 'cluster-secret');
writeFileSync(secretFile, randomBytes(32).toString('hex') + '\n', { mode: 0o600 });

function start(name, args) {
  const log = path.join(dir, `${name}.log`);
  const child = spawn(bin, args, { stdio: ['ignore', openSync(log, 'w'), openSync(log, 'a')] });
  children.push(child);
  return log;
}

async function waitFor(fn, what, ms = 60000) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    const v = await fn();
    if (v) return v;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`timed out waiting for ${what}`);
}

function readLog(log) {
  return execFileSync('cat', [log]).toString();
}

// A Hub-style id with a slash: the client sends it percent-encoded in paths
// (models.retrieve).
const modelId = 'pdserve-org/tiny';
const routerLog = start('router', ['router', '--model', model, '--host', '127.0.0.1', '--port', '0',
  '--control-port', '0', '--max-local-prefill', '16', '--cluster-secret-file', secretFile,
  '--model-id', modelId]);
const ports = await waitFor(() => readLog(routerLog).match(/on http :(\d+), control :(\d+)/), 'router ports');
const [httpPort, controlPort] = [ports[1], ports[2]];
for (const role of ['prefill', 'decode']) {
  start(role, ['worker', '--role', role, '--model', model, '--router', `127.0.0.1:${controlPort}`,
    '--host', '127.0.0.1', '--port', '0', '--metrics-port', '0', '--worker-id', `${role}-0`, '--threads', '1',
    '--transfer-tls', 'tcp', '--kv-cache-bytes', '8MiB',
    '--cluster-secret-file', secretFile, '--model-id', modelId]);
}
await waitFor(async () => {
  try { return (await fetch(`http://127.0.0.1:${httpPort}/ready`)).status === 200; } catch { return false; }
}, 'router /ready');

const client = new OpenAI({ baseURL: `http://127.0.0.1:${httpPort}/v1`, apiKey: 'unused', maxRetries: 0 });
const prompt = 'The quick brown fox jumps over the lazy dog, and then the dog chases the fox around the yard.';
const offline = JSON.parse(execFileSync(bin, ['generate', '--model', model, '--prompt', prompt,
  '--max-tokens', '12', '--temperature', '0', '--ignore-eos', '--json', '--threads', '1']).toString());

after(() => {
  for (const c of children) c.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

test('models.list names the served model', async () => {
  const models = await client.models.list();
  assert.deepEqual(models.data.map((m) => m.id), [modelId]);
});

test('completions equal the offline engine', async () => {
  const r = await client.completions.create({ model: modelId, prompt, max_tokens: 12, temperature: 0,
    ignore_eos: true });
  assert.equal(r.object, 'text_completion');
  assert.equal(r.choices[0].text, offline.text);
  assert.equal(r.usage.prompt_tokens, offline.prompt_token_ids.length);
  assert.equal(r.usage.completion_tokens, offline.token_ids.length);
});

test('streamed completions concatenate to the same text, with usage', async () => {
  const stream = await client.completions.create({ model: modelId, prompt, max_tokens: 12, temperature: 0,
    ignore_eos: true, stream: true, stream_options: { include_usage: true } });
  let text = '';
  let usage = null;
  let finish = null;
  for await (const chunk of stream) {
    if (chunk.choices.length) {
      text += chunk.choices[0].text;
      finish = chunk.choices[0].finish_reason ?? finish;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(text, offline.text);
  assert.equal(finish, 'length');
  assert.equal(usage.completion_tokens, 12);
});

test('models.retrieve and a batch of prompts', async () => {
  assert.equal((await client.models.retrieve(modelId)).id, modelId);
  // Each prompt of a batch answers as it would alone, in prompt order.
  const r = await client.completions.create({ model: modelId, prompt: [prompt, 'x', prompt],
    max_tokens: 12, temperature: 0, ignore_eos: true });
  assert.deepEqual(r.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(r.choices[0].text, offline.text);
  assert.equal(r.choices[2].text, offline.text);
  assert.equal(r.usage.completion_tokens, 36);
  assert.match(r._request_id ?? '', /./, 'the batch answers with its x-request-id');
  const stream = await client.completions.create({ model: modelId, prompt: [prompt, prompt],
    max_tokens: 12, temperature: 0, ignore_eos: true, stream: true,
    stream_options: { include_usage: true } });
  const texts = ['', ''];
  let usage = null;
  const ids = new Set();
  for await (const chunk of stream) {
    for (const c of chunk.choices) texts[c.index] += c.text;
    if (chunk.usage) usage = chunk.usage;
    ids.add(chunk.id);
  }
  assert.deepEqual(texts, [offline.text, offline.text]);
  assert.equal(ids.size, 1, 'one stream, one response id');
  assert.equal(usage.completion_tokens, 24);
});

test('echo with logprobs scores the prompt; a greedy continuation scores as generated', async () => {
  // Generate, then score prompt + continuation (max_tokens 0), as
  // lm-evaluation-harness's loglikelihood requests do.
  const gen = await client.completions.create({ model: modelId, prompt: offline.prompt_token_ids,
    max_tokens: 12, temperature: 0, ignore_eos: true, logprobs: 1 });
  const ids = [...offline.prompt_token_ids, ...offline.token_ids];
  const scored = await client.completions.create({ model: modelId, prompt: ids, max_tokens: 0,
    echo: true, logprobs: 1 });
  const lp = scored.choices[0].logprobs;
  assert.equal(scored.usage.completion_tokens, 0);
  assert.equal(lp.tokens.length, ids.length);
  assert.equal(lp.token_logprobs[0], null);
  assert.equal(lp.top_logprobs[0], null);
  const tail = lp.token_logprobs.slice(offline.prompt_token_ids.length);
  assert.equal(tail.length, 12);
  tail.forEach((v, i) => assert.ok(Math.abs(v - gen.choices[0].logprobs.token_logprobs[i]) < 1e-3,
    `token ${i}: scored ${v}, generated ${gen.choices[0].logprobs.token_logprobs[i]}`));
});

test('chat completions, streamed and not, agree', async () => {
  const messages = [{ role: 'system', content: 'You are terse.' }, { role: 'user', content: 'Say hello.' }];
  const r = await client.chat.completions.create({ model: modelId, messages, max_tokens: 10, temperature: 0 });
  assert.equal(r.object, 'chat.completion');
  assert.equal(r.choices[0].message.role, 'assistant');
  const stream = await client.chat.completions.create({ model: modelId, messages, max_tokens: 10,
    temperature: 0, stream: true });
  let text = '';
  for await (const chunk of stream) text += chunk.choices[0]?.delta?.content ?? '';
  assert.equal(text, r.choices[0].message.content);
  assert.ok(r.usage.prompt_tokens > 0);
});

test('logit_bias takes every token, prefilled remotely or not; penalties are accepted', async () => {
  // The long prompt is prefilled by the prefill worker (--max-local-prefill
  // 16), whose first token must honour the bias too; the short one locally.
  for (const p of [prompt, 'Hi']) {
    const r = await client.completions.create({ model: modelId, prompt: p, max_tokens: 4,
      temperature: 0, ignore_eos: true, logprobs: 0, logit_bias: { '300': 100 } });
    const tokens = r.choices[0].logprobs.tokens;
    assert.equal(tokens.length, 4);
    assert.ok(tokens.every((t) => t === tokens[0]), JSON.stringify(tokens));
    assert.equal(r.choices[0].text, tokens.join(''));
  }
  const plain = await client.completions.create({ model: modelId, prompt, max_tokens: 12,
    temperature: 0, ignore_eos: true, presence_penalty: 0, frequency_penalty: 0, logit_bias: {} });
  assert.equal(plain.choices[0].text, offline.text);
  const penalised = await client.chat.completions.create({ model: modelId,
    messages: [{ role: 'user', content: 'Say hello.' }], max_tokens: 12, temperature: 0,
    presence_penalty: 1.5, frequency_penalty: 2 });
  assert.equal(penalised.usage.completion_tokens > 0, true);
  await assert.rejects(
    client.completions.create({ model: modelId, prompt: 'x', logit_bias: { '999999': 5 } }),
    (e) => e.status === 400 && /logit_bias/.test(e.message));
  // vLLM's min_tokens holds EOS off (here the likeliest token) on both
  // workers: the first token is the prefill worker's; repetition_penalty
  // is taken there too.
  const eos = { '508': 100, '511': 100 };
  for (const p of [prompt, 'Hi']) {
    for (const [min_tokens, max_tokens] of [[0, 5], [5, 5], [3, 6]]) {
      const r = await client.completions.create({ model: modelId, prompt: p, max_tokens,
        temperature: 0, logit_bias: eos, min_tokens, repetition_penalty: 1.3 });
      const what = JSON.stringify({ p, min_tokens, max_tokens });
      // EOS (the likeliest) right after min_tokens, unless max_tokens comes first.
      const want = Math.min(min_tokens + 1, max_tokens);
      assert.equal(r.usage.completion_tokens, want, what);
      assert.equal(r.choices[0].finish_reason, want === max_tokens && min_tokens === max_tokens
        ? 'length' : 'stop', what);
    }
  }
});

test('bad requests surface as OpenAI errors', async () => {
  await assert.rejects(
    client.completions.create({ model: 'no-such-model', prompt: 'x' }),
    (e) => e.status === 404 && /does not exist/.test(e.message));
  await assert.rejects(
    client.completions.create({ model: modelId, prompt: 'x', temperature: -1 }),
    (e) => e.status === 400 && e.error?.param === 'temperature');
});
