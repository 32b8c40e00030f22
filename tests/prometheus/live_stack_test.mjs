// The observability path end to end, all real processes: `pdserve up` (one
// prefill, one decode worker) scraped by the Debian Prometheus server started
// with deploy/local/prometheus.sh from the addresses `pdserve up` prints,
// loaded by `pdserve bench serve` with a shared-prefix workload, then twice
// unique prompts that push its prefixes out of the device pools into the
// workers' host and disk KV tiers and the shared-prefix workload again, which
// reads them back. Afterwards every dashboard expression must give a non-empty,
// finite result through Prometheus's HTTP API
// (deploy/grafana/check-dashboard.mjs), the prefix cache hit rate must show
// the shared prefixes (above 0.5), and the tiers must have served tokens.
//
// Run: PDSERVE_BIN=build/pdserve node --test tests/prometheus/live_stack_test.mjs
import assert from 'node:assert/strict';
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after, before, test } from 'node:test';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const pdserve = process.env.PDSERVE_BIN;
const checker = path.join(root, 'deploy/grafana/check-dashboard.mjs');
const requests = 60;  // per shared-prefix pass
const uniqueRequests = 24;  // 24 prompts of 150 words: more blocks than a 4 MiB pool holds

let dir;
let stack;
let prometheus;
let stackLog = '';
let promLog = '';
let base;       // Prometheus
let routerUrl;  // pdserve

async function query(expr) {
  const res = await fetch(`${base}/api/v1/query`, { method: 'POST', body: new URLSearchParams({ query: expr }) });
  const body = await res.json();
  assert.equal(body.status, 'success', `${expr}: ${body.error}`);
  return body.data.result.map((r) => Number(r.value[1]));
}

async function waitFor(check, message, timeoutMs = 60000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try { if (await check()) return; } catch { /* not there yet */ }
    if (Date.now() > deadline) throw new Error(`${message}\n--- pdserve up:\n${stackLog}\n--- prometheus:\n${promLog.slice(-3000)}`);
    await new Promise((r) => setTimeout(r, 250));
  }
}

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => { const { port } = s.address(); s.close(() => resolve(port)); });
    s.on('error', reject);
  });
}

before(async () => {
  assert.ok(pdserve, 'PDSERVE_BIN names the pdserve binary');
  dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-live-'));
  // A decode worker computes at most 64 prompt tokens itself: the first
  // requests of a prefix group go to the prefill worker (transfers), later
  // ones find the prefix in the decode worker's cache and compute only their
  // short suffix locally, so both pools compute prompts and every panel has data.
  // The pools are small enough for the unique prompts to evict the shared
  // prefixes into the host and disk tiers.
  stack = spawn(pdserve, ['up', '--dir', path.join(dir, 'up'), '--port', '0', '--control-port', '0',
    '--prefill-metrics-port', '0', '--decode-metrics-port', '0', '--threads', '1',
    '--kv-cache-bytes', '4MiB', '--kv-host-cache-bytes', '4MiB', '--kv-disk-cache-dir', path.join(dir, 'kv'),
    '--kv-disk-cache-bytes', '8MiB', '--max-local-prefill', '64', '--stop-timeout', '20'],
  { stdio: ['ignore', 'pipe', 'pipe'] });
  stack.stdout.on('data', (d) => { stackLog += d; });
  stack.stderr.on('data', (d) => { stackLog += d; });
  await waitFor(() => stackLog.includes('Ctrl-C stops the stack'), 'pdserve up never became ready', 120000);
  routerUrl = /ready at (http:\/\/\S+)/.exec(stackLog)[1];

  // Started exactly as `pdserve up` tells a user to.
  const hint = /deploy\/local\/prometheus\.sh (.*)/.exec(stackLog);
  assert.ok(hint, stackLog);
  const args = hint[1].replaceAll("'", '').split(/\s+/).filter(Boolean);
  const listen = `127.0.0.1:${await freePort()}`;
  base = `http://${listen}`;
  prometheus = spawn(path.join(root, 'deploy/local/prometheus.sh'),
    [...args, '--listen', listen, '--dir', path.join(dir, 'prometheus')], { stdio: ['ignore', 'pipe', 'pipe'] });
  prometheus.stdout.on('data', (d) => { promLog += d; });
  prometheus.stderr.on('data', (d) => { promLog += d; });
  await waitFor(async () => (await fetch(`${base}/-/ready`)).ok, 'Prometheus did not become ready');
  // A sample of every target before the load, so rate() sees the increase.
  await waitFor(async () => (await query('count(up{job="pdserve"} == 1)'))[0] === 3, 'targets never all up');
});

after(async () => {
  prometheus?.kill('SIGTERM');
  if (stack && stack.exitCode === null) {
    const exited = new Promise((r) => stack.once('exit', r));
    stack.kill('SIGTERM');
    await exited;
  }
  if (dir) fs.rmSync(dir, { recursive: true, force: true });
});

// Waits until Prometheus has scraped every target after `time` (seconds).
async function scrapedAfter(time) {
  await waitFor(async () => (await query('min(timestamp(up{job="pdserve"}))'))[0] > time,
    'not every target was scraped after the run');
}

// One `pdserve bench serve` run; returns its JSON result.
function bench(n, workload) {
  const run = spawnSync(pdserve, ['bench', 'serve', '--json', '--url', routerUrl, '--requests', String(n),
    '--concurrency', '4', '--max-tokens', '8', ...workload], { encoding: 'utf8' });
  assert.equal(run.status, 0, run.stderr);
  const result = JSON.parse(run.stdout.trim().split('\n').pop());
  assert.equal(result.ok, n, run.stderr);
  assert.equal(result.failed, 0);
  return result;
}

test('shared-prefix load through the KV tiers: every dashboard expression has finite data, hit rate above 0.5', async () => {
  const shared = ['--workload', 'shared-prefix', '--groups', '2', '--prefix-words', '150', '--suffix-words', '10'];
  const result = bench(requests, shared);
  assert.ok(result.cached_fraction > 0.5, `server-reported cached share ${result.cached_fraction}`);
  assert.ok(result.ttft_ms.p50 > 0 && result.ttft_ms.p50 <= result.e2e_ms.p99);
  // The tier series (onload latency, predicted tier hits) appear with the
  // first read-back: a scrape between the two rounds gives rate() its first
  // sample.
  for (const seed of ['1', '2']) {
    bench(uniqueRequests, ['--workload', 'random', '--min-words', '150', '--max-words', '150', '--seed', seed]);
    const again = bench(requests, shared);
    assert.ok(again.cached_fraction > 0.5, `server-reported cached share after the tiers ${again.cached_fraction}`);
    if (seed === '1') await scrapedAfter(Date.now() / 1000);
  }
  const benchEnd = Date.now() / 1000;
  const total = 3 * requests + 2 * uniqueRequests;

  // Wait for the scrape that saw the whole run, on both sides.
  await waitFor(async () => (await query('sum(pdserve_router_requests_total{status="ok"})'))[0] === total,
    'the router counter never reached the request count');
  await waitFor(async () => (await query('sum(pdserve_time_to_first_token_seconds_count{pool="decode"})'))[0] >= total,
    'the decode worker never reported the requests');

  // Every target scraped once more after the run ended: final values.
  await scrapedAfter(benchEnd);

  const check = spawnSync('node', [checker, '--prometheus', base], { encoding: 'utf8' });
  const rows = check.stdout.trim().split('\n').map((l) => JSON.parse(l));
  const bad = rows.filter((r) => r.status !== 'ok');
  assert.deepEqual(bad, [], `expressions without finite data:\n${bad.map((r) => JSON.stringify(r)).join('\n')}`);
  assert.equal(check.status, 0, check.stderr);

  const perPool = rows.find((r) => r.panel === 'Prefix cache hit rate per pool');
  assert.equal(perPool.values.length, 2, JSON.stringify(perPool));
  const [actual] = await query('sum(rate(pdserve_prefix_cache_hits_tokens_total[1m])) / sum(rate(pdserve_prefix_cache_queries_tokens_total[1m]))');
  assert.ok(actual > 0.5, `hit rate ${actual}`);
  // The later passes found their prefixes in the tiers, and the router expected it.
  const [tierHits] = await query('sum(pdserve_kv_tier_hit_tokens_total)');
  assert.ok(tierHits > 0, `tokens served from the KV tiers: ${tierHits}`);
  const [predicted] = await query('sum(pdserve_router_predicted_tier_hit_tokens_total)');
  assert.ok(predicted > 0, `tier hit tokens the router predicted: ${predicted}`);
});
