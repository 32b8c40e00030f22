// Tests of the Helm chart helm/pdserve: `helm lint --strict`, then
// `helm template` with the default values, values-cpu.yaml, a full-featured
// values file and targeted overrides, with assertions on the rendered objects
// (parsed with the `yaml` package), and bad values rejected by the schema.
//
// Run: node --test tests/helm/chart_test.mjs   (HELM=path/to/helm optional)
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import path from 'node:path';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const require = createRequire(path.join(process.env.PDSERVE_NPM_DIR || path.join(root, '.deps/npm'), 'package.json'));
const YAML = require('yaml');

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
// "--name=value" args as a map; the first argument is the command.
function flags(container) {
  const m = new Map();
  for (const a of container.args.slice(1)) {
    const match = /^--([a-z-]+)=(.*)$/.exec(a);
    assert.ok(match, `argument not in --flag=value form: ${a}`);
    m.set(match[1], match[2]);
  }
  return m;
}
const portByName = (container, name) => {
  const p = (container.ports || []).find((x) => x.name === name);
  assert.ok(p, `container ${container.name} has no port named ${name}`);
  return p.containerPort;
};
const matches = (selector, labels) => Object.entries(selector).every(([k, v]) => labels[k] === v);
const envOf = (container) => Object.fromEntries((container.env || []).map((e) => [e.name, e]));

// Every probe targets a named container port that exists, /health (or /ready
// for router readiness), and ports agree with the container's flags.
function checkProbesAndPorts(r) {
  const router = mainContainer(r.deployment('router'));
  const rf = flags(router);
  assert.equal(router.args[0], 'router');
  assert.equal(String(portByName(router, 'http')), rf.get('port'));
  assert.equal(String(portByName(router, 'control')), rf.get('control-port'));
  if (rf.has('metrics-port')) assert.equal(String(portByName(router, 'metrics')), rf.get('metrics-port'));
  assert.deepEqual(router.readinessProbe.httpGet, { path: '/ready', port: 'http' });
  assert.deepEqual(router.livenessProbe.httpGet, { path: '/health', port: 'http' });
  assert.deepEqual(router.startupProbe.httpGet, { path: '/health', port: 'http' });
  for (const role of ['prefill', 'decode']) {
    const w = mainContainer(r.deployment(role));
    const wf = flags(w);
    assert.equal(w.args[0], 'worker');
    assert.equal(wf.get('role'), role);
    assert.equal(String(portByName(w, 'metrics')), wf.get('metrics-port'));
    assert.equal(String(portByName(w, 'control')), wf.get('port'));
    // Other pods reach this worker at its pod IP, never at loopback.
    assert.equal(wf.get('advertise-host'), '$(POD_IP)');
    const podIp = w.env.find((e) => e.name === 'POD_IP');
    assert.equal(podIp?.valueFrom?.fieldRef?.fieldPath, 'status.podIP');
    for (const probe of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      assert.deepEqual(w[probe].httpGet, { path: '/health', port: 'metrics' }, `${role} ${probe}`);
    }
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
    assert.equal(wf.get('max-local-prefill'), routerFlags.get('max-local-prefill'));
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
      'HorizontalPodAutoscaler', 'PodDisruptionBudget', 'NetworkPolicy', 'Job', 'PersistentVolumeClaim']) {
      assert.ok(!r.has(kind), `${kind} rendered although not enabled`);
    }
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
  test('GPU resource name and count per pool', () => {
    assert.equal(workerResources(r, 'prefill').limits['amd.com/gpu'], 2);
    assert.equal(workerResources(r, 'decode').limits['amd.com/gpu'], 1);
    assert.equal(workerResources(r, 'decode').limits['nvidia.com/gpu'], undefined);
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
    assert.deepEqual(podSpec(r.deployment('prefill')).affinity, full.prefill.affinity);
    assert.deepEqual(podSpec(r.deployment('router')).nodeSelector, full.router.nodeSelector);
    assert.equal(flags(mainContainer(r.deployment('prefill'))).get('kv-cache-bytes'), '40GiB');
    assert.deepEqual(r.deployment('decode').spec.strategy, full.decode.strategy);
    assert.equal(r.deployment('prefill').spec.strategy, undefined);
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
      'PdserveNoReadyDecodeWorker', 'PdservePrefixCacheHitRateCollapse']);
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
    assert.ok(matches(control.from[0].podSelector.matchLabels, workerPod), 'workers may reach the control port');
    const metrics = routerPolicy.spec.ingress.find((i) => i.ports?.[0].port === 'metrics');
    assert.deepEqual(metrics.from, full.networkPolicy.metricsFrom);
    for (const rule of routerPolicy.spec.ingress) {
      for (const p of rule.ports || []) portByName(mainContainer(r.deployment('router')), p.port);
    }
    const workerPolicy = r.get('NetworkPolicy', `${release}-pdserve-workers`);
    const ex = Object.fromEntries(workerPolicy.spec.podSelector.matchExpressions.map((e) => [e.key, e.values]));
    assert.deepEqual(ex['app.kubernetes.io/component'], ['prefill', 'decode']);
    assert.ok(workerPolicy.spec.ingress.some((i) => !i.ports && matches(i.from[0].podSelector.matchLabels, workerPod)),
      'workers accept KV transfers from each other on any port');
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
    }
    const res = runHelm(['template', release, chart, '--set', 'model.storage.type=download']);
    assert.notEqual(res.status, 0);
    assert.match(res.stderr, /model.download.repo is required/);
  });
  test('replica counts and zero GPUs', () => {
    const r = render({ set: ['prefill.replicas=0', 'decode.replicas=5', 'router.replicas=2', 'decode.gpus=0'] });
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
  });
});

describe('values.schema.json rejects bad values with its message', () => {
  const cases = [
    [['prefill.replicas=-1'], /at '\/prefill\/replicas': minimum: got -1, want 0/],
    [['decode.replicas=-3'], /at '\/decode\/replicas': minimum: got -3, want 0/],
    [['router.replicas=0'], /at '\/router\/replicas': minimum: got 0, want 1/],
    [['model.storage.type=nfs'], /at '\/model\/storage\/type': value must be one of 'existingClaim', 'newClaim', 'hostPath', 'download', 'tiny'/],
    [['decode.gpus=two'], /at '\/decode\/gpus': got string, want integer/],
    [['routing.policy=fastest'], /at '\/routing\/policy': value must be one of 'kv', 'round_robin', 'least_loaded', 'random'/],
    [['prefill.kvCacheBytes=lots'], /at '\/prefill\/kvCacheBytes'/],
    [['router.httpPort=70000'], /at '\/router\/httpPort': maximum: got 70,000, want 65,535/],
    [['replica=2'], /additional properties 'replica' not allowed/],
    [['decode.strategy.type=Surge'], /at '\/decode\/strategy\/type': value must be one of 'RollingUpdate', 'Recreate'/],
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

test('helm is the one from install-deps or PATH', () => {
  const v = execFileSync(helm, ['version', '--short'], { encoding: 'utf8' });
  assert.match(v, /^v\d+\.\d+/);
});
