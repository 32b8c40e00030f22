// Structured outputs end to end: a few hundred generated JSON Schemas sent to
// a real stack (router + prefill + decode workers) as response_format, at
// temperature 0 and 1, on the tiny random model and on stories260K; every
// output must parse and validate under an independent validator (ajv with
// ajv-formats), and end with finish_reason "stop". Half of the prompts are
// long enough to be prefilled remotely, so the first token is sampled under
// the grammar on the prefill worker. vLLM's structured_outputs extras
// (regex, choice, grammar) are checked the same way.
// Usage: node structured_outputs.mjs PDSERVE_BIN NODE_MODULES_DIR [STORIES260K_DIR]
import { spawn, execFileSync } from 'node:child_process';
import { existsSync, mkdtempSync, rmSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { randomBytes } from 'node:crypto';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import test, { after } from 'node:test';
import assert from 'node:assert/strict';

const [bin, nodeModules, storiesDir] = process.argv.slice(2);
const require = createRequire(path.join(nodeModules, 'noop.js'));
const Ajv = require('ajv/dist/2020').default;
const addFormats = require('ajv-formats').default ?? require('ajv-formats');

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-structured-'));
const children = [];
const secretFile = path.join(dir, 'cluster-secret');
writeFileSync(secretFile, randomBytes(32).toString('hex') + '\n', { mode: 0o600 });
after(() => {
  for (const c of children) c.kill('SIGKILL');
  rmSync(dir, { recursive: true, force: true });
});

function start(name, args) {
  const log = path.join(dir, `${name}.log`);
  children.push(spawn(bin, args, { stdio: ['ignore', openSync(log, 'w'), openSync(log, 'a')] }));
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

// Router + one prefill + one decode worker; prompts over 16 tokens are
// prefilled remotely.
async function startStack(name, model) {
  const routerLog = start(`${name}-router`, ['router', '--model', model, '--host', '127.0.0.1',
    '--port', '0', '--control-port', '0', '--max-local-prefill', '16', '--cluster-secret-file', secretFile,
    '--grammar-max-text-bytes', '64KiB']);
  const ports = await waitFor(() => readFileSync(routerLog, 'utf8').match(/on http :(\d+), control :(\d+)/),
    'router ports');
  for (const role of ['prefill', 'decode']) {
    start(`${name}-${role}`, ['worker', '--role', role, '--model', model, '--router', `127.0.0.1:${ports[2]}`,
      '--host', '127.0.0.1', '--port', '0', '--metrics-port', '0', '--worker-id', `${name}-${role}`,
      '--threads', '1', '--transfer-tls', 'tcp', '--kv-cache-bytes', '16MiB', '--cluster-secret-file', secretFile,
      // Random models love whitespace: little of it keeps outputs inside the budget.
      '--grammar-max-whitespace', '2']);
  }
  const base = `http://127.0.0.1:${ports[1]}`;
  await waitFor(async () => {
    try { return (await fetch(`${base}/ready`)).status === 200; } catch { return false; }
  }, `${name} /ready`);
  return base;
}

// A deterministic generator (mulberry32).
function rng(seed) {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

// Schemas that a random model can finish within the token budget: every
// string bounded (maxLength, enum, format or pattern), arrays bounded.
function genSchema(r, depth = 0, defs = {}) {
  const pick = (xs) => xs[Math.floor(r() * xs.length)];
  const kind = depth >= 2 ? pick(['string', 'integer', 'number', 'boolean', 'enum', 'null', 'const'])
    : pick(['object', 'object', 'array', 'anyOf', 'string', 'integer', 'number', 'boolean', 'enum', 'ref']);
  switch (kind) {
    case 'string': {
      const s = { type: 'string' };
      const v = pick(['len', 'format', 'pattern', 'len']);
      if (v === 'len') { s.maxLength = 1 + Math.floor(r() * 12); if (r() < 0.5) s.minLength = Math.floor(r() * (s.maxLength + 1)); }
      if (v === 'format') s.format = pick(['date', 'time', 'date-time', 'uuid', 'email', 'ipv4']);
      if (s.format === 'email') s.maxLength = 24;  // its local part is unbounded otherwise
      if (v === 'pattern') s.pattern = pick(['^[a-z]{2,6}$', '^[A-Z][a-z]{0,5}-[0-9]{2}$', '^(yes|no|maybe)$', '^\\d{3}$']);
      return s;
    }
    case 'integer': {
      const s = { type: 'integer' };
      if (r() < 0.6) s.minimum = Math.floor(r() * 200) - 100;
      if (r() < 0.6) s.maximum = (s.minimum ?? -100) + 1 + Math.floor(r() * 300);
      if (s.minimum !== undefined && r() < 0.2) { s.exclusiveMinimum = s.minimum; delete s.minimum; }
      return s;
    }
    case 'number': {
      const s = { type: 'number' };
      if (r() < 0.5) s.minimum = Math.round((r() * 20 - 10) * 100) / 100;
      if (r() < 0.5) s.exclusiveMaximum = Math.round(((s.minimum ?? -10) + 0.5 + r() * 30) * 10) / 10;
      return s;
    }
    case 'boolean': return { type: 'boolean' };
    case 'null': return { type: 'null' };
    case 'enum': return { enum: pick([['red', 'green', 'blue'], [1, 2, 3], ['a', 1, null, true], ['x']]) };
    case 'const': return { const: pick(['fixed', 42, false]) };
    case 'array': {
      const s = { type: 'array', items: genSchema(r, depth + 1, defs), maxItems: 1 + Math.floor(r() * 3) };
      if (r() < 0.4) s.minItems = 1;
      return s;
    }
    case 'anyOf': return { anyOf: [genSchema(r, depth + 1, defs), genSchema(r, depth + 1, defs)] };
    case 'ref': {
      const name = `item${Object.keys(defs).length}`;
      defs[name] = {};  // the name is taken before the definition recurses
      defs[name] = genSchema(r, depth + 1, defs);
      return { type: 'object', properties: { first: { $ref: `#/$defs/${name}` }, second: { $ref: `#/$defs/${name}` } },
        required: ['first'], additionalProperties: false };
    }
    default: {
      const n = 1 + Math.floor(r() * 4);
      const properties = {};
      const required = [];
      for (let i = 0; i < n; i++) {
        const key = pick(['id', 'name', 'when', 'count', 'tags', 'kind', 'score', 'note', 'ok', 'x']) + i;
        properties[key] = genSchema(r, depth + 1, defs);
        if (r() < 0.7) required.push(key);
      }
      return { type: 'object', properties, required, additionalProperties: false };
    }
  }
}

const ajv = new Ajv({ strict: false, allErrors: true });
addFormats(ajv);

async function post(base, route, body) {
  const res = await fetch(`${base}/v1/${route}`, {
    method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify(body),
  });
  const json = await res.json();
  assert.equal(res.status, 200, JSON.stringify(json));
  return json;
}

// Runs `jobs` (async functions) `width` at a time.
async function pool(jobs, width) {
  const out = [];
  let next = 0;
  await Promise.all(Array.from({ length: width }, async () => {
    while (next < jobs.length) { const i = next++; out[i] = await jobs[i](); }
  }));
  return out;
}

const shortPrompt = 'Write JSON:';
const longPrompt = 'Once upon a time there was a little robot who liked to write data. ' +
  'Every day it wrote one small record about the world, and here is the record for today:';

async function checkSchemas(base, route, count, seed, maxTokens) {
  const r = rng(seed);
  const jobs = [];
  let failures = [];
  for (let i = 0; i < count; i++) {
    const defs = {};
    const schema = genSchema(r, 0, defs);
    if (Object.keys(defs).length) schema.$defs = defs;
    const validate = ajv.compile(schema);
    for (const temperature of [0, 1]) {
      // Long prompts start differently, so that no cached prefix keeps them local.
      const prompt = (i + temperature) % 2 ? `Record ${i}.${temperature}. ${longPrompt}` : shortPrompt;
      const body = {
        max_tokens: maxTokens, temperature, seed: i,
        response_format: { type: 'json_schema', json_schema: { name: `s${i}`, schema, strict: true } },
      };
      if (route === 'chat/completions') body.messages = [{ role: 'user', content: prompt }];
      else body.prompt = prompt;
      jobs.push(async () => {
        let res;
        try { res = await post(base, route, body); } catch (e) {
          failures.push(`schema ${i}: ${JSON.stringify(schema)}: ${e.message}`);
          return;
        }
        const choice = res.choices[0];
        const text = route === 'chat/completions' ? choice.message.content : choice.text;
        let value;
        try { value = JSON.parse(text); } catch (e) {
          failures.push(`schema ${i} T=${temperature}: ${JSON.stringify(schema)}: not JSON (${choice.finish_reason}): ${text.slice(0, 200)}`);
          return;
        }
        if (process.env.PDSERVE_TEST_VERBOSE) console.log(route, i, temperature, JSON.stringify(schema), JSON.stringify(text));
        if (choice.finish_reason !== 'stop') failures.push(`schema ${i} T=${temperature}: finish ${choice.finish_reason}`);
        if (!validate(value)) {
          failures.push(`schema ${i} T=${temperature}: ${JSON.stringify(schema)} -> ${text} : ${ajv.errorsText(validate.errors)}`);
        }
      });
    }
  }
  await pool(jobs, 6);
  assert.deepEqual(failures, [], failures.slice(0, 5).join('\n'));
  return jobs.length;
}

// Python's json.dumps(v) (separators ", " and ": ") for booleans, strings,
// arrays and objects.
function pyDumps(v) {
  if (Array.isArray(v)) return `[${v.map(pyDumps).join(', ')}]`;
  if (v !== null && typeof v === 'object') {
    return `{${Object.entries(v).map(([k, x]) => `${JSON.stringify(k)}: ${pyDumps(x)}`).join(', ')}}`;
  }
  return JSON.stringify(v);
}

async function checkExtras(base, route) {
  const prompt = route === 'chat/completions' ? { messages: [{ role: 'user', content: 'Answer:' }] } : { prompt: 'Answer:' };
  const cases = [
    [{ regex: '[a-c]{2,4}-[0-9]{3}' }, (t) => /^[a-c]{2,4}-[0-9]{3}$/.test(t)],
    [{ choice: ['alpha', 'beta', 'gamma delta'] }, (t) => ['alpha', 'beta', 'gamma delta'].includes(t)],
    [{ grammar: 'root ::= "(" num ("," num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}' },
      (t) => /^\([1-9][0-9]{0,2}(,[1-9][0-9]{0,2}){0,3}\)$/.test(t)],
    [{ json: { type: 'object', properties: { v: { type: 'integer', minimum: 10, maximum: 20 } },
      required: ['v'], additionalProperties: false } }, (t) => { const v = JSON.parse(t).v; return v >= 10 && v <= 20; }],
    // vLLM's options: json.dumps' one-line spacing exactly, and objects
    // closed where the schema does not say (o can only be {}).
    [{ json: { type: 'object', properties: { a: { type: 'array', items: { type: 'boolean' }, maxItems: 3 },
      s: { type: 'string', maxLength: 8 }, o: { type: 'object' } }, required: ['a', 's', 'o'] },
    disable_any_whitespace: true, disable_additional_properties: true },
    (t) => { const v = JSON.parse(t); return pyDumps(v) === t && Object.keys(v.o).length === 0; }],
  ];
  for (const [so, ok] of cases) {
    for (const temperature of [0, 1]) {
      const res = await post(base, route, { ...prompt, max_tokens: 400, temperature, seed: 3, structured_outputs: so });
      const c = res.choices[0];
      const text = route === 'chat/completions' ? c.message.content : c.text;
      assert.equal(c.finish_reason, 'stop', `${JSON.stringify(so)} -> ${JSON.stringify(text)}`);
      let good = false;
      try { good = ok(text); } catch { /* not JSON: reported below */ }
      assert.ok(good, `${JSON.stringify(so)} -> ${JSON.stringify(text)}`);
      assert.equal(c.finish_reason, 'stop');
    }
  }
}

async function checkRefusals(base, route) {
  const prompt = route === 'chat/completions' ? { messages: [{ role: 'user', content: 'x' }] } : { prompt: 'x' };
  const bad = [
    [{ response_format: { type: 'json_schema', json_schema: { name: 'b', schema:
      { type: 'object', properties: { tags: { type: 'array', uniqueItems: true } } } } } },
    "'uniqueItems'", '/properties/tags'],
    [{ structured_outputs: { regex: '(a|b)*a(a|b){40}' } }, 'too complex', ''],
    [{ structured_outputs: { grammar: 'root ::= root "a"' } }, 'left-recursive', ''],
    [{ structured_outputs: { json: { type: 'string', minLength: 3, maxLength: 1 } } }, 'accepts no output', ''],
    // Over the router's --grammar-max-text-bytes.
    [{ structured_outputs: { json: { enum: Array.from({ length: 8000 }, (_, i) => `value-${i}`) } } },
      'larger than 65536 bytes', ''],
  ];
  for (const [extra, says, where] of bad) {
    const res = await fetch(`${base}/v1/${route}`, { method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ ...prompt, ...extra }) });
    const j = await res.json();
    assert.equal(res.status, 400, JSON.stringify(j));
    assert.ok(j.error.message.includes(says), j.error.message);
    assert.ok(j.error.message.includes(where), j.error.message);
  }
}

const tinyModel = path.join(dir, 'tiny');
execFileSync(bin, ['make-model', '--preset', 'tiny', '--out', tinyModel]);
const tiny = await startStack('tiny', tinyModel);
const stories = storiesDir && existsSync(path.join(storiesDir, 'model.safetensors'))
  ? await startStack('stories', storiesDir) : null;

test('tiny model: generated schemas, every output validates (ajv)', async () => {
  const n = await checkSchemas(tiny, 'chat/completions', 150, 1, 1000);
  console.log(`tiny: ${n} constrained requests validated`);
});

test('stories260K: generated schemas, every output validates (ajv)', { skip: !stories && 'stories260K absent' },
  async () => {
    const n = await checkSchemas(stories, 'completions', 100, 2, 400);
    console.log(`stories260K: ${n} constrained requests validated`);
  });

test('constrained first tokens were sampled on the prefill worker too', async () => {
  const metrics = await (await fetch(`${tiny}/metrics`)).text();
  const remote = Number(metrics.match(/pdserve_router_decisions_total\{kind="remote_prefill"\} (\d+)/)[1]);
  assert.ok(remote >= 140, `remote prefills: ${remote}`);
});

test('structured_outputs regex, choice, grammar and json', async () => {
  await checkExtras(tiny, 'chat/completions');
  if (stories) await checkExtras(stories, 'completions');
});

test('bad constraints are 400s naming the reason', async () => {
  await checkRefusals(tiny, 'chat/completions');
});
