// Tests of the Helm chart helm/pdserve: `helm lint --strict`, then
// `helm template` with the default values, values-cpu.yaml, a full-featured
// values file and targeted overrides, with assertions on the rendered objects
// (parsed with the `yaml` package), bad values rejected by the schema, every
// rendered object validated against the Kubernetes API schemas (k8s_schema.mjs),
// and, given PDSERVE_BIN, every flag the chart passes known to that binary.
//
// Run: node --test tests/helm/chart_test.mjs
//      (HELM=path/to/helm, PDSERVE_BIN=build/pdserve optional)
import assert from 'node:assert/strict';
import { execFile, execFileSync, spawnSync } from 'node:child_process';
import crypto from 'node:crypto';
import fs from 'node:fs';
import http from 'node:http';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import { describe, test } from 'node:test';
import { promisify } from 'node:util';
import { fileURLToPath } from 'node:url';
import { loadValidator, SchemaError } from './k8s_schema.mjs';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const npmDir = process.env.PDSERVE_NPM_DIR || path.join(root, '.deps/npm');
const require = createRequire(path.join(npmDir, 'package.json'));
const YAML = require('yaml');
const validateObject = await loadValidator(npmDir);

const chart = path.join(root, 'helm/pdserve');
const cpuValues = path.join(chart, 'values-cpu.yaml');
const fullValues = path.join(root, 'tests/helm/values-full.yaml');
const helm = process.env.HELM || findHelm();
const release = 'rel';
const namespace = 'serving';

function findHelm() {
  const local = path.join(root, '.deps/bin/helm');
  return fs.existsSync(local) ? local : 'helm';
}

// Runs helm; returns {status, stdout, stderr} without throwing.
function runHelm(args) {
  const r = spawnSync(helm, args, { encoding: 'utf8' });
  if (r.error) throw new Error(`cannot run ${helm}: ${r.error.message} (run deploy/local/install-deps.sh)`);
  return r;
}

// Renders the chart and returns the parsed objects; fails the test on a helm error.
function render({ files = [], set = [] } = {}) {
  const args = ['template', release, chart, '--namespace', namespace];
  for (const f of files) args.push('-f', f);
  for (const s of set) args.push('--set', s);
  const r = runHelm(args);
  assert.equal(r.status, 0, `helm ${args.join(' ')} failed:\n${r.stderr}`);
  const objects = [];
  for (const doc of YAML.parseAllDocuments(r.stdout)) {
    assert.deepEqual(doc.errors, [], `rendered YAML does not parse: ${doc.errors}`);
    const o = doc.toJS();
    if (o) objects.push(o);
  }
  return new Rendered(objects);
}

class Rendered {
  constructor(objects) { this.objects = objects; }
  all(kind) { return this.objects.filter((o) => o.kind === kind); }
  get(kind, name) {
    const o = this.objects.find((x) => x.kind === kind && x.metadata.name === name);
    assert.ok(o, `no ${kind} ${name}; have ${this.objects.map((x) => `${x.kind}/${x.metadata.name}`).join(', ')}`);
    return o;
  }
  has(kind) { return this.all(kind).length > 0; }
  deployment(component) { return this.get('Deployment', `${release}-pdserve-${component}`); }
  service(name) { return this.get('Service', `${release}-pdserve-${name}`); }
}

const podSpec = (d) => d.spec.template.spec;
const mainContainer = (d) => podSpec(d).containers[0];
// "--name=value" args as a map, a bare boolean "--name" as true; the first
// argument is the command.
function flags(container) {
  const m = new Map();
  for (const a of container.args.slice(1)) {
    const match = /^--([a-z-]+)(?:=(.*))?$/.exec(a);
    assert.ok(match, `argument not in --flag=value or --flag form: ${a}`);
    assert.ok(!m.has(match[1]), `--${match[1]} given twice`);
    m.set(match[1], match[2] === undefined ? true : match[2]);
  }
  return m;
}
const portByName = (container, name) => {
  const p = (container.ports || []).find((x) => x.name === name);
  assert.ok(p, `container ${container.name} has no port named ${name}`);
  return p.containerPort;
};
const matches = (selector, labels) => Object.entries(selector).every(([k, v]) => labels[k] === v);
// A Kubernetes label selector (matchLabels and In/NotIn/Exists matchExpressions).
function selects(selector, labels) {
  if (selector.matchLabels && !matches(selector.matchLabels, labels)) return false;
  return (selector.matchExpressions || []).every((e) => {
    switch (e.operator) {
      case 'In': return e.values.includes(labels[e.key]);
      case 'NotIn': return !e.values.includes(labels[e.key]);
      case 'Exists': return e.key in labels;
      default: throw new Error(`operator ${e.operator}`);
    }
  });
}
const podLabels = (d) => d.spec.template.metadata.labels;
const envOf = (container) => Object.fromEntries((container.env || []).map((e) => [e.name, e]));

// The Secret behind a file a Deployment's server reads: the read-only mount
// holding the file, and the Secret volume item projected to it.
function secretFile(d, file) {
  const c = mainContainer(d);
  const mount = (c.volumeMounts || []).find((m) => path.dirname(file) === m.mountPath);
  assert.ok(mount, `${d.metadata.name}: no mount holds ${file}`);
  assert.equal(mount.readOnly, true, `${d.metadata.name}: ${mount.mountPath} is writable`);
  const volume = podSpec(d).volumes.find((v) => v.name === mount.name);
  assert.ok(volume.secret, `${d.metadata.name}: ${mount.name} is not a Secret volume`);
  const item = volume.secret.items.find((i) => i.path === path.basename(file));
  assert.ok(item, `${d.metadata.name}: Secret volume ${mount.name} has no item ${path.basename(file)}`);
  return { secretName: volume.secret.secretName, key: item.key, mode: volume.secret.defaultMode, volume: mount.name };
}
const components = ['router', 'prefill', 'decode'];
const decodeBase64 = (s) => Buffer.from(s, 'base64').toString('utf8');

// Every probe targets a named container port that exists, /health (or /ready
// for router readiness), and ports agree with the container's flags.
function checkProbesAndPorts(r) {
  const router = mainContainer(r.deployment('router'));
  const rf = flags(router);
  // No command: the image's ENTRYPOINT (pdserve) runs the subcommand in args.
  assert.equal(router.command, undefined);
  assert.equal(router.args[0], 'router');
  assert.equal(String(portByName(router, 'http')), rf.get('port'));
  assert.equal(String(portByName(router, 'control')), rf.get('control-port'));
  if (rf.has('metrics-port')) assert.equal(String(portByName(router, 'metrics')), rf.get('metrics-port'));
  assert.deepEqual(router.readinessProbe.httpGet, { path: '/ready', port: 'http' });
  // A preStop wait first (endpoints forget the pod meanwhile), then SIGTERM
  // drains the requests in flight for the rest of the grace period less 5 s.
  const routerGrace = r.deployment('router').spec.template.spec.terminationGracePeriodSeconds;
  const preStop = router.lifecycle?.preStop?.exec?.command;
  if (preStop) assert.equal(preStop[0], 'sleep');
  const wait = preStop ? Number(preStop[1]) : 0;
  assert.equal(rf.get('drain-timeout'), String(Math.max(0, routerGrace - wait - 5)));
  // Liveness reads /live, which only fails when the process itself is broken.
  assert.deepEqual(router.livenessProbe.httpGet, { path: '/live', port: 'http' });
  assert.deepEqual(router.startupProbe.httpGet, { path: '/live', port: 'http' });
  for (const role of ['prefill', 'decode']) {
    const w = mainContainer(r.deployment(role));
    const wf = flags(w);
    assert.equal(w.command, undefined);
    assert.equal(w.args[0], 'worker');
    assert.equal(wf.get('role'), role);
    assert.equal(String(portByName(w, 'metrics')), wf.get('metrics-port'));
    assert.equal(String(portByName(w, 'control')), wf.get('port'));
    // Other pods reach this worker at its pod IP, never at loopback.
    assert.equal(wf.get('advertise-host'), '$(POD_IP)');
    const podIp = w.env.find((e) => e.name === 'POD_IP');
    assert.equal(podIp?.valueFrom?.fieldRef?.fieldPath, 'status.podIP');
    // Readiness follows the router link (/health); liveness and startup do
    // not (/live): a lost router must not restart every worker.
    const paths = { startupProbe: '/live', readinessProbe: '/health', livenessProbe: '/live' };
    for (const [probe, path] of Object.entries(paths)) {
      assert.deepEqual(w[probe].httpGet, { path, port: 'metrics' }, `${role} ${probe}`);
    }
    // SIGTERM drains running requests for the grace period less 10 s of
    // shutdown and less the disk flush that follows the drain.
    const grace = r.deployment(role).spec.template.spec.terminationGracePeriodSeconds;
    const flush = Number(wf.get('kv-disk-flush-timeout') ?? 0);
    assert.equal(wf.get('drain-timeout'), String(Math.max(1, grace - flush - 10)), `${role} drain`);
    // Model loading may take long: liveness only starts after a startup window
    // of at least ten minutes.
    const window = w.startupProbe.periodSeconds * w.startupProbe.failureThreshold;
    assert.ok(window >= 600, `${role} startup window ${window}s is shorter than 10 minutes`);
  }
}

// The router address given to workers is the headless Service of the router
// pods (every replica, ready or not) on the control port the router listens on.
function checkRouterWiring(r) {
  const routerDeployment = r.deployment('router');
  const routerFlags = flags(mainContainer(routerDeployment));
  const headless = r.service('router-headless');
  assert.equal(headless.spec.clusterIP, 'None');
  assert.equal(headless.spec.publishNotReadyAddresses, true);
  assert.ok(matches(headless.spec.selector, routerDeployment.spec.template.metadata.labels));
  assert.equal(headless.spec.ports[0].targetPort, 'control');
  assert.equal(String(headless.spec.ports[0].port), routerFlags.get('control-port'));
  for (const role of ['prefill', 'decode']) {
    const wf = flags(mainContainer(r.deployment(role)));
    assert.equal(wf.get('router'), `${headless.metadata.name}.${namespace}.svc:${routerFlags.get('control-port')}`);
    assert.equal(wf.get('model'), routerFlags.get('model'), 'router and workers must load the same model');
    // The router alone decides remote prefill: workers have no threshold.
    assert.equal(wf.has('max-local-prefill'), false, `${role} worker must not get --max-local-prefill`);
  }
  // Router and workers must agree on the block size (hash spec v1).
  for (const role of ['prefill', 'decode']) {
    assert.equal(flags(mainContainer(r.deployment(role))).get('block-size'), routerFlags.get('block-size'), role);
  }
}

// Each Service selects pods of one Deployment and targets ports those pods name.
function checkServices(r) {
  const deployments = r.all('Deployment');
  for (const svc of r.all('Service')) {
    const targets = deployments.filter((d) => matches(svc.spec.selector, d.spec.template.metadata.labels));
    assert.equal(targets.length, 1, `Service ${svc.metadata.name} selects ${targets.length} Deployments`);
    for (const p of svc.spec.ports) portByName(mainContainer(targets[0]), p.targetPort);
  }
  for (const d of deployments) {
    assert.ok(matches(d.spec.selector.matchLabels, d.spec.template.metadata.labels), d.metadata.name);
  }
}

function checkSecurity(r, { rdma }) {
  for (const d of r.all('Deployment')) {
    const spec = podSpec(d);
    assert.equal(spec.securityContext.runAsNonRoot, true);
    assert.equal(spec.automountServiceAccountToken, false);
    // No PDSERVE_PORT from a Service named pdserve: pdserve reads such variables as flags.
    assert.equal(spec.enableServiceLinks, false, d.metadata.name);
    assert.equal(spec.serviceAccountName, `${release}-pdserve`);
    for (const c of [...spec.containers, ...(spec.initContainers || [])]) {
      const sc = c.securityContext;
      assert.equal(sc.allowPrivilegeEscalation, false, c.name);
      assert.equal(sc.readOnlyRootFilesystem, true, c.name);
      assert.deepEqual(sc.capabilities.drop, ['ALL'], c.name);
      const isWorker = c.name === 'worker';
      assert.deepEqual(sc.capabilities.add, rdma && isWorker ? ['IPC_LOCK'] : undefined, `${d.metadata.name}/${c.name} capabilities`);
      assert.ok(c.resources !== undefined || c.name !== 'router', `${c.name} has resources`);
    }
  }
}

function workerResources(r, role) {
  return mainContainer(r.deployment(role)).resources;
}

// Device and KV transfer flags of a worker pool, and its NCCL_* variables.
function deviceFlags(r, role) {
  const c = mainContainer(r.deployment(role));
  const f = flags(c);
  const pick = (n) => (f.has(n) ? f.get(n) : undefined);
  return {
    device: pick('device'), threads: pick('threads'), transfer: pick('kv-transfer'),
    staging: pick('kv-staging'), stagingBytes: pick('kv-staging-bytes'),
    ncclEnv: Object.fromEntries((c.env || []).filter((e) => e.name.startsWith('NCCL_')).map((e) => [e.name, e.value])),
  };
}

// The lower KV tier flags of a worker pool, and the mount and volume at its
// disk tier's folder.
function kvTiers(r, role) {
  const d = r.deployment(role);
  const f = flags(mainContainer(d));
  const pick = (n) => (f.has(n) ? f.get(n) : undefined);
  const dir = pick('kv-disk-cache-dir');
  const mount = dir === undefined ? undefined : (mainContainer(d).volumeMounts || []).find((m) => m.mountPath === dir);
  const volume = mount && podSpec(d).volumes.find((v) => v.name === mount.name);
  return { host: pick('kv-host-cache-bytes'), dir, bytes: pick('kv-disk-cache-bytes'), mount, volume,
    write: pick('kv-disk-write'), queue: pick('kv-disk-write-queue'), pace: pick('kv-disk-write-bytes-per-second'),
    flush: pick('kv-disk-flush-timeout') };
}
const noKvTiers = { host: undefined, dir: undefined, bytes: undefined, mount: undefined, volume: undefined,
  write: undefined, queue: undefined, pace: undefined, flush: undefined };

describe('helm lint --strict', () => {
  for (const [label, files] of [['default values', []], ['values-cpu.yaml', [cpuValues]], ['values-full.yaml', [fullValues]]]) {
    test(label, () => {
      const args = ['lint', '--strict', chart];
      for (const f of files) args.push('-f', f);
      const r = runHelm(args);
      assert.equal(r.status, 0, r.stdout + r.stderr);
      assert.match(r.stdout, /1 chart\(s\) linted, 0 chart\(s\) failed/);
    });
  }
});

describe('default values', () => {
  const r = render();
  test('router, prefill and decode Deployments with their Services', () => {
    for (const c of ['router', 'prefill', 'decode']) assert.equal(r.deployment(c).spec.replicas, 1);
    for (const s of ['router', 'router-headless', 'prefill', 'decode']) r.service(s);
    r.get('ServiceAccount', `${release}-pdserve`);
  });
  test('probes and ports agree with the container flags', () => checkProbesAndPorts(r));
  test('a router roll waits for endpoints, then drains as long as the decode pool', () => {
    assert.deepEqual(mainContainer(r.deployment('router')).lifecycle.preStop.exec.command, ['sleep', '5']);
    assert.equal(podSpec(r.deployment('router')).terminationGracePeriodSeconds,
      podSpec(r.deployment('decode')).terminationGracePeriodSeconds);
  });
  test('workers reach every router replica through the headless Service', () => checkRouterWiring(r));
  test('Services select their pods and existing ports', () => checkServices(r));
  test('one GPU (nvidia.com/gpu) on every worker, none on the router', () => {
    for (const role of ['prefill', 'decode']) {
      const res = workerResources(r, role);
      assert.equal(res.limits['nvidia.com/gpu'], 1, role);
      assert.equal(res.requests['nvidia.com/gpu'], 1, role);
      assert.ok(res.requests.cpu && res.requests.memory, `${role} requests cpu and memory`);
    }
    const routerRes = mainContainer(r.deployment('router')).resources;
    assert.equal(routerRes.limits['nvidia.com/gpu'], undefined);
    assert.ok(routerRes.requests.cpu && routerRes.requests.memory);
  });
  test('workers get a memory-backed /dev/shm', () => {
    for (const role of ['prefill', 'decode']) {
      const spec = podSpec(r.deployment(role));
      const mount = mainContainer(r.deployment(role)).volumeMounts.find((m) => m.mountPath === '/dev/shm');
      assert.ok(mount, `${role} mounts /dev/shm`);
      const vol = spec.volumes.find((v) => v.name === mount.name);
      assert.equal(vol.emptyDir.medium, 'Memory');
    }
  });
  test('GPU pools: --device cuda, KV over UCX with staging auto, no --threads, no NCCL variables', () => {
    for (const role of ['prefill', 'decode']) {
      assert.deepEqual(deviceFlags(r, role), { device: 'cuda', threads: undefined, transfer: 'ucx',
        staging: 'auto', stagingBytes: undefined, ncclEnv: {} }, role);
    }
  });
  test('kv routing with hot-prefix replication and drain pushes on', () => {
    const rf = flags(mainContainer(r.deployment('router')));
    assert.equal(rf.get('policy'), 'kv');
    assert.equal(rf.get('replication-copy-cost'), '0.084');
    assert.equal(rf.get('replication-min-requests'), '2');
    assert.equal(rf.get('replication-window-s'), '10');
    // The copy budget's defaults: one copy in flight per two decode workers, no rate cap.
    assert.equal(rf.get('replication-max-inflight'), '0');
    assert.equal(rf.get('replication-max-copy-tokens-per-s'), '0');
    assert.equal(rf.get('drain-push-blocks'), '4096');
  });
  test('no lower KV tiers: no tier flags, no disk tier volume', () => {
    for (const role of ['prefill', 'decode']) {
      assert.deepEqual(kvTiers(r, role), noKvTiers, role);
      assert.ok(!podSpec(r.deployment(role)).volumes.some((v) => v.name === 'kv-disk'), role);
    }
  });
  test('/dev/shm is large enough for NCCL (1Gi or more)', () => {
    for (const role of ['prefill', 'decode']) {
      const vol = podSpec(r.deployment(role)).volumes.find((v) => v.name === 'dshm');
      assert.match(vol.emptyDir.sizeLimit, /^([1-9][0-9]*)Gi$/, role);
    }
  });
  test('model from the existing claim, mounted read-only', () => {
    for (const c of ['router', 'prefill', 'decode']) {
      const d = r.deployment(c);
      assert.equal(podSpec(d).volumes.find((v) => v.name === 'models').persistentVolumeClaim.claimName, 'pdserve-model');
      const mount = mainContainer(d).volumeMounts.find((m) => m.name === 'models');
      assert.equal(mount.readOnly, true);
      assert.ok(flags(mainContainer(d)).get('model').startsWith(`${mount.mountPath}/`));
      assert.equal(podSpec(d).initContainers, undefined);
    }
  });
  test('security contexts: non-root, read-only root, no capabilities', () => checkSecurity(r, { rdma: false }));
  test('no RDMA bits', () => {
    for (const role of ['prefill', 'decode']) {
      const c = mainContainer(r.deployment(role));
      assert.deepEqual(Object.keys(envOf(c)).filter((n) => n.startsWith('UCX_')), []);
      assert.ok(!Object.keys(c.resources.limits).some((k) => k.startsWith('rdma/')));
    }
  });
  test('optional objects are off', () => {
    for (const kind of ['ServiceMonitor', 'PodMonitor', 'PrometheusRule', 'ConfigMap', 'Ingress',
      'HorizontalPodAutoscaler', 'PodDisruptionBudget', 'Job', 'PersistentVolumeClaim', 'Certificate', 'Issuer']) {
      assert.ok(!r.has(kind), `${kind} rendered although not enabled`);
    }
    for (const c of components) {
      const f = flags(mainContainer(r.deployment(c)));
      for (const flag of ['insecure-control-plane', 'control-tls-cert', 'metrics-key-file', 'salt-per-api-key']) {
        assert.ok(!f.has(flag), `${c} has --${flag}`);
      }
    }
  });
  test('cluster secret: a generated Secret, mounted read-only in every Deployment as --cluster-secret-file', () => {
    const secrets = r.all('Secret');
    assert.equal(secrets.length, 1);
    const secret = r.get('Secret', `${release}-pdserve-cluster-secret`);
    assert.equal(secret.type, 'Opaque');
    assert.deepEqual(Object.keys(secret.data), ['cluster-secret']);
    assert.match(decodeBase64(secret.data['cluster-secret']), /^[A-Za-z0-9]{64}$/);
    for (const c of components) {
      const d = r.deployment(c);
      const file = flags(mainContainer(d)).get('cluster-secret-file');
      assert.ok(file, `${c} has no --cluster-secret-file`);
      const src = secretFile(d, file);
      assert.deepEqual([src.secretName, src.key], [secret.metadata.name, 'cluster-secret'], c);
      assert.equal(src.mode, 0o440, `${c}: the secret is readable by the pod's group (fsGroup) only`);
      // The pods roll exactly when the secret's value changes.
      assert.equal(d.spec.template.metadata.annotations['checksum/cluster-secret'],
        crypto.createHash('sha256').update(secret.data['cluster-secret']).digest('hex'), c);
    }
  });
  test('NetworkPolicy on: control ports only from this release\'s workers, HTTP and metrics open', () => {
    const routerPolicy = r.get('NetworkPolicy', `${release}-pdserve-router`);
    const router = r.deployment('router');
    assert.ok(matches(routerPolicy.spec.podSelector.matchLabels, podLabels(router)));
    assert.deepEqual(routerPolicy.spec.policyTypes, ['Ingress']);
    const rule = (policy, port) => policy.spec.ingress.find((i) => i.ports?.some((p) => p.port === port));
    // Clients (and the Ingress controller) reach the HTTP port from anywhere;
    // with router.metricsPort 0 Prometheus scrapes the router there too.
    assert.equal(rule(routerPolicy, 'http').from, undefined);
    const control = rule(routerPolicy, 'control');
    for (const c of ['prefill', 'decode']) {
      assert.ok(control.from.some((f) => selects(f.podSelector, podLabels(r.deployment(c)))), `${c} reaches the control port`);
    }
    const others = [podLabels(router), { ...podLabels(r.deployment('decode')), 'app.kubernetes.io/instance': 'other' },
      { ...podLabels(r.deployment('decode')), 'app.kubernetes.io/component': 'model-download' }];
    for (const labels of others) {
      assert.ok(!control.from.some((f) => selects(f.podSelector, labels)), `${JSON.stringify(labels)} reaches the control port`);
      assert.ok(!control.from.some((f) => f.namespaceSelector || f.ipBlock));
    }
    for (const i of routerPolicy.spec.ingress) for (const p of i.ports) portByName(mainContainer(router), p.port);

    const workerPolicy = r.get('NetworkPolicy', `${release}-pdserve-workers`);
    for (const c of components) {
      assert.equal(selects(workerPolicy.spec.podSelector, podLabels(r.deployment(c))), c !== 'router', c);
    }
    // KV transfer: UCX picks its ports at run time, so workers accept each
    // other on every port, and nobody else.
    const anyPort = workerPolicy.spec.ingress.filter((i) => !i.ports);
    assert.equal(anyPort.length, 1);
    for (const c of components) {
      assert.equal(anyPort[0].from.some((f) => selects(f.podSelector, podLabels(r.deployment(c)))), c !== 'router', c);
    }
    assert.equal(rule(workerPolicy, 'metrics').from, undefined, 'Prometheus scrapes the workers from anywhere');
    for (const c of ['prefill', 'decode']) portByName(mainContainer(r.deployment(c)), 'metrics');
  });
});

describe('cluster secret', () => {
  test('two renders without a cluster draw different random secrets of 64 characters', () => {
    const values = [render(), render()].map((x) => decodeBase64(x.get('Secret', `${release}-pdserve-cluster-secret`).data['cluster-secret']));
    for (const v of values) assert.match(v, /^[A-Za-z0-9]{64}$/);
    assert.notEqual(values[0], values[1]);
  });
  test('an upgrade keeps the value already in the cluster (lookup), and so the checksum', async () => {
    const name = `${release}-pdserve-cluster-secret`;
    const value = Buffer.from('k'.repeat(48)).toString('base64');
    const api = await fakeApiServer({ [`/api/v1/namespaces/${namespace}/secrets/${name}`]: {
      apiVersion: 'v1', kind: 'Secret', type: 'Opaque', data: { 'cluster-secret': value },
      metadata: { name, namespace, labels: { 'app.kubernetes.io/managed-by': 'Helm' },
        annotations: { 'meta.helm.sh/release-name': release, 'meta.helm.sh/release-namespace': namespace } } } });
    try {
      // The server must answer while helm runs: spawn asynchronously.
      const { stdout } = await promisify(execFile)(helm, ['template', release, chart, '--namespace', namespace,
        '--dry-run=server', '--disable-openapi-validation', '--kubeconfig', api.kubeconfig]);
      const r = new Rendered(YAML.parseAllDocuments(stdout).map((d) => d.toJS()).filter(Boolean));
      assert.equal(r.get('Secret', name).data['cluster-secret'], value);
      const checksum = crypto.createHash('sha256').update(value).digest('hex');
      for (const c of components) assert.equal(r.deployment(c).spec.template.metadata.annotations['checksum/cluster-secret'], checksum, c);
    } finally {
      api.close();
    }
  });
  test('existingSecret: mounted with its key, no Secret created, no checksum', () => {
    const r = render({ set: ['controlPlane.clusterSecret.existingSecret=my-secret', 'controlPlane.clusterSecret.key=token'] });
    assert.ok(!r.has('Secret'));
    for (const c of components) {
      const d = r.deployment(c);
      const src = secretFile(d, flags(mainContainer(d)).get('cluster-secret-file'));
      assert.deepEqual([src.secretName, src.key], ['my-secret', 'token'], c);
      assert.equal(d.spec.template.metadata.annotations, undefined, c);
    }
  });
  test('insecure: --insecure-control-plane everywhere, no Secret, no mount', () => {
    const r = render({ set: ['controlPlane.insecure=true'] });
    assert.ok(!r.has('Secret'));
    for (const c of components) {
      const d = r.deployment(c);
      const f = flags(mainContainer(d));
      assert.equal(f.get('insecure-control-plane'), true, c);
      assert.ok(!f.has('cluster-secret-file'), c);
      assert.ok(!podSpec(d).volumes.some((v) => v.secret), c);
      assert.equal(d.spec.template.metadata.annotations, undefined, c);
    }
    const res = runHelm(['install', release, chart, '--dry-run=client', '--set', 'controlPlane.insecure=true']);
    assert.match(res.stdout.slice(res.stdout.indexOf('NOTES:')), /WARNING: controlPlane.insecure is set/);
  });
  test('pod annotations keep the user\'s next to the checksum', () => {
    const r = render({ set: ['decode.podAnnotations.team=llm'] });
    const a = r.deployment('decode').spec.template.metadata.annotations;
    assert.equal(a.team, 'llm');
    assert.match(a['checksum/cluster-secret'], /^[0-9a-f]{64}$/);
  });
  test('without an fsGroup the secret files are world-readable, or the server could not read them', () => {
    const r = render({ set: ['podSecurityContext.fsGroup=null'] });
    assert.equal(podSpec(r.deployment('router')).securityContext.fsGroup, undefined);
    const d = r.deployment('router');
    assert.equal(secretFile(d, flags(mainContainer(d)).get('cluster-secret-file')).mode, 0o444);
  });
});

// Just enough of a Kubernetes API server for `helm template --dry-run=server`
// to run the chart's lookups: discovery of the kinds the chart renders, the
// given objects by path, 404 for everything else. Returns a kubeconfig path
// and a close function.
async function fakeApiServer(objects) {
  const resources = {
    '/api/v1': ['v1', [['secrets', 'Secret'], ['services', 'Service'], ['serviceaccounts', 'ServiceAccount']]],
    '/apis/apps/v1': ['apps/v1', [['deployments', 'Deployment']]],
    '/apis/networking.k8s.io/v1': ['networking.k8s.io/v1', [['networkpolicies', 'NetworkPolicy']]],
  };
  const server = http.createServer((req, res) => {
    const reply = (code, body) => { res.writeHead(code, { 'Content-Type': 'application/json' }); res.end(JSON.stringify(body)); };
    const url = req.url.split('?')[0];
    if (url === '/version') return reply(200, { major: '1', minor: '30', gitVersion: 'v1.30.0' });
    if (url === '/api') return reply(200, { kind: 'APIVersions', versions: ['v1'] });
    if (url === '/apis') {
      return reply(200, { kind: 'APIGroupList', apiVersion: 'v1', groups: ['apps', 'networking.k8s.io'].map((name) => {
        const v = { groupVersion: `${name}/v1`, version: 'v1' };
        return { name, versions: [v], preferredVersion: v };
      }) });
    }
    if (resources[url]) {
      const [groupVersion, list] = resources[url];
      return reply(200, { kind: 'APIResourceList', groupVersion, resources: list.map(([name, kind]) => ({
        name, singularName: kind.toLowerCase(), namespaced: true, kind, verbs: ['get', 'list', 'create'] })) });
    }
    if (objects[url]) return reply(200, objects[url]);
    return reply(404, { kind: 'Status', apiVersion: 'v1', status: 'Failure', reason: 'NotFound', code: 404 });
  });
  await new Promise((resolve) => server.listen(0, '127.0.0.1', resolve));
  const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-helm-'));
  const kubeconfig = path.join(dir, 'kubeconfig');
  fs.writeFileSync(kubeconfig, YAML.stringify({
    apiVersion: 'v1', kind: 'Config', 'current-context': 'fake',
    clusters: [{ name: 'fake', cluster: { server: `http://127.0.0.1:${server.address().port}` } }],
    users: [{ name: 'fake', user: { token: 'fake' } }],
    contexts: [{ name: 'fake', context: { cluster: 'fake', user: 'fake', namespace } }],
  }));
  return { kubeconfig, close: () => { server.close(); fs.rmSync(dir, { recursive: true }); } };
}

// The three TLS flags name files of one read-only Secret volume; returns its Secret.
function tlsSecretOf(d) {
  const f = flags(mainContainer(d));
  const files = ['control-tls-cert', 'control-tls-key', 'control-tls-ca'].map((n) => f.get(n));
  const src = files.map((file) => secretFile(d, file));
  assert.deepEqual(src.map((x) => x.key), ['tls.crt', 'tls.key', 'ca.crt'], d.metadata.name);
  assert.equal(new Set(src.map((x) => x.secretName)).size, 1);
  return src[0].secretName;
}

describe('control-plane TLS', () => {
  test('from an existing kubernetes.io/tls Secret, in every Deployment, next to the cluster secret', () => {
    const r = render({ set: ['controlPlane.tls.enabled=true', 'controlPlane.tls.existingSecret=control-tls'] });
    for (const c of components) {
      assert.equal(tlsSecretOf(r.deployment(c)), 'control-tls', c);
      assert.ok(flags(mainContainer(r.deployment(c))).has('cluster-secret-file'), c);
    }
    assert.ok(!r.has('Certificate') && !r.has('Issuer'));
  });
  test('from cert-manager with a CA of the release\'s own', () => {
    const r = render({ set: ['controlPlane.tls.enabled=true', 'controlPlane.tls.certManager.enabled=true'] });
    const issuers = Object.fromEntries(r.all('Issuer').map((i) => [i.metadata.name, i.spec]));
    const ca = r.get('Certificate', `${release}-pdserve-control-ca`);
    assert.equal(ca.spec.isCA, true);
    assert.deepEqual(issuers[ca.spec.issuerRef.name], { selfSigned: {} });
    const caIssuer = Object.entries(issuers).find(([, spec]) => spec.ca)[0];
    assert.equal(issuers[caIssuer].ca.secretName, ca.spec.secretName);
    for (const c of components) {
      const cert = r.get('Certificate', `${release}-pdserve-${c}-control-tls`);
      assert.equal(cert.spec.issuerRef.name, caIssuer, c);
      assert.equal(tlsSecretOf(r.deployment(c)), cert.spec.secretName, c);
    }
  });
  test('issuerRef names the issuer of every certificate; workers dial the router at a name its certificate holds', () => {
    const r = render({ set: ['controlPlane.tls.enabled=true', 'controlPlane.tls.certManager.enabled=true',
      'controlPlane.tls.certManager.issuerRef.name=corp-ca', 'controlPlane.tls.certManager.issuerRef.kind=ClusterIssuer'] });
    assert.ok(!r.has('Issuer'));
    const certs = r.all('Certificate');
    assert.deepEqual(certs.map((x) => x.metadata.name).sort(), components.map((c) => `${release}-pdserve-${c}-control-tls`).sort());
    for (const c of components) {
      const cert = r.get('Certificate', `${release}-pdserve-${c}-control-tls`);
      assert.deepEqual(cert.spec.issuerRef, { name: 'corp-ca', kind: 'ClusterIssuer', group: 'cert-manager.io' });
      // Every process both accepts and opens control connections.
      assert.ok(cert.spec.usages.includes('server auth') && cert.spec.usages.includes('client auth'), c);
      assert.equal(tlsSecretOf(r.deployment(c)), cert.spec.secretName, c);
      assert.equal(cert.spec.duration, '2160h');
    }
    const routerHost = flags(mainContainer(r.deployment('decode'))).get('router').replace(/:\d+$/, '');
    assert.ok(r.get('Certificate', `${release}-pdserve-router-control-tls`).spec.dnsNames.includes(routerHost));
  });
});

// Control-plane TLS does not encrypt KV blocks (UCX and NCCL carry them in
// clear): the workers' NetworkPolicy is what keeps the KV transfer ports to
// this release's workers, with TLS or without, and the install notes say so.
describe('KV transfer stays among this release\'s workers', () => {
  const notes = (set) => {
    const args = ['install', release, chart, '--dry-run=client', '--namespace', namespace];
    for (const v of set) args.push('--set', v);
    const res = runHelm(args);
    assert.equal(res.status, 0, res.stderr);
    return res.stdout.slice(res.stdout.indexOf('NOTES:'));
  };
  for (const transfer of ['ucx', 'nccl']) {
    test(`${transfer} with control-plane TLS: every worker port admits only this release's workers`, () => {
      const set = ['controlPlane.tls.enabled=true', 'controlPlane.tls.existingSecret=control-tls',
        `kvTransfer=${transfer}`];
      const r = render({ set });
      const policy = r.get('NetworkPolicy', `${release}-pdserve-workers`);
      assert.deepEqual(policy.spec.policyTypes, ['Ingress']);
      for (const c of ['prefill', 'decode']) {
        assert.ok(selects(policy.spec.podSelector, podLabels(r.deployment(c))), `${c} is not covered`);
      }
      // The rule without ports (the ports UCX or NCCL pick at run time) lets
      // in this release's workers and nobody else; every other rule names
      // a port that is not a transfer port.
      const anyPort = policy.spec.ingress.filter((i) => !i.ports);
      assert.equal(anyPort.length, 1);
      assert.ok(anyPort[0].from.length > 0 && anyPort[0].from.every((f) => f.podSelector && !f.namespaceSelector && !f.ipBlock));
      const decode = podLabels(r.deployment('decode'));
      const outsiders = {
        router: podLabels(r.deployment('router')),
        'another release': { ...decode, 'app.kubernetes.io/instance': 'other' },
        'the model download': { ...decode, 'app.kubernetes.io/component': 'model-download' },
        'an unlabelled pod': {},
      };
      for (const c of ['prefill', 'decode']) {
        assert.ok(anyPort[0].from.some((f) => selects(f.podSelector, podLabels(r.deployment(c)))), c);
      }
      for (const [who, labels] of Object.entries(outsiders)) {
        assert.ok(!anyPort[0].from.some((f) => selects(f.podSelector, labels)), `${who} reaches the KV transfer ports`);
      }
      for (const rule of policy.spec.ingress.filter((i) => i.ports)) {
        assert.deepEqual(rule.ports.map((p) => p.port), ['metrics']);
      }
      assert.match(notes(set), /KV blocks cross between workers unencrypted \(control-plane TLS does not cover them\)/);
    });
  }
  test('without the NetworkPolicy the install notes warn that KV transfer is open to every pod', () => {
    assert.ok(!render({ set: ['networkPolicy.enabled=false'] }).has('NetworkPolicy'));
    assert.match(notes(['networkPolicy.enabled=false']),
      /WARNING: networkPolicy.enabled is false: the workers' KV transfer ports/);
    assert.doesNotMatch(notes([]), /WARNING: networkPolicy/);
  });
});

describe('metrics key and per-key cache salt', () => {
  test('/metrics key for every process; the monitor sends it', () => {
    for (const monitor of ['serviceMonitor', 'podMonitor']) {
      const r = render({ set: ['metrics.auth.existingSecret=scrape', `metrics.${monitor}.enabled=true`] });
      for (const c of components) {
        const d = r.deployment(c);
        const src = secretFile(d, flags(mainContainer(d)).get('metrics-key-file'));
        assert.deepEqual([src.secretName, src.key], ['scrape', 'metrics-keys'], c);
      }
      const m = r.all(monitor === 'serviceMonitor' ? 'ServiceMonitor' : 'PodMonitor')[0];
      const endpoints = m.spec.endpoints || m.spec.podMetricsEndpoints;
      assert.equal(endpoints.length, 2);
      for (const e of endpoints) {
        assert.deepEqual(e.authorization, { type: 'Bearer', credentials: { name: 'scrape', key: 'metrics-keys' } }, `${monitor} ${e.port}`);
      }
    }
    const open = render({ set: ['metrics.serviceMonitor.enabled=true'] });
    for (const e of open.all('ServiceMonitor')[0].spec.endpoints) assert.equal(e.authorization, undefined);
  });
  test('saltPerApiKey passes --salt-per-api-key to the router only', () => {
    const r = render({ set: ['router.apiKeys.existingSecret=keys', 'router.saltPerApiKey=true'] });
    assert.equal(flags(mainContainer(r.deployment('router'))).get('salt-per-api-key'), true);
    for (const c of ['prefill', 'decode']) assert.ok(!flags(mainContainer(r.deployment(c))).has('salt-per-api-key'));
  });
  test('allowedOrigins passes --allowed-origins to the router only', () => {
    const r = render({ set: ['router.allowedOrigins={https://app.example.com,http://localhost:3000}'] });
    assert.equal(flags(mainContainer(r.deployment('router'))).get('allowed-origins'),
      'https://app.example.com,http://localhost:3000');
    for (const c of ['prefill', 'decode']) assert.ok(!flags(mainContainer(r.deployment(c))).has('allowed-origins'));
    assert.ok(!flags(mainContainer(render({}).deployment('router'))).has('allowed-origins'));
  });
  test('chatTemplate: a ConfigMap mounted read-only in the router, passed as --chat-template, its checksum rolling the pods', () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-chart-'));
    const values = (t) => {
      const f = path.join(dir, `${crypto.randomUUID()}.yaml`);
      fs.writeFileSync(f, YAML.stringify({ router: { chatTemplate: t } }));
      return f;
    };
    const text = '{% for m in messages %}{{ m.content }}, {{ m.role }}{% endfor %}\n';
    const r = render({ files: [values(text)] });
    const map = r.get('ConfigMap', `${release}-pdserve-chat-template`);
    assert.equal(map.data['template.jinja'], text);
    const d = r.deployment('router');
    const flag = flags(mainContainer(d)).get('chat-template');
    const mount = mainContainer(d).volumeMounts.find((m) => m.name === 'chat-template');
    assert.equal(flag, `${mount.mountPath}/template.jinja`);
    assert.equal(mount.readOnly, true);
    assert.equal(podSpec(d).volumes.find((v) => v.name === 'chat-template').configMap.name, map.metadata.name);
    const sum = d.spec.template.metadata.annotations['checksum/chat-template'];
    assert.match(sum, /^[0-9a-f]{64}$/);
    const other = render({ files: [values(`${text} `)] }).deployment('router');
    assert.notEqual(other.spec.template.metadata.annotations['checksum/chat-template'], sum);
    for (const c of ['prefill', 'decode']) assert.ok(!flags(mainContainer(r.deployment(c))).has('chat-template'));
    assert.ok(!render({}).has('ConfigMap'));
    fs.rmSync(dir, { recursive: true });
  });
  test('networkPolicy.enabled=false removes the policies', () => {
    assert.ok(!render({ set: ['networkPolicy.enabled=false'] }).has('NetworkPolicy'));
  });
});

describe('values-cpu.yaml', () => {
  const r = render({ files: [cpuValues] });
  test('no GPU requested anywhere', () => {
    for (const d of r.all('Deployment')) {
      for (const c of podSpec(d).containers) {
        const keys = [...Object.keys(c.resources.limits || {}), ...Object.keys(c.resources.requests || {})];
        assert.ok(!keys.some((k) => k.includes('gpu')), `${d.metadata.name}: ${keys}`);
      }
    }
  });
  test('every pod creates the tiny model where --model points', () => {
    for (const c of ['router', 'prefill', 'decode']) {
      const d = r.deployment(c);
      const init = podSpec(d).initContainers;
      assert.equal(init.length, 1);
      assert.equal(init[0].name, 'make-model');
      assert.match(init[0].command.join(' '), /pdserve make-model --preset tiny --out "\$MODEL_DIR"/);
      assert.equal(envOf(init[0]).MODEL_DIR.value, flags(mainContainer(d)).get('model'));
      assert.equal(init[0].image, mainContainer(d).image);
      assert.ok(podSpec(d).volumes.find((v) => v.name === 'models').emptyDir);
    }
  });
  test('CPU image and small KV caches', () => {
    for (const d of r.all('Deployment')) assert.match(mainContainer(d).image, /^pdserve:[^:]+-cpu$/);
    for (const role of ['prefill', 'decode']) assert.equal(flags(mainContainer(r.deployment(role))).get('kv-cache-bytes'), '64MiB');
  });
  test('--device cpu with --threads, KV over UCX, no GPU staging flags', () => {
    for (const role of ['prefill', 'decode']) {
      assert.deepEqual(deviceFlags(r, role), { device: 'cpu', threads: '1', transfer: 'ucx',
        staging: undefined, stagingBytes: undefined, ncclEnv: {} }, role);
    }
  });
  test('probes, ports and wiring as with the defaults', () => {
    checkProbesAndPorts(r);
    checkRouterWiring(r);
    checkServices(r);
    checkSecurity(r, { rdma: false });
  });
});

describe('values-full.yaml', () => {
  const r = render({ files: [fullValues] });
  const full = YAML.parse(fs.readFileSync(fullValues, 'utf8'));
  test('probes, ports and wiring with non-default ports', () => {
    checkProbesAndPorts(r);
    checkRouterWiring(r);
    checkServices(r);
    assert.equal(flags(mainContainer(r.deployment('router'))).get('port'), '8080');
    assert.equal(flags(mainContainer(r.deployment('decode'))).get('router'), `${release}-pdserve-router-headless.${namespace}.svc:9500`);
  });
  test('one served model id, given to the router and every worker alike', () => {
    for (const d of components) {
      assert.equal(flags(mainContainer(r.deployment(d))).get('model-id'), 'meta-llama/Llama-3.1-8B-Instruct', d);
    }
  });
  test('GPU resource name and count per pool', () => {
    assert.equal(workerResources(r, 'prefill').limits['amd.com/gpu'], 2);
    assert.equal(workerResources(r, 'decode').limits['amd.com/gpu'], 1);
    assert.equal(workerResources(r, 'decode').limits['nvidia.com/gpu'], undefined);
  });
  test('KV over NCCL in both pools: device per pool, staging flags, the NCCL variables that are set', () => {
    const common = { threads: undefined, transfer: 'nccl', staging: 'always', stagingBytes: '512MiB',
      ncclEnv: { NCCL_SOCKET_IFNAME: 'eth0', NCCL_IB_HCA: 'mlx5_0' } };
    assert.deepEqual(deviceFlags(r, 'prefill'), { device: 'cuda:1', ...common });
    assert.deepEqual(deviceFlags(r, 'decode'), { device: 'cuda', ...common });
    assert.ok(!('kv-transfer' in Object.fromEntries(flags(mainContainer(r.deployment('router'))))), 'router gets no KV flags');
  });
  test('replication and drain pushes turned off', () => {
    const rf = flags(mainContainer(r.deployment('router')));
    assert.equal(rf.get('replication-copy-cost'), '0');
    assert.equal(rf.get('replication-min-requests'), '3');
    assert.equal(rf.get('replication-window-s'), '2.5');
    assert.equal(rf.get('replication-max-inflight'), '4');
    assert.equal(rf.get('replication-max-copy-tokens-per-s'), '250000');
    assert.equal(rf.get('drain-push-blocks'), '0');
  });
  test('KV tiers: prefill\'s disk tier on a node directory, decode\'s on an emptyDir sized from it', () => {
    const prefill = kvTiers(r, 'prefill');
    assert.deepEqual([prefill.host, prefill.dir, prefill.bytes], ['32GiB', '/var/cache/pdserve-kv', '2TiB']);
    assert.ok(!prefill.mount.readOnly, 'the worker writes its disk tier');
    // A replaced pod on the node finds its blocks again.
    assert.deepEqual(prefill.volume.hostPath, { path: '/mnt/nvme0/pdserve-kv-prefill', type: 'DirectoryOrCreate' });
    assert.equal(prefill.volume.emptyDir, undefined);
    // Write-through by default, unpaced, flushed for 30 s on SIGTERM.
    assert.deepEqual([prefill.write, prefill.queue, prefill.pace, prefill.flush], ['through', '1024', undefined, '30']);
    const decode = kvTiers(r, 'decode');
    assert.deepEqual([decode.host, decode.dir, decode.bytes], ['16GiB', '/kv-disk', '200GiB']);
    assert.deepEqual([decode.write, decode.queue, decode.pace, decode.flush], ['back', '256', '500MiB', '90']);
    assert.ok(!decode.mount.readOnly, 'the worker writes its disk tier');
    // 200GiB plus 5%.
    assert.deepEqual(decode.volume.emptyDir, { sizeLimit: '215040Mi' });
    assert.equal(decode.volume.hostPath, undefined);
  });
  test('RDMA: device resource, UCX environment and IPC_LOCK on workers only', () => {
    checkSecurity(r, { rdma: true });
    for (const role of ['prefill', 'decode']) {
      const c = mainContainer(r.deployment(role));
      assert.equal(c.resources.limits['rdma/hca_shared_devices_a'], 1);
      const env = envOf(c);
      assert.equal(env.UCX_NET_DEVICES.value, 'mlx5_0:1');
      assert.match(env.UCX_TLS.value, /rc/);
    }
  });
  test('scheduling constraints reach the pods', () => {
    assert.deepEqual(podSpec(r.deployment('prefill')).nodeSelector, full.prefill.nodeSelector);
    assert.deepEqual(podSpec(r.deployment('prefill')).tolerations, full.prefill.tolerations);
    // The pool's own affinity, and (its disk tier is a node directory) one
    // pod per node: a second would find the slab locked.
    const affinity = podSpec(r.deployment('prefill')).affinity;
    assert.deepEqual(affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution,
      full.prefill.affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution);
    assert.deepEqual(affinity.podAntiAffinity.requiredDuringSchedulingIgnoredDuringExecution, [{
      topologyKey: 'kubernetes.io/hostname',
      labelSelector: { matchLabels: { 'app.kubernetes.io/component': 'prefill',
        'app.kubernetes.io/instance': release, 'app.kubernetes.io/name': 'pdserve' } } }]);
    // decode's disk tier is an emptyDir: no such rule.
    assert.equal(podSpec(r.deployment('decode')).affinity?.podAntiAffinity?.requiredDuringSchedulingIgnoredDuringExecution, undefined);
    assert.deepEqual(podSpec(r.deployment('router')).nodeSelector, full.router.nodeSelector);
    assert.equal(flags(mainContainer(r.deployment('prefill'))).get('kv-cache-bytes'), '40GiB');
    assert.deepEqual(r.deployment('decode').spec.strategy, full.decode.strategy);
    // The default: no surge pod, which would wait for a free GPU.
    assert.deepEqual(r.deployment('prefill').spec.strategy,
      { type: 'RollingUpdate', rollingUpdate: { maxSurge: 0, maxUnavailable: 1 } });
  });
  test('HPA owns the router replica count; PDB and Ingress point at the router', () => {
    const hpa = r.get('HorizontalPodAutoscaler', `${release}-pdserve-router`);
    assert.equal(hpa.spec.scaleTargetRef.name, r.deployment('router').metadata.name);
    assert.equal(hpa.spec.metrics[0].resource.name, 'cpu');
    assert.equal(r.deployment('router').spec.replicas, undefined);
    const pdb = r.get('PodDisruptionBudget', `${release}-pdserve-router`);
    assert.ok(matches(pdb.spec.selector.matchLabels, r.deployment('router').spec.template.metadata.labels));
    const ing = r.get('Ingress', `${release}-pdserve-router`);
    const backend = ing.spec.rules[0].http.paths[0].backend.service;
    assert.equal(backend.name, r.service('router').metadata.name);
    assert.ok(r.service('router').spec.ports.some((p) => p.name === backend.port.name));
    assert.equal(ing.spec.tls[0].secretName, 'llm-tls');
  });
  test('a worker pool\'s PDB bounds how many of its pods a drain evicts', () => {
    const pdb = r.get('PodDisruptionBudget', `${release}-pdserve-decode`);
    assert.equal(pdb.spec.maxUnavailable, '25%');
    assert.ok(matches(pdb.spec.selector.matchLabels, r.deployment('decode').spec.template.metadata.labels));
    assert.ok(!matches(pdb.spec.selector.matchLabels, r.deployment('prefill').spec.template.metadata.labels));
    assert.equal(r.all('PodDisruptionBudget').some((p) => p.metadata.name.endsWith('-prefill')), false);
  });
  test('API keys mounted from the Secret the router reads', () => {
    const d = r.deployment('router');
    const file = flags(mainContainer(d)).get('api-key-file');
    const mount = mainContainer(d).volumeMounts.find((m) => file.startsWith(`${m.mountPath}/`));
    assert.ok(mount, `no mount holds ${file}`);
    assert.equal(podSpec(d).volumes.find((v) => v.name === mount.name).secret.secretName, 'pdserve-api-keys');
  });
  test('new claim filled by a download Job with the Hugging Face token', () => {
    const pvc = r.get('PersistentVolumeClaim', `${release}-pdserve-model`);
    assert.equal(pvc.spec.resources.requests.storage, '50Gi');
    assert.equal(pvc.spec.storageClassName, 'fast-rwx');
    const job = r.all('Job')[0];
    assert.ok(job, 'download Job rendered');
    const c = job.spec.template.spec.containers[0];
    const env = envOf(c);
    assert.deepEqual(env.HF_TOKEN.valueFrom.secretKeyRef, { name: 'hf-token', key: 'HF_TOKEN' });
    assert.equal(env.HF_REPO.value, 'meta-llama/Llama-3.1-8B-Instruct');
    assert.equal(env.MODEL_DIR.value, flags(mainContainer(r.deployment('decode'))).get('model'));
    assert.equal(job.spec.template.spec.volumes.find((v) => v.name === 'models').persistentVolumeClaim.claimName, pvc.metadata.name);
    for (const comp of ['router', 'prefill', 'decode']) {
      const init = podSpec(r.deployment(comp)).initContainers[0];
      assert.equal(init.name, 'wait-for-model');
      assert.match(init.command.join(' '), new RegExp(job.metadata.name));
    }
  });
  test('ServiceMonitor scrapes router and workers and labels the pool', () => {
    const sm = r.get('ServiceMonitor', `${release}-pdserve`);
    assert.equal(sm.metadata.labels.release, 'kube-prometheus-stack');
    assert.ok(!r.has('PodMonitor'));
    const scraped = r.all('Service').filter((s) => matches(sm.spec.selector.matchLabels, s.metadata.labels));
    const names = scraped.map((s) => s.metadata.name).sort();
    assert.deepEqual(names, ['router', 'prefill', 'decode'].map((n) => `${release}-pdserve-${n}`).sort());
    for (const s of scraped) {
      const ep = sm.spec.endpoints.filter((e) => s.spec.ports.some((p) => p.name === e.port));
      assert.equal(ep.length, 1, `${s.metadata.name} is scraped by exactly one endpoint`);
      assert.equal(ep[0].path, '/metrics');
      assert.deepEqual(ep[0].relabelings[0], {
        sourceLabels: ['__meta_kubernetes_pod_label_app_kubernetes_io_component'], targetLabel: 'pool' });
    }
  });
  test('PrometheusRule carries the rule groups of the promtool-tested file', () => {
    const rule = r.get('PrometheusRule', `${release}-pdserve`);
    const file = YAML.parse(fs.readFileSync(path.join(chart, 'files/prometheus/pdserve-alerts.yaml'), 'utf8'));
    assert.deepEqual(rule.spec.groups, file.groups);
    const alerts = rule.spec.groups.flatMap((g) => g.rules.map((x) => x.alert));
    assert.deepEqual(alerts.sort(), ['PdserveKvCacheNearlyFull', 'PdserveKvEventGaps', 'PdserveKvTransferFailures',
      'PdserveNoReadyDecodeWorker', 'PdservePrefixCacheHitRateCollapse', 'PdserveRouterDown',
      'PdserveRouterOverloaded', 'PdserveWorkerDown']);
  });
  test('dashboard ConfigMap for the Grafana sidecar carries the dashboard JSON', () => {
    const cm = r.get('ConfigMap', `${release}-pdserve-dashboard`);
    assert.equal(cm.metadata.labels.grafana_dashboard, '1');
    assert.equal(cm.metadata.namespace, 'monitoring');
    assert.equal(cm.metadata.annotations.grafana_folder, 'LLM serving');
    const json = fs.readFileSync(path.join(root, 'deploy/grafana/pdserve-dashboard.json'), 'utf8');
    assert.deepEqual(JSON.parse(cm.data['pdserve-dashboard.json']), JSON.parse(json));
  });
  test('NetworkPolicy: control port only from this release, metrics from monitoring', () => {
    const routerPolicy = r.get('NetworkPolicy', `${release}-pdserve-router`);
    const routerPod = r.deployment('router').spec.template.metadata.labels;
    assert.ok(matches(routerPolicy.spec.podSelector.matchLabels, routerPod));
    const control = routerPolicy.spec.ingress.find((i) => i.ports?.[0].port === 'control');
    const workerPod = r.deployment('decode').spec.template.metadata.labels;
    assert.ok(selects(control.from[0].podSelector, workerPod), 'workers may reach the control port');
    const metrics = routerPolicy.spec.ingress.find((i) => i.ports?.[0].port === 'metrics');
    assert.deepEqual(metrics.from, full.networkPolicy.metricsFrom);
    const http = routerPolicy.spec.ingress.find((i) => i.ports?.[0].port === 'http');
    assert.deepEqual(http.from, full.networkPolicy.httpFrom);
    for (const rule of routerPolicy.spec.ingress) {
      for (const p of rule.ports || []) portByName(mainContainer(r.deployment('router')), p.port);
    }
    const workerPolicy = r.get('NetworkPolicy', `${release}-pdserve-workers`);
    const ex = Object.fromEntries(workerPolicy.spec.podSelector.matchExpressions.map((e) => [e.key, e.values]));
    assert.deepEqual(ex['app.kubernetes.io/component'], ['prefill', 'decode']);
    assert.ok(workerPolicy.spec.ingress.some((i) => !i.ports && selects(i.from[0].podSelector, workerPod)),
      'workers accept KV transfers from each other on any port');
  });
  test('control plane: existing cluster secret, cert-manager certificates from the ClusterIssuer', () => {
    assert.ok(!r.has('Secret') && !r.has('Issuer'));
    for (const c of components) {
      const d = r.deployment(c);
      const src = secretFile(d, flags(mainContainer(d)).get('cluster-secret-file'));
      assert.deepEqual([src.secretName, src.key], ['pdserve-cluster-secret', 'secret']);
      const cert = r.get('Certificate', `${release}-pdserve-${c}-control-tls`);
      assert.equal(tlsSecretOf(d), cert.spec.secretName);
      assert.deepEqual(cert.spec.issuerRef, { name: 'internal-ca', kind: 'ClusterIssuer', group: 'cert-manager.io' });
      assert.deepEqual([cert.spec.duration, cert.spec.renewBefore], ['720h', '240h']);
    }
    assert.equal(flags(mainContainer(r.deployment('router'))).get('salt-per-api-key'), true);
  });
  test('metrics keys: every process reads the accepted keys, the ServiceMonitor sends the scrape key', () => {
    for (const c of components) {
      const d = r.deployment(c);
      const src = secretFile(d, flags(mainContainer(d)).get('metrics-key-file'));
      assert.deepEqual([src.secretName, src.key], ['pdserve-metrics-keys', 'accepted']);
    }
    for (const e of r.get('ServiceMonitor', `${release}-pdserve`).spec.endpoints) {
      assert.deepEqual(e.authorization.credentials, { name: 'pdserve-metrics-keys', key: 'prometheus' });
    }
  });
});

describe('targeted overrides', () => {
  test('PodMonitor instead of ServiceMonitor', () => {
    const r = render({ set: ['metrics.podMonitor.enabled=true'] });
    assert.ok(!r.has('ServiceMonitor'));
    const pm = r.get('PodMonitor', `${release}-pdserve`);
    const ports = pm.spec.podMetricsEndpoints.map((e) => e.port).sort();
    assert.deepEqual(ports, ['http', 'metrics']);
    for (const c of ['router', 'prefill', 'decode']) {
      const labels = r.deployment(c).spec.template.metadata.labels;
      assert.ok(pm.spec.selector.matchExpressions.every((e) => e.values.includes(labels[e.key])), c);
    }
  });
  test('monitors and rules are independent switches', () => {
    const r = render({ set: ['metrics.prometheusRule.enabled=true'] });
    assert.ok(r.has('PrometheusRule'));
    assert.ok(!r.has('ServiceMonitor') && !r.has('PodMonitor') && !r.has('ConfigMap'));
    const g = render({ set: ['grafana.dashboard.enabled=true'] });
    assert.equal(g.all('ConfigMap').length, 1);
    assert.equal(g.all('ConfigMap')[0].metadata.namespace, namespace);
    assert.ok(!g.has('PrometheusRule'));
  });
  test('both monitors at once is refused', () => {
    const res = runHelm(['template', release, chart, '--set', 'metrics.podMonitor.enabled=true', '--set', 'metrics.serviceMonitor.enabled=true']);
    assert.notEqual(res.status, 0);
    assert.match(res.stderr, /serviceMonitor.enabled and metrics.podMonitor.enabled are exclusive/);
  });
  test('hostPath storage', () => {
    const r = render({ set: ['model.storage.type=hostPath', 'model.storage.hostPath.path=/mnt/models'] });
    for (const c of ['router', 'prefill', 'decode']) {
      assert.deepEqual(podSpec(r.deployment(c)).volumes.find((v) => v.name === 'models').hostPath,
        { path: '/mnt/models', type: 'Directory' });
    }
    const res = runHelm(['template', release, chart, '--set', 'model.storage.type=hostPath']);
    assert.notEqual(res.status, 0);
    assert.match(res.stderr, /model.storage.hostPath.path is required/);
  });
  test('per-pod download into an emptyDir', () => {
    const r = render({ set: ['model.storage.type=download', 'model.download.repo=Qwen/Qwen2.5-0.5B-Instruct'] });
    assert.ok(!r.has('Job') && !r.has('PersistentVolumeClaim'));
    for (const c of ['router', 'prefill', 'decode']) {
      const spec = podSpec(r.deployment(c));
      assert.equal(spec.initContainers[0].name, 'model-download');
      assert.equal(envOf(spec.initContainers[0]).HF_REPO.value, 'Qwen/Qwen2.5-0.5B-Instruct');
      assert.equal(envOf(spec.initContainers[0]).HF_TOKEN, undefined, 'no token without a Secret');
      assert.ok(spec.volumes.find((v) => v.name === 'models').emptyDir);
      // The router reads the JSON and template files only: no weights for it.
      const patterns = JSON.parse(envOf(spec.initContainers[0]).HF_ALLOW_PATTERNS.value);
      assert.equal(patterns.includes('*.safetensors'), c !== 'router', c);
      assert.ok(patterns.includes('*.json') && patterns.includes('*.jinja'), c);
    }
    const res = runHelm(['template', release, chart, '--set', 'model.storage.type=download']);
    assert.notEqual(res.status, 0);
    assert.match(res.stderr, /model.download.repo is required/);
  });
  test('KV tiers: one pool alone, the host tier alone, sizes (and the pool\'s) from a values file in decimal', () => {
    const host = render({ set: ['decode.kvTiers.hostCacheBytes=64GiB'] });
    assert.deepEqual(kvTiers(host, 'decode'), { ...noKvTiers, host: '64GiB' });
    assert.deepEqual(kvTiers(host, 'prefill'), noKvTiers);
    // A values file makes floats of integers; the flags still get plain digits.
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-helm-'));
    try {
      const file = path.join(dir, 'tiers.yaml');
      fs.writeFileSync(file, YAML.stringify({ prefill: { kvCacheBytes: 42949672960, kvTiers: { hostCacheBytes: 68719476736,
        disk: { enabled: true, sizeBytes: 536870912000, mountPath: '/kv', sizeLimit: '600Gi' } } } }));
      const r = render({ files: [file] });
      const t = kvTiers(r, 'prefill');
      assert.deepEqual([t.host, t.dir, t.bytes], ['68719476736', '/kv', '536870912000']);
      assert.deepEqual(t.volume.emptyDir, { sizeLimit: '600Gi' });
      assert.equal(flags(mainContainer(r.deployment('prefill'))).get('kv-cache-bytes'), '42949672960');
    } finally {
      fs.rmSync(dir, { recursive: true });
    }
  });
  test('a router PDB that keeps every router pod is refused', () => {
    const refused = (set) => {
      const res = runHelm(['template', release, chart, ...set.flatMap((v) => ['--set', v])]);
      assert.notEqual(res.status, 0, set.join(' '));
      return res.stderr;
    };
    assert.match(refused(['router.podDisruptionBudget.enabled=true']),
      /router\.podDisruptionBudget\.minAvailable \(1\) must be below the router's replicas \(1\): no router pod could ever be evicted/);
    assert.match(refused(['router.podDisruptionBudget.enabled=true', 'router.autoscaling.enabled=true',
      'router.autoscaling.minReplicas=2', 'router.podDisruptionBudget.minAvailable=2']),
      /must be below the router's autoscaling\.minReplicas \(2\)/);
    const two = render({ set: ['router.podDisruptionBudget.enabled=true', 'router.replicas=2'] });
    assert.equal(two.get('PodDisruptionBudget', `${release}-pdserve-router`).spec.minAvailable, 1);
    const percent = render({ set: ['router.podDisruptionBudget.enabled=true', 'router.podDisruptionBudget.minAvailable=50%'] });
    assert.equal(percent.get('PodDisruptionBudget', `${release}-pdserve-router`).spec.minAvailable, '50%');
  });
  test('a disk tier\'s flush must fit in the grace period, with the drain before it', () => {
    const base = ['decode.kvTiers.disk.enabled=true', 'decode.kvTiers.disk.sizeBytes=10GiB'];
    const fits = render({ set: [...base, 'decode.terminationGracePeriodSeconds=60', 'decode.kvTiers.disk.flushTimeoutSeconds=30'] });
    assert.equal(kvTiers(fits, 'decode').flush, '30');
    // The drain gets what the flush and 10 s of shutdown leave.
    assert.equal(flags(mainContainer(fits.deployment('decode'))).get('drain-timeout'), '20');
    const res = runHelm(['template', release, chart, ...[...base, 'decode.terminationGracePeriodSeconds=40'].flatMap((v) => ['--set', v])]);
    assert.notEqual(res.status, 0);
    assert.match(res.stderr, /decode\.terminationGracePeriodSeconds \(40\) must cover the drain \(at least 1 s\), decode\.kvTiers\.disk\.flushTimeoutSeconds \(30\) and 10 s of shutdown: raise it to 41/);
    // Without a disk tier there is nothing to flush, whatever the grace period.
    const short = render({ set: ['decode.terminationGracePeriodSeconds=5'] });
    assert.deepEqual(kvTiers(short, 'decode'), noKvTiers);
    assert.equal(flags(mainContainer(short.deployment('decode'))).get('drain-timeout'), '1');
  });
  test('a disk tier without sizeBytes is refused with its message', () => {
    for (const role of ['prefill', 'decode']) {
      for (const extra of [[], ['--set', `${role}.kvTiers.disk.sizeBytes=0`]]) {
        const res = runHelm(['template', release, chart, '--set', `${role}.kvTiers.disk.enabled=true`, ...extra]);
        assert.notEqual(res.status, 0, `${role} ${extra}`);
        assert.match(res.stderr, new RegExp(`${role}\\.kvTiers\\.disk\\.sizeBytes is required when ${role}\\.kvTiers\\.disk\\.enabled is true`));
      }
    }
  });
  test('replica counts and zero GPUs', () => {
    const r = render({ set: ['prefill.replicas=0', 'decode.replicas=5', 'router.replicas=2', 'decode.gpus=0', 'decode.device=cpu'] });
    assert.equal(r.deployment('prefill').spec.replicas, 0);
    assert.equal(r.deployment('decode').spec.replicas, 5);
    assert.equal(r.deployment('router').spec.replicas, 2);
    assert.equal(workerResources(r, 'decode').limits['nvidia.com/gpu'], undefined);
    assert.equal(workerResources(r, 'prefill').limits['nvidia.com/gpu'], 1);
  });
  test('NOTES.txt tells how to send the first request', () => {
    const res = runHelm(['install', release, chart, '--dry-run=client', '--namespace', namespace]);
    assert.equal(res.status, 0, res.stderr);
    const notes = res.stdout.slice(res.stdout.indexOf('NOTES:'));
    assert.match(notes, new RegExp(`port-forward service/${release}-pdserve-router 8000:8000`));
    assert.match(notes, /curl -s \$URL\/v1\/completions -H 'Content-Type: application\/json'/);
    assert.match(notes, /"prompt": "The capital of France is", "max_tokens": 16/);
    assert.match(notes, new RegExp(`cluster secret in Secret ${release}-pdserve-cluster-secret`));
  });
});

describe('tensor parallelism (prefill.tensorParallel, decode.tensorParallel)', () => {
  test('default: --tensor-parallel=1 and one GPU per worker', () => {
    const r = render();
    for (const role of ['prefill', 'decode']) {
      assert.equal(flags(mainContainer(r.deployment(role))).get('tensor-parallel'), '1', role);
      assert.equal(workerResources(r, role).limits['nvidia.com/gpu'], 1, role);
    }
  });
  test('decode.tensorParallel=4: four GPUs, --tensor-parallel=4, a memory-backed /dev/shm', () => {
    const r = render({ set: ['prefill.replicas=0', 'decode.tensorParallel=4'] });
    const res = workerResources(r, 'decode');
    assert.equal(res.limits['nvidia.com/gpu'], 4);
    assert.equal(res.requests['nvidia.com/gpu'], 4);
    assert.equal(flags(mainContainer(r.deployment('decode'))).get('tensor-parallel'), '4');
    assert.equal(flags(mainContainer(r.deployment('prefill'))).get('tensor-parallel'), '1');
    assert.equal(workerResources(r, 'prefill').limits['nvidia.com/gpu'], 1);
    const mount = mainContainer(r.deployment('decode')).volumeMounts.find((m) => m.mountPath === '/dev/shm');
    assert.ok(mount);
    const vol = podSpec(r.deployment('decode')).volumes.find((v) => v.name === mount.name);
    assert.equal(vol.emptyDir.medium, 'Memory');
  });
  test('a prefill pool of the decode pool\'s size: both --tensor-parallel=2', () => {
    const r = render({ set: ['prefill.tensorParallel=2', 'decode.tensorParallel=2'] });
    for (const role of ['prefill', 'decode']) {
      assert.equal(flags(mainContainer(r.deployment(role))).get('tensor-parallel'), '2', role);
      assert.equal(workerResources(r, role).limits['nvidia.com/gpu'], 2, role);
    }
  });
  test('pools of different sizes: over ucx or nccl, any KV type', () => {
    const r = render({ set: ['prefill.tensorParallel=2', 'decode.tensorParallel=4'] });
    assert.equal(flags(mainContainer(r.deployment('prefill'))).get('tensor-parallel'), '2');
    assert.equal(flags(mainContainer(r.deployment('decode'))).get('tensor-parallel'), '4');
    const nccl = render({ set: ['decode.tensorParallel=2', 'kvTransfer=nccl'] });
    for (const [role, tp] of [['prefill', '1'], ['decode', '2']]) {
      const f = flags(mainContainer(nccl.deployment(role)));
      assert.equal(f.get('tensor-parallel'), tp, role);
      assert.equal(f.get('kv-transfer'), 'nccl', role);
    }
    // Scaled KV types move with their heads' scales.
    render({ set: ['decode.tensorParallel=2', 'kvCache.dtype=fp8'] });
    render({ set: ['decode.tensorParallel=2', 'kvCache.dtype=nvfp4'] });
    // Equal sizes, or no prefill pool: any transfer and KV type.
    render({ set: ['prefill.tensorParallel=2', 'decode.tensorParallel=2', 'kvTransfer=nccl'] });
    render({ set: ['prefill.replicas=0', 'decode.tensorParallel=2', 'kvTransfer=nccl'] });
  });
  test('more GPUs than ranks keep their count; CPU ranks get no GPU', () => {
    const r = render({ set: ['prefill.replicas=0', 'decode.tensorParallel=2', 'decode.gpus=4'] });
    assert.equal(workerResources(r, 'decode').limits['nvidia.com/gpu'], 4);
    const cpu = render({ set: ['prefill.replicas=0', 'decode.tensorParallel=2', 'decode.gpus=0', 'decode.device=cpu'] });
    assert.equal(workerResources(cpu, 'decode').limits['nvidia.com/gpu'], undefined);
    assert.equal(flags(mainContainer(cpu.deployment('decode'))).get('tensor-parallel'), '2');
  });
});

describe('values.schema.json rejects bad values with its message', () => {
  const cases = [
    [['prefill.replicas=-1'], /at '\/prefill\/replicas': minimum: got -1, want 0/],
    [['decode.replicas=-3'], /at '\/decode\/replicas': minimum: got -3, want 0/],
    [['router.replicas=0'], /at '\/router\/replicas': minimum: got 0, want 1/],
    [['model.storage.type=nfs'], /at '\/model\/storage\/type': value must be one of 'existingClaim', 'newClaim', 'hostPath', 'download', 'tiny'/],
    [['decode.gpus=two'], /at '\/decode\/gpus': got string, want integer/],
    [['routing.policy=fastest'], /at '\/routing\/policy': value must be one of 'kv', 'dynamo', 'llm-d', 'sglang', 'production-stack', 'round_robin', 'least_loaded', 'random'/],
    [['routing.replicationCopyCost=-1'], /at '\/routing\/replicationCopyCost': minimum: got -1, want 0/],
    [['routing.replicationMinRequests=0'], /at '\/routing\/replicationMinRequests': minimum: got 0, want 1/],
    [['routing.replicationWindowSeconds=0'], /at '\/routing\/replicationWindowSeconds'/],
    [['routing.drainPushBlocks=-5'], /at '\/routing\/drainPushBlocks': minimum: got -5, want 0/],
    [['routing.replicationMaxInflight=-1'], /at '\/routing\/replicationMaxInflight': minimum: got -1, want 0/],
    [['routing.replicationMaxCopyTokensPerS=-2'], /at '\/routing\/replicationMaxCopyTokensPerS': minimum: got -2, want 0/],
    [['prefill.kvCacheBytes=lots'], /at '\/prefill\/kvCacheBytes'/],
    [['router.httpPort=70000'], /at '\/router\/httpPort': maximum: got 70,000, want 65,535/],
    [['replica=2'], /additional properties 'replica' not allowed/],
    [['decode.strategy.type=Surge'], /at '\/decode\/strategy\/type': value must be one of 'RollingUpdate', 'Recreate'/],
    // Control-plane values that contradict each other.
    [['controlPlane.insecure=true', 'controlPlane.clusterSecret.existingSecret=s'],
      /at '\/controlPlane\/clusterSecret\/existingSecret': maxLength: got 1, want 0/],
    [['controlPlane.insecure=on'], /at '\/controlPlane\/insecure': got string, want boolean/],
    [['controlPlane.clusterSecret.key='], /at '\/controlPlane\/clusterSecret\/key': minLength/],
    [['controlPlane.tls.enabled=true'], /at '\/controlPlane\/tls\/existingSecret': minLength: got 0, want 1/],
    [['controlPlane.tls.enabled=true', 'controlPlane.tls.existingSecret=t', 'controlPlane.tls.certManager.enabled=true'],
      /at '\/controlPlane\/tls\/certManager\/enabled': value must be false/],
    [['controlPlane.tls.certManager.enabled=true'], /at '\/controlPlane\/tls\/enabled': value must be true/],
    [['controlPlane.tls.existingSecret=t'], /at '\/controlPlane\/tls\/enabled': value must be true/],
    [['controlPlane.tls.enabled=true', 'controlPlane.tls.certManager.enabled=true', 'controlPlane.tls.certManager.duration=90d'],
      /at '\/controlPlane\/tls\/certManager\/duration'/],
    [['router.saltPerApiKey=true'], /at '\/router\/apiKeys\/existingSecret': minLength: got 0, want 1/],
    [['router.allowedOrigins={app.example.com}'], /at '\/router\/allowedOrigins\/0'/],
    [['metrics.auth.key=a/b'], /at '\/metrics\/auth\/key'/],
    // Device, KV transfer and staging.
    [['prefill.device=gpu'], /at '\/prefill\/device': 'gpu' does not match pattern/],
    [['decode.gpus=0'], /at '\/decode\/gpus': minimum: got 0, want 1/],
    [['decode.device=cuda:1', 'decode.gpus=0'], /at '\/decode\/gpus': minimum: got 0, want 1/],
    [['prefill.device=cpu'], /at '\/prefill\/gpus': maximum: got 1, want 0/],
    [['prefill.threads=-1'], /at '\/prefill\/threads': minimum: got -1, want 0/],
    // Tensor parallelism: 1 to 8 ranks.
    [['decode.tensorParallel=0'], /at '\/decode\/tensorParallel': minimum: got 0, want 1/],
    [['prefill.tensorParallel=16'], /at '\/prefill\/tensorParallel': maximum: got 16, want 8/],
    [['decode.tensorParallel=all'], /at '\/decode\/tensorParallel': got string, want integer/],
    [['kvTransfer=rdma'], /at '\/kvTransfer': value must be one of 'ucx', 'nccl'/],
    [['kvTransfer=nccl', 'decode.device=cpu', 'decode.gpus=0'], /at '\/decode\/device': 'cpu' does not match pattern '\^\(auto\|cuda/],
    [['kvStaging.mode=sometimes'], /at '\/kvStaging\/mode': value must be one of 'auto', 'always', 'never'/],
    [['kvStaging.bytes=lots'], /at '\/kvStaging\/bytes'/],
    // Lower KV tiers.
    [['prefill.kvTiers.hostCacheBytes=lots'], /at '\/prefill\/kvTiers\/hostCacheBytes'/],
    [['decode.kvTiers.disk.sizeBytes=1PB'], /at '\/decode\/kvTiers\/disk\/sizeBytes'/],
    [['decode.kvTiers.disk.mountPath=kv'], /at '\/decode\/kvTiers\/disk\/mountPath': 'kv' does not match pattern/],
    [['prefill.kvTiers.disk.hostPath=nvme'], /at '\/prefill\/kvTiers\/disk\/hostPath': 'nvme' does not match pattern/],
    [['prefill.kvTiers.disk.enable=true'], /at '\/prefill\/kvTiers\/disk': additional properties 'enable' not allowed/],
    [['decode.kvTiers.disk.write=around'], /at '\/decode\/kvTiers\/disk\/write'/],
    [['prefill.kvTiers.disk.writeQueueBlocks=0'], /at '\/prefill\/kvTiers\/disk\/writeQueueBlocks'/],
    [['decode.kvTiers.disk.writeBytesPerSecond=fast'], /at '\/decode\/kvTiers\/disk\/writeBytesPerSecond'/],
    [['decode.kvTiers.disk.flushTimeoutSeconds=-1'], /at '\/decode\/kvTiers\/disk\/flushTimeoutSeconds'/],
  ];
  for (const [set, message] of cases) {
    test(set.join(' '), () => {
      const args = ['template', release, chart];
      for (const s of set) args.push('--set', s);
      const res = runHelm(args);
      assert.notEqual(res.status, 0, `accepted ${set}`);
      assert.match(res.stderr, message);
    });
  }
});

// Validates every object against the Kubernetes API schemas; one failure
// lists every invalid object and field.
async function assertValidObjects(r, label) {
  const problems = [];
  for (const o of r.objects) {
    try {
      await validateObject(o);
    } catch (e) {
      if (!(e instanceof SchemaError)) throw e;
      problems.push(e.message);
    }
  }
  assert.deepEqual(problems, [], `${label}: objects the Kubernetes API would refuse:\n${problems.join('\n')}`);
}

// The one SchemaError validating `object` throws.
async function schemaError(object) {
  try {
    await validateObject(object);
  } catch (e) {
    if (e instanceof SchemaError) return e.message;
    throw e;
  }
  assert.fail(`${object.kind}/${object.metadata?.name} passed validation`);
}

describe('every rendered object validates against the Kubernetes API schemas', () => {
  const renders = [
    ['default values', {}],
    ['values-cpu.yaml', { files: [cpuValues] }],
    ['values-full.yaml (ServiceMonitor, PrometheusRule, dashboard, cert-manager, NCCL)', { files: [fullValues] }],
    ['values-full.yaml with a PodMonitor', { files: [fullValues], set: ['metrics.serviceMonitor.enabled=false', 'metrics.podMonitor.enabled=true'] }],
    ['cert-manager with the release\'s own CA, per-pod download, metrics keys, monitors on', {
      set: ['controlPlane.tls.enabled=true', 'controlPlane.tls.certManager.enabled=true', 'model.storage.type=download',
        'model.download.repo=Qwen/Qwen2.5-0.5B-Instruct', 'model.download.hfTokenSecret.name=hf', 'metrics.auth.existingSecret=keys',
        'metrics.podMonitor.enabled=true', 'metrics.prometheusRule.enabled=true', 'grafana.dashboard.enabled=true'] }],
    ['hostPath storage, TLS from a Secret, no NetworkPolicy, insecure', {
      set: ['model.storage.type=hostPath', 'model.storage.hostPath.path=/mnt/models', 'controlPlane.tls.enabled=true',
        'controlPlane.tls.existingSecret=tls', 'networkPolicy.enabled=false', 'controlPlane.insecure=true'] }],
  ];
  const kinds = new Set();
  for (const [label, opts] of renders) {
    test(label, async () => {
      const r = render(opts);
      for (const o of r.objects) kinds.add(o.kind);
      await assertValidObjects(r, label);
    });
  }
  test('the renders above cover every kind the templates create', () => {
    const templated = new Set();
    for (const f of fs.readdirSync(path.join(chart, 'templates')).filter((x) => x.endsWith('.yaml'))) {
      for (const m of fs.readFileSync(path.join(chart, 'templates', f), 'utf8').matchAll(/^kind: (\w+)$/gm)) templated.add(m[1]);
    }
    assert.ok(templated.has('ServiceMonitor') && templated.has('PodMonitor') && templated.has('PrometheusRule'));
    assert.deepEqual([...templated].filter((k) => !kinds.has(k)), [], 'kinds no render validated');
  });

  // Values that values.schema.json lets through but that render objects the
  // API server refuses: only the API schemas catch them.
  const badValues = [
    [['--set-json', 'prefill.extraEnv=[{"name":"A","value":1}]'],
      /^Deployment\/rel-pdserve-prefill: spec\/template\/spec\/containers\/0\/env\/\d+\/value: must be string$/],
    [['--set-json', 'decode.affinity={"nodeAfinity":{}}'],
      /^Deployment\/rel-pdserve-decode: spec\/template\/spec\/affinity\/nodeAfinity: unknown field$/],
    [['--set', 'prefill.tolerations[0].effect=Sometimes'],
      /^Deployment\/rel-pdserve-prefill: spec\/template\/spec\/tolerations\/0\/effect: must be one of "NoExecute", "NoSchedule", "PreferNoSchedule"$/],
    [['--set', 'metrics.serviceMonitor.enabled=true', '--set', 'metrics.serviceMonitor.interval=often'],
      /^ServiceMonitor\/rel-pdserve: spec\/endpoints\/0\/interval: must match .*; spec\/endpoints\/1\/interval: must match /],
  ];
  for (const [args, message] of badValues) {
    test(`rejected: ${args.filter((a) => !a.startsWith('--')).join(' ')}`, async () => {
      const res = runHelm(['template', release, chart, '--namespace', namespace, ...args]);
      assert.equal(res.status, 0, `values.schema.json now refuses it (pick another case): ${res.stderr}`);
      const objects = YAML.parseAllDocuments(res.stdout).map((d) => d.toJS()).filter(Boolean);
      const errors = [];
      for (const o of objects) errors.push(await schemaError(o).catch(() => null));
      assert.deepEqual(errors.filter(Boolean).length, 1, `one object refused: ${errors.filter(Boolean).join('\n')}`);
      assert.match(errors.find(Boolean), message);
    });
  }

  // Rendered objects corrupted after the fact, one field each.
  test('corrupted objects are rejected naming the object and the field', async () => {
    const rendered = render({ files: [fullValues], set: ['metrics.serviceMonitor.enabled=false', 'metrics.podMonitor.enabled=true'] });
    const fresh = () => new Rendered(structuredClone(rendered.objects));
    const cases = [
      ['Deployment', (o) => { o.spec.replicas = 'two'; }, /^Deployment\/rel-pdserve-decode: spec\/replicas: must be integer$/],
      ['Deployment', (o) => { delete o.spec.selector; }, /^Deployment\/rel-pdserve-decode: spec: required field selector is missing$/],
      ['Deployment', (o) => { podSpec(o).containers[0].resources.limits.memory = '64 GB'; },
        /^Deployment\/rel-pdserve-decode: spec\/template\/spec\/containers\/0\/resources\/limits\/memory: /],
      ['Deployment', (o) => { podSpec(o).containers[0].imagePullPolicyy = 'Always'; },
        /^Deployment\/rel-pdserve-decode: spec\/template\/spec\/containers\/0\/imagePullPolicyy: unknown field$/],
      ['Service', (o) => { o.spec.ports[0].protocol = 'QUIC'; }, /^Service\/rel-pdserve-\S+: spec\/ports\/0\/protocol: must be one of /],
      ['PodMonitor', (o) => { o.spec.podMetricsEndpoints[0].scheme = 'ftp'; },
        /^PodMonitor\/rel-pdserve: spec\/podMetricsEndpoints\/0\/scheme: must be one of /],
      ['PrometheusRule', (o) => { delete o.spec.groups[0].rules[0].expr; },
        /^PrometheusRule\/rel-pdserve: spec\/groups\/0\/rules\/0: required field expr is missing$/],
      ['Certificate', (o) => { o.spec.secretNam = o.spec.secretName; },
        /^Certificate\/rel-pdserve-\S+: spec\/secretNam: unknown field$/],
      ['NetworkPolicy', (o) => { o.apiVersion = 'networking.k8s.io/v9'; }, /^NetworkPolicy\/rel-pdserve-\S+: no schema for networking\.k8s\.io\/v9 NetworkPolicy /],
    ];
    for (const [kind, corrupt, message] of cases) {
      const r = fresh();
      const object = kind === 'Deployment' ? r.deployment('decode') : r.all(kind)[0];
      assert.ok(object, `no ${kind} rendered`);
      await validateObject(object);
      corrupt(object);
      assert.match(await schemaError(object), message, `${kind}: ${corrupt}`);
    }
  });
});

// The image runs the build's pdserve: every subcommand and flag the chart
// passes must exist there. ctest passes PDSERVE_BIN when the build has the
// pdserve target; without a built binary this part is skipped.
describe('the chart\'s commands and flags exist in pdserve', () => {
  const bin = process.env.PDSERVE_BIN;
  const skip = !bin ? 'PDSERVE_BIN not set' : !fs.existsSync(bin) ? `${bin} not built` : false;
  const known = new Map();
  function knownFlags(command) {
    if (!known.has(command)) {
      const res = spawnSync(bin, [command, '--help'], { encoding: 'utf8' });
      assert.equal(res.status, 0, `pdserve ${command} --help failed: ${res.stderr}`);
      known.set(command, new Set([...res.stdout.matchAll(/^\s+--([a-z0-9-]+)/gm)].map((m) => m[1])));
    }
    return known.get(command);
  }
  for (const [label, opts] of [['default values', {}], ['values-cpu.yaml', { files: [cpuValues] }],
    ['values-full.yaml', { files: [fullValues] }]]) {
    test(label, { skip }, () => {
      const r = render(opts);
      for (const d of r.all('Deployment')) {
        const c = mainContainer(d);
        const have = knownFlags(c.args[0]);
        for (const flag of flags(c).keys()) assert.ok(have.has(flag), `${d.metadata.name}: pdserve ${c.args[0]} has no --${flag}`);
        for (const init of podSpec(d).initContainers || []) {
          for (const m of (init.command || []).join(' ').matchAll(/\bpdserve ([a-z-]+)((?: +--?[a-z0-9-]+(?: +"?[^-" ][^ ]*"?)?)*)/g)) {
            const have = knownFlags(m[1]);
            for (const f of m[2].matchAll(/--([a-z0-9-]+)/g)) {
              assert.ok(have.has(f[1]), `${d.metadata.name}/${init.name}: pdserve ${m[1]} has no --${f[1]}`);
            }
          }
        }
      }
    });
  }
});

test('helm is the one from install-deps or PATH', () => {
  const v = execFileSync(helm, ['version', '--short'], { encoding: 'utf8' });
  assert.match(v, /^v\d+\.\d+/);
});
