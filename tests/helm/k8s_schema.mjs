// Validates rendered Kubernetes objects the way an API server (and `helm
// install`, which checks against the server's OpenAPI schema) would: with the
// JSON schemas of the npm packages kubernetes-models (core API),
// @kubernetes-models/prometheus-operator (ServiceMonitor, PodMonitor,
// PrometheusRule) and @kubernetes-models/cert-manager (Certificate, Issuer),
// installed into .deps/npm by deploy/local/install-deps.sh.
//
// The packages' validate() checks types, formats, enums and required fields
// but lets unknown fields through, which the API server's strict field
// validation (and helm's schema check) rejects. So the object is validated
// through a Proxy that records which properties the schema's validator reads:
// a key of an object that the validator neither reads nor enumerates (as it
// does for maps such as labels or resource limits) is a field the schema does
// not know.
import fs from 'node:fs';
import path from 'node:path';
import { pathToFileURL } from 'node:url';

// API group -> the package holding its models (under <group>/<version>/<Kind>.js;
// the core group's under v1/<Kind>.js).
const packages = {
  '': 'kubernetes-models',
  'monitoring.coreos.com': '@kubernetes-models/prometheus-operator',
  'cert-manager.io': '@kubernetes-models/cert-manager',
};

export class SchemaError extends Error {}

// Returns validate(object): throws SchemaError naming the object
// (kind/name) and every invalid or unknown field (its JSON path).
export async function loadValidator(npmDir) {
  const modules = path.join(npmDir, 'node_modules');
  for (const pkg of Object.values(packages)) {
    if (!fs.existsSync(path.join(modules, pkg, 'package.json'))) {
      throw new Error(`npm package ${pkg} is not installed in ${npmDir}: run deploy/local/install-deps.sh`);
    }
  }
  const models = new Map();
  async function modelOf(apiVersion, kind) {
    const key = `${apiVersion}/${kind}`;
    if (!models.has(key)) {
      const slash = apiVersion.indexOf('/');
      const [group, version] = slash < 0 ? ['', apiVersion] : [apiVersion.slice(0, slash), apiVersion.slice(slash + 1)];
      const pkg = packages[group] || packages[''];
      const file = path.join(modules, pkg, group, version, `${kind}.js`);
      if (!/^([a-z0-9-]+\.)*[a-z0-9-]*$/.test(group) || !/^v[0-9a-z]+$/.test(version) || !/^[A-Za-z]+$/.test(kind) ||
          !fs.existsSync(file)) {
        return null;
      }
      models.set(key, (await import(pathToFileURL(file).href))[kind] || null);
    }
    return models.get(key);
  }

  return async function validate(object) {
    const name = `${object?.kind}/${object?.metadata?.name}`;
    if (typeof object?.apiVersion !== 'string' || typeof object?.kind !== 'string') {
      throw new SchemaError(`${name}: apiVersion and kind are required`);
    }
    const Model = await modelOf(object.apiVersion, object.kind);
    if (!Model) throw new SchemaError(`${name}: no schema for ${object.apiVersion} ${object.kind} (unknown kind or API version)`);
    const tracked = track(object);
    const problems = [];
    try {
      Model.prototype.validate.call(tracked.proxy);
    } catch (e) {
      if (!e.errors) throw e;
      problems.push(...e.errors.map(describe));
    }
    // The validators check every field (all errors, not just the first), so
    // the unknown fields are known even when a known one is invalid.
    problems.push(...tracked.unknownFields().map((f) => `${f}: unknown field`));
    if (problems.length) throw new SchemaError(`${name}: ${problems.join('; ')}`);
  };
}

// One ajv error as "spec/template/...: must be integer".
function describe(err) {
  const where = err.instancePath.replace(/^\//, '') || '(object)';
  const what = {
    required: () => `required field ${err.params.missingProperty} is missing`,
    enum: () => `must be one of ${err.params.allowedValues.map((v) => JSON.stringify(v)).join(', ')}`,
    type: () => `must be ${err.params.type}`,
    format: () => `must be a ${err.params.format}`,
    pattern: () => `must match ${err.params.pattern}`,
  }[err.keyword];
  return `${where}: ${what ? what() : err.message || err.keyword}`;
}

// Wraps a plain JSON value in Proxies that record, per object, the keys read
// and whether the keys were enumerated.
function track(root) {
  const seen = []; // [path, object, readKeys, {enumerated}]
  const cache = new WeakMap();
  function wrap(value, where) {
    if (value === null || typeof value !== 'object') return value;
    if (cache.has(value)) return cache.get(value);
    const read = new Set();
    const state = { enumerated: false };
    if (!Array.isArray(value)) seen.push([where, value, read, state]);
    const proxy = new Proxy(value, {
      get(target, key, receiver) {
        if (typeof key === 'string') read.add(key);
        const v = Reflect.get(target, key, receiver);
        return typeof key === 'string' && Object.hasOwn(target, key) ? wrap(v, `${where}/${key}`) : v;
      },
      has(target, key) {
        if (typeof key === 'string') read.add(key);
        return Reflect.has(target, key);
      },
      ownKeys(target) {
        state.enumerated = true;
        return Reflect.ownKeys(target);
      },
    });
    cache.set(value, proxy);
    return proxy;
  }
  const proxy = wrap(root, '');
  return {
    proxy,
    unknownFields() {
      const out = [];
      for (const [where, obj, read, state] of seen) {
        if (state.enumerated) continue;
        for (const k of Object.keys(obj)) if (!read.has(k)) out.push(`${where}/${k}`.replace(/^\//, ''));
      }
      return out;
    },
  };
}
