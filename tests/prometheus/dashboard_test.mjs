// Tests of the Grafana dashboard, its query lister and the local Prometheus
// setup: structure and PromQL conventions of deploy/grafana/pdserve-dashboard.json,
// one copy of the dashboard and of the alert rules (deploy/ links into the
// chart), and a real Prometheus server started by deploy/local/prometheus.sh
// that loads the rules and evaluates every dashboard expression, also through
// deploy/grafana/check-dashboard.mjs (the no-data detector for live runs).
//
// Run: node --test tests/prometheus/dashboard_test.mjs
import assert from 'node:assert/strict';
import { execFileSync, spawn, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import net from 'node:net';
import os from 'node:os';
import path from 'node:path';
import { after, before, describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const dashboardPath = path.join(root, 'deploy/grafana/pdserve-dashboard.json');
const lister = path.join(root, 'deploy/grafana/dashboard-queries.sh');
const checker = path.join(root, 'deploy/grafana/check-dashboard.mjs');
const dashboard = JSON.parse(fs.readFileSync(dashboardPath, 'utf8'));
const panels = dashboard.panels.flatMap((p) => [p, ...(p.panels || [])]).filter((p) => p.type !== 'row');
const targets = panels.flatMap((p) => p.targets.map((t) => ({ panel: p.title, ...t })));

// Metric names fixed by docs/architecture.md section 8 and the service issues.
const knownMetrics = new Set([
  'pdserve_prefix_cache_queries_tokens_total', 'pdserve_prefix_cache_hits_tokens_total',
  'pdserve_kv_cache_usage_ratio', 'pdserve_requests_running', 'pdserve_requests_waiting',
  'pdserve_time_to_first_token_seconds', 'pdserve_inter_token_latency_seconds',
  'pdserve_kv_transfer_seconds', 'pdserve_kv_transfer_bytes_total', 'pdserve_kv_transfer_failures_total',
  'pdserve_preemptions_total', 'pdserve_router_requests_total', 'pdserve_router_predicted_hit_tokens_total',
  'pdserve_router_prompt_tokens_total', 'pdserve_router_decisions_total',
  'pdserve_router_time_to_first_token_seconds', 'pdserve_router_route_seconds',
  'pdserve_router_kv_event_gaps_total', 'pdserve_router_workers',
  // Lower KV tiers (label tier: host or disk).
  'pdserve_kv_tier_blocks', 'pdserve_kv_tier_capacity_blocks', 'pdserve_kv_tier_hit_tokens_total',
  'pdserve_kv_tier_offload_bytes_total', 'pdserve_kv_tier_onload_bytes_total', 'pdserve_kv_tier_onload_seconds',
  'pdserve_kv_tier_corrupt_blocks_total', 'pdserve_router_predicted_tier_hit_tokens_total',
  'pdserve_kv_tier_disk_writes_total', 'pdserve_kv_tier_disk_writes_dropped_total',
  'pdserve_kv_tier_disk_write_errors_total', 'pdserve_kv_tier_disk_write_queue_blocks',
  // Hot-prefix copies and the rule that prices them (docs/routing.md).
  'pdserve_router_replications_total', 'pdserve_router_copies_declined_total',
  'pdserve_router_copy_outcomes_total', 'pdserve_router_copy_reuse_ratio',
  'pdserve_router_copy_breaker_state', 'pdserve_router_copy_budget_scale',
  'pdserve_router_copies_in_flight', 'pdserve_router_copy_inflight_limit',
  // Token eviction (docs/kv-eviction.md).
  'pdserve_kv_evicted_tokens_total', 'pdserve_kv_blocks_saved_per_request',
  // Tensor-parallel workers (docs/tensor-parallel.md).
  'pdserve_worker_tensor_parallel_size', 'pdserve_kv_cache_rank_usage_ratio',
  'pdserve_worker_all_reduce_seconds_sum', 'pdserve_worker_all_reduce_seconds_count',
]);
const metricsIn = (expr) => [...expr.matchAll(/\b(pdserve_[a-z_]+)/g)].map((m) => m[1]);
const baseName = (m) => m.replace(/_bucket$/, '');

function exprsFor(titleRegex) {
  const ps = panels.filter((p) => titleRegex.test(p.title));
  assert.equal(ps.length, 1, `expected one panel matching ${titleRegex}, found ${ps.map((p) => p.title)}`);
  return ps[0].targets.map((t) => t.expr.replace(/\s+/g, ' '));
}
const hitRate = (by) => new RegExp(
  `^sum ${by ? `by \\(${by}\\) ` : ''}\\(rate\\(pdserve_prefix_cache_hits_tokens_total\\{[^}]*\\}\\[\\$__rate_interval\\]\\)\\) / ` +
  `sum ${by ? `by \\(${by}\\) ` : ''}\\(rate\\(pdserve_prefix_cache_queries_tokens_total\\{[^}]*\\}\\[\\$__rate_interval\\]\\)\\)$`);
const quantiles = (metric) => [0.5, 0.9, 0.99].map((q) => new RegExp(
  `^histogram_quantile\\(${q}, sum by \\(le\\) \\(rate\\(${metric}_bucket\\{[^}]*\\}\\[\\$__rate_interval\\]\\)\\)\\)$`));

describe('one source of truth', () => {
  test('deploy/grafana/pdserve-dashboard.json is the chart\'s dashboard', () => {
    assert.equal(fs.realpathSync(dashboardPath), path.join(root, 'helm/pdserve/files/grafana/pdserve-dashboard.json'));
  });
  test('deploy/prometheus/pdserve-alerts.yaml is the chart\'s rule file', () => {
    assert.equal(fs.realpathSync(path.join(root, 'deploy/prometheus/pdserve-alerts.yaml')),
      path.join(root, 'helm/pdserve/files/prometheus/pdserve-alerts.yaml'));
  });
});

describe('dashboard structure', () => {
  test('a ${datasource} variable of Prometheus type feeds every panel and query', () => {
    const v = dashboard.templating.list.find((x) => x.name === 'datasource');
    assert.equal(v.type, 'datasource');
    assert.equal(v.query, 'prometheus');
    for (const p of panels) {
      assert.deepEqual(p.datasource, { type: 'prometheus', uid: '${datasource}' }, p.title);
      for (const t of p.targets) assert.equal(t.datasource.uid, '${datasource}', `${p.title} ${t.refId}`);
    }
  });
  test('unique ids, non-overlapping panels within 24 columns, a description on each', () => {
    const ids = dashboard.panels.map((p) => p.id);
    assert.equal(new Set(ids).size, ids.length);
    const cells = new Set();
    for (const p of dashboard.panels) {
      const { x, y, w, h } = p.gridPos;
      assert.ok(x >= 0 && x + w <= 24, p.title);
      for (let i = x; i < x + w; i++) {
        for (let j = y; j < y + h; j++) {
          assert.ok(!cells.has(`${i},${j}`), `${p.title} overlaps another panel`);
          cells.add(`${i},${j}`);
        }
      }
    }
    for (const p of panels) assert.ok(p.description?.length > 40, `${p.title} lacks a description`);
  });
  test('every expression names only contract metrics', () => {
    for (const t of targets) {
      const names = metricsIn(t.expr);
      assert.ok(names.length > 0, t.panel);
      for (const m of names) assert.ok(knownMetrics.has(baseName(m)), `${t.panel}: unknown metric ${m}`);
    }
  });
  test('counters and histograms only through rate() or increase(), never lifetime values', () => {
    for (const t of targets) {
      for (const m of t.expr.matchAll(/(\w+)\((pdserve_\w+_(?:total|bucket))\b/g)) {
        assert.ok(['rate', 'increase'].includes(m[1]), `${t.panel}: ${m[2]} inside ${m[1]}()`);
      }
      const bare = t.expr.match(/(?<!\()\bpdserve_\w+_(?:total|bucket)\b/g);
      assert.equal(bare, null, `${t.panel}: counter outside rate(): ${bare}`);
    }
  });
});

describe('required panels', () => {
  test('prefix hit rate as rate(hits)/rate(queries) per pool and per worker', () => {
    assert.match(exprsFor(/hit rate per pool/)[0], hitRate('pool'));
    assert.match(exprsFor(/hit rate per worker/)[0], hitRate('pool, instance'));
  });
  test('router predicted vs actual hit rate', () => {
    const [predicted, actual] = exprsFor(/predicted vs actual/);
    assert.match(predicted, /^sum\(rate\(pdserve_router_predicted_hit_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) \/ sum\(rate\(pdserve_router_prompt_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\)$/);
    assert.match(actual, hitRate(''));
  });
  test('TTFT and ITL p50/p90/p99 from histogram buckets', () => {
    const ttft = exprsFor(/^Time to first token \(router\)/);
    quantiles('pdserve_router_time_to_first_token_seconds').forEach((re, i) => assert.match(ttft[i], re));
    const itl = exprsFor(/^Inter-token latency/);
    quantiles('pdserve_inter_token_latency_seconds').forEach((re, i) => assert.match(itl[i], re));
  });
  test('requests running and waiting, KV cache usage', () => {
    const [running, waiting] = exprsFor(/running and waiting/);
    assert.match(running, /^sum by \(pool\) \(pdserve_requests_running\{/);
    assert.match(waiting, /^sum by \(pool\) \(pdserve_requests_waiting\{/);
    assert.match(exprsFor(/^KV cache usage/)[0], /pdserve_kv_cache_usage_ratio\{/);
  });
  test('KV transfer latency, bytes and failures', () => {
    const lat = exprsFor(/^KV transfer latency/);
    quantiles('pdserve_kv_transfer_seconds').forEach((re, i) => assert.match(lat[i], re));
    assert.match(exprsFor(/^KV transfer throughput/)[0], /rate\(pdserve_kv_transfer_bytes_total\{/);
    assert.match(exprsFor(/^KV transfer failures/)[0], /rate\(pdserve_kv_transfer_failures_total\{/);
  });
  test('remote vs local prefill, workers by state, KV event gaps', () => {
    assert.match(exprsFor(/remote vs local/)[0], /^sum by \(kind\) \(rate\(pdserve_router_decisions_total\{/);
    assert.match(exprsFor(/^Workers by state/)[0], /^max by \(role, state\) \(pdserve_router_workers\{/);
    assert.match(exprsFor(/^KV event gaps/)[0], /increase\(pdserve_router_kv_event_gaps_total\{/);
  });
  test('KV tiers: hit rate per tier over the prefix cache queries, predicted vs actual, onload p50/p99 per tier', () => {
    const [tiers, device] = exprsFor(/^KV tier hit rate/);
    assert.match(tiers, /^sum by \(tier\) \(rate\(pdserve_kv_tier_hit_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\) \/ ignoring \(tier\) group_left sum \(rate\(pdserve_prefix_cache_queries_tokens_total\{[^}]*\}\[\$__rate_interval\]\)\)$/);
    assert.match(device, hitRate(''));
    const [predicted, actual] = exprsFor(/^KV tier hits: router prediction/);
    assert.match(predicted, /^sum by \(tier\) \(rate\(pdserve_router_predicted_tier_hit_tokens_total\{/);
    assert.match(actual, /^sum by \(tier\) \(rate\(pdserve_kv_tier_hit_tokens_total\{/);
    const onload = exprsFor(/^KV tier onload latency/);
    assert.equal(onload.length, 2);
    [0.5, 0.99].forEach((q, i) => assert.match(onload[i], new RegExp(
      // Tiers without onloads in the interval are left out, not drawn as NaN.
      `^histogram_quantile\\(${q}, sum by \\(tier, le\\) \\(rate\\(pdserve_kv_tier_onload_seconds_bucket\\{[^}]*\\}\\[\\$__rate_interval\\]\\)\\)\\) ` +
      `and on \\(tier\\) sum by \\(tier\\) \\(rate\\(pdserve_kv_tier_onload_seconds_bucket\\{[^}]*le="\\+Inf"\\}\\[\\$__rate_interval\\]\\)\\) > 0$`)));
  });
  test('KV tiers: blocks held vs capacity, bytes in and out, corrupt blocks', () => {
    const [held, capacity] = exprsFor(/^KV tier blocks held vs capacity/);
    assert.match(held, /^sum by \(pool, tier\) \(pdserve_kv_tier_blocks\{/);
    assert.match(capacity, /^sum by \(pool, tier\) \(pdserve_kv_tier_capacity_blocks\{/);
    const [offload, onload] = exprsFor(/^KV tier offload and onload/);
    assert.match(offload, /rate\(pdserve_kv_tier_offload_bytes_total\{/);
    assert.match(onload, /rate\(pdserve_kv_tier_onload_bytes_total\{/);
    assert.match(exprsFor(/^KV tier corrupt blocks/)[0], /increase\(pdserve_kv_tier_corrupt_blocks_total\{/);
  });
  test('hot-prefix copies: started by outcome, declined by reason, reuse, breaker and budget', () => {
    const [started, declined] = exprsFor(/^Copies started and declined/);
    assert.match(started, /^sum by \(outcome\) \(rate\(pdserve_router_replications_total\{[^}]*\}\[\$__rate_interval\]\)\)$/);
    assert.match(declined, /^sum by \(reason\) \(rate\(pdserve_router_copies_declined_total\{[^}]*\}\[\$__rate_interval\]\)\)$/);
    const [outcomes, ratio] = exprsFor(/^Copied-block reuse/);
    assert.match(outcomes, /^sum by \(outcome\) \(rate\(pdserve_router_copy_outcomes_total\{/);
    assert.match(ratio, /^max\(pdserve_router_copy_reuse_ratio\{/);
    const [breaker, budget, inflight, limit] = exprsFor(/^Copy breaker and budget/);
    assert.match(breaker, /^max by \(instance\) \(pdserve_router_copy_breaker_state\{/);
    assert.match(budget, /^max by \(instance\) \(pdserve_router_copy_budget_scale\{/);
    assert.match(inflight, /^sum\(pdserve_router_copies_in_flight\{/);
    assert.match(limit, /^sum\(pdserve_router_copy_inflight_limit\{/);
  });
  test('KV tiers: disk writes by cause, dropped and failed ones, the write-through queue', () => {
    const [written, dropped, errors] = exprsFor(/^KV tier disk writes$/);
    assert.match(written, /^sum by \(pool, cause\) \(rate\(pdserve_kv_tier_disk_writes_total\{[^}]*\}\[\$__rate_interval\]\)\)$/);
    assert.match(dropped, /^sum by \(pool\) \(rate\(pdserve_kv_tier_disk_writes_dropped_total\{/);
    assert.match(errors, /^sum by \(pool\) \(rate\(pdserve_kv_tier_disk_write_errors_total\{/);
    assert.match(exprsFor(/^KV tier disk write queue/)[0], /^sum by \(pool\) \(max_over_time\(pdserve_kv_tier_disk_write_queue_blocks\{/);
  });
});

test('README describes every dashboard panel and every alert', () => {
  const readme = fs.readFileSync(path.join(root, 'README.md'), 'utf8');
  const section = readme.slice(readme.indexOf('## Deploy on Kubernetes'));
  assert.ok(section.length > 1000, 'README has no "Deploy on Kubernetes" section');
  for (const p of panels) assert.ok(section.includes(`**${p.title}**`), `README lacks panel "${p.title}"`);
  const rules = fs.readFileSync(path.join(root, 'deploy/prometheus/pdserve-alerts.yaml'), 'utf8');
  for (const [, alert] of rules.matchAll(/- alert: (\w+)/g)) assert.ok(section.includes(`\`${alert}\``), `README lacks alert ${alert}`);
});

describe('dashboard-queries.sh', () => {
  const list = (...args) => execFileSync(lister, args, { encoding: 'utf8' }).trim().split('\n').map((l) => JSON.parse(l));
  test('lists every expression with its panel', () => {
    const rows = list();
    assert.deepEqual(rows.map((r) => [r.panel, r.refId, r.expr]), targets.map((t) => [t.panel, t.refId, t.expr]));
  });
  test('--resolve leaves no dashboard variable', () => {
    for (const r of list('--resolve')) {
      assert.doesNotMatch(r.expr, /\$/, r.panel);
      assert.match(r.expr, /\[1m\]|pdserve_(requests|kv_cache_usage|kv_cache_rank_usage|router_workers|kv_tier_blocks|kv_tier_capacity_blocks|router_cop)/, r.panel);
    }
  });
  test('bad arguments: one-line error, exit 2', () => {
    assert.throws(() => execFileSync(lister, ['--bogus'], { stdio: 'pipe' }), (e) => e.status === 2 && /unknown option/.test(e.stderr));
    assert.throws(() => execFileSync(lister, ['/nonexistent.json'], { stdio: 'pipe' }), (e) => e.status === 2 && /cannot read/.test(e.stderr));
  });
});

// A real Prometheus started by deploy/local/prometheus.sh. It scrapes itself
// in place of the router, so a target is up; no pdserve process runs here,
// so queries succeed with empty results (the live test of the whole stack
// checks values).
describe('deploy/local/prometheus.sh with the real Prometheus server', () => {
  let server;
  let base;
  let dir;
  let log = '';

  before(async () => {
    dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-prom-'));
    const port = await freePort();
    const listen = `127.0.0.1:${port}`;
    base = `http://${listen}`;
    server = spawn(path.join(root, 'deploy/local/prometheus.sh'),
      ['--dir', dir, '--listen', listen, '--router', listen, '--prefill', '127.0.0.1:1', '--decode', '127.0.0.1:2,127.0.0.1:3'],
      { stdio: ['ignore', 'pipe', 'pipe'] });
    server.stdout.on('data', (d) => { log += d; });
    server.stderr.on('data', (d) => { log += d; });
    await waitFor(async () => (await fetch(`${base}/-/ready`)).ok, `Prometheus did not become ready:\n${log}`);
  });
  after(() => {
    server?.kill('SIGTERM');
    if (dir) fs.rmSync(dir, { recursive: true, force: true });
  });

  test('loads the pdserve alert rules', async () => {
    const body = await (await fetch(`${base}/api/v1/rules`)).json();
    const rules = body.data.groups.flatMap((g) => g.rules);
    assert.deepEqual(rules.map((r) => r.name).sort(), ['PdserveKvCacheNearlyFull', 'PdserveKvEventGaps',
      'PdserveKvTransferFailures', 'PdserveNoReadyDecodeWorker', 'PdservePrefixCacheHitRateCollapse',
      'PdserveRouterDown', 'PdserveRouterOverloaded', 'PdserveWorkerDown']);
    for (const r of rules) assert.equal(r.health === 'err', false, `${r.name}: ${r.lastError}`);
  });
  test('scrapes the given targets with their pool labels', async () => {
    await waitFor(async () => {
      const body = await (await fetch(`${base}/api/v1/targets`)).json();
      const got = body.data.activeTargets.map((t) => `${t.labels.pool} ${t.labels.instance}`).sort();
      return JSON.stringify(got) === JSON.stringify(['decode 127.0.0.1:2', 'decode 127.0.0.1:3', 'prefill 127.0.0.1:1',
        `router ${base.slice(7)}`]);
    }, 'targets not discovered');
    await waitFor(async () => {
      const body = await (await fetch(`${base}/api/v1/query?query=${encodeURIComponent('up{pool="router"}')}`)).json();
      return body.data.result[0]?.value[1] === '1';
    }, 'the router target is never scraped');
  });
  test('evaluates every dashboard expression without error', async () => {
    const rows = execFileSync(lister, ['--resolve'], { encoding: 'utf8' }).trim().split('\n').map((l) => JSON.parse(l));
    for (const r of rows) {
      const res = await fetch(`${base}/api/v1/query`, { method: 'POST', body: new URLSearchParams({ query: r.expr }) });
      const body = await res.json();
      assert.equal(body.status, 'success', `${r.panel} ${r.refId}: ${body.error}\n${r.expr}`);
    }
  });
  test('check-dashboard.mjs reports every pdserve query empty while no pdserve process runs', () => {
    const r = spawnSync('node', [checker, '--prometheus', base], { encoding: 'utf8' });
    assert.equal(r.status, 1, r.stderr);
    const rows = r.stdout.trim().split('\n').map((l) => JSON.parse(l));
    assert.deepEqual(rows.map((x) => [x.panel, x.refId]), targets.map((t) => [t.panel, t.refId]));
    for (const x of rows) assert.equal(x.status, 'empty', `${x.panel} ${x.refId}: ${x.error}`);
  });
  test('check-dashboard.mjs tells ok, empty, NaN and invalid queries apart', () => {
    const file = path.join(dir, 'probe-dashboard.json');
    const exprs = ['up{pool="router"}', 'up{pool="none"}', 'vector(0) / vector(0)', 'sum(rate(up[$__rate_interval])'];
    fs.writeFileSync(file, JSON.stringify({ panels: [{ title: 'probe', type: 'timeseries',
      targets: exprs.map((expr, i) => ({ refId: String.fromCharCode(65 + i), expr })) }] }));
    const r = spawnSync('node', [checker, '--prometheus', base, '--dashboard', file], { encoding: 'utf8' });
    assert.equal(r.status, 1, r.stderr);
    const rows = r.stdout.trim().split('\n').map((l) => JSON.parse(l));
    assert.deepEqual(rows.map((x) => x.status), ['ok', 'empty', 'nan', 'error']);
    assert.deepEqual(rows[0].values, [1]);
    assert.match(rows[3].error, /parse error/);
    fs.writeFileSync(file, JSON.stringify({ panels: [{ title: 'p', type: 'timeseries', targets: [{ refId: 'A', expr: 'count(up)' }] }] }));
    assert.equal(spawnSync('node', [checker, '--prometheus', base, '--dashboard', file]).status, 0);
  });
  test('check-dashboard.mjs: unreachable Prometheus or bad arguments exit 2', () => {
    const down = spawnSync('node', [checker, '--prometheus', 'http://127.0.0.1:1'], { encoding: 'utf8' });
    assert.equal(down.status, 2);
    assert.match(down.stderr, /cannot query/);
    const bad = spawnSync('node', [checker, '--bogus'], { encoding: 'utf8' });
    assert.equal(bad.status, 2);
    assert.match(bad.stderr, /unknown argument --bogus/);
  });
});

function freePort() {
  return new Promise((resolve, reject) => {
    const s = net.createServer();
    s.listen(0, '127.0.0.1', () => { const { port } = s.address(); s.close(() => resolve(port)); });
    s.on('error', reject);
  });
}

async function waitFor(check, message, timeoutMs = 20000) {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    try { if (await check()) return; } catch { /* not up yet */ }
    if (Date.now() > deadline) throw new Error(message);
    await new Promise((r) => setTimeout(r, 200));
  }
}
