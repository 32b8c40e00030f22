#!/usr/bin/env node
// Evaluates every PromQL expression of a Grafana dashboard against a running
// Prometheus and says which ones give no data. One JSON line per expression:
//   {"panel", "refId", "status": "ok"|"empty"|"nan"|"error", "series", "values", "error"?}
// "ok" means at least one series and every value finite. Exit status: 0 when
// every expression is ok, 1 when one is not, 2 on bad arguments or when
// Prometheus cannot be reached.
//
//   check-dashboard.mjs --prometheus URL [--dashboard FILE] [--rate-interval 1m]
//
// Expressions come from dashboard-queries.sh --resolve (the one place that
// knows how to replace the dashboard's variables).
import { execFileSync } from 'node:child_process';
import path from 'node:path';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const usage = 'usage: check-dashboard.mjs --prometheus URL [--dashboard FILE] [--rate-interval 1m]';

function fail(message) {
  process.stderr.write(`check-dashboard.mjs: ${message}\n`);
  process.exit(2);
}

const opts = { prometheus: '', dashboard: path.join(here, 'pdserve-dashboard.json'), 'rate-interval': '1m' };
const argv = process.argv.slice(2);
for (let i = 0; i < argv.length; i++) {
  const a = argv[i];
  if (a === '-h' || a === '--help') { process.stdout.write(`${usage}\n`); process.exit(0); }
  const m = /^--([a-z-]+)(?:=(.*))?$/.exec(a);
  if (!m || !(m[1] in opts)) fail(`unknown argument ${a} (${usage})`);
  const value = m[2] ?? argv[++i];
  if (value === undefined) fail(`--${m[1]} needs a value`);
  opts[m[1]] = value;
}
if (!opts.prometheus) fail(`--prometheus is required (${usage})`);
const base = opts.prometheus.replace(/\/+$/, '');

let queries;
try {
  queries = execFileSync(path.join(here, 'dashboard-queries.sh'), ['--resolve', opts.dashboard], {
    encoding: 'utf8', env: { ...process.env, RATE_INTERVAL: opts['rate-interval'] }, stdio: ['ignore', 'pipe', 'pipe'],
  }).trim().split('\n').filter(Boolean).map((l) => JSON.parse(l));
} catch (e) {
  fail(`cannot list the dashboard's queries: ${(e.stderr || e.message).toString().trim()}`);
}

let allOk = true;
for (const q of queries) {
  let body;
  try {
    const res = await fetch(`${base}/api/v1/query`, { method: 'POST', body: new URLSearchParams({ query: q.expr }) });
    body = await res.json();
  } catch (e) {
    fail(`cannot query ${base}: ${e.cause?.message || e.message}`);
  }
  const row = { panel: q.panel, refId: q.refId };
  if (body.status !== 'success') {
    Object.assign(row, { status: 'error', series: 0, values: [], error: body.error });
  } else {
    const result = body.data.resultType === 'vector' ? body.data.result.map((s) => s.value[1])
      : body.data.resultType === 'scalar' ? [body.data.result[1]] : [];
    const values = result.map(Number);
    const status = values.length === 0 ? 'empty' : values.every(Number.isFinite) ? 'ok' : 'nan';
    Object.assign(row, { status, series: values.length, values: values.slice(0, 8) });
  }
  if (row.status !== 'ok') allOk = false;
  process.stdout.write(`${JSON.stringify(row)}\n`);
}
process.exit(allOk ? 0 : 1);
