// Static checks of the container images (no Docker engine runs here):
// deploy/docker/Dockerfile (CUDA) and Dockerfile.cpu (Debian 12).
// - every path COPY takes from the build context exists and is not filtered
//   out by the Dockerfile's .dockerignore, nor is any module CMake adds;
// - the build stage runs the commands the Makefile and README document;
// - the final stage is a runtime base with a non-root user (the uid the Helm
//   chart runs as), `pdserve` as entrypoint and OCI labels;
// - runtime-packages.sh, which picks the final stage's packages, maps a real
//   binary's libraries to installed packages and refuses unpackaged ones.
//
// Run: node --test tests/docker/dockerfile_test.mjs   (PDSERVE_BIN=build/pdserve optional)
import assert from 'node:assert/strict';
import { execFileSync, spawnSync } from 'node:child_process';
import fs from 'node:fs';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import { describe, test } from 'node:test';
import { fileURLToPath } from 'node:url';

const root = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '../..');
const require = createRequire(path.join(process.env.PDSERVE_NPM_DIR || path.join(root, '.deps/npm'), 'package.json'));
const YAML = require('yaml');
const runtimePackages = path.join(root, 'deploy/docker/runtime-packages.sh');

// Parses a Dockerfile into stages of {instruction, args, flags} with ARG
// defaults substituted; backslash continuations joined, comments dropped.
function parseDockerfile(file) {
  const lines = fs.readFileSync(file, 'utf8').split('\n');
  const logical = [];
  let cur = '';
  for (const raw of lines) {
    if (/^\s*#/.test(raw) && cur === '') continue;
    if (/^\s*#/.test(raw)) continue; // comment inside a continuation
    const line = raw.replace(/\s+$/, '');
    if (line.endsWith('\\')) { cur += line.slice(0, -1) + ' '; continue; }
    cur += line;
    if (cur.trim()) logical.push(cur.trim());
    cur = '';
  }
  const globalArgs = {};
  const stages = [];
  for (const l of logical) {
    const m = /^(\w+)\s+(.*)$/.exec(l);
    assert.ok(m, `cannot parse Dockerfile line: ${l}`);
    const instruction = m[1].toUpperCase();
    let rest = m[2];
    const flags = {};
    for (let f; (f = /^--([\w-]+)=(\S+)\s+/.exec(rest)); rest = rest.slice(f[0].length)) flags[f[1]] = f[2];
    const stage = stages[stages.length - 1];
    const vars = stage ? stage.args : globalArgs;
    const subst = (s) => s.replace(/\$\{(\w+)\}/g, (_, v) => (v in vars ? vars[v] : `\${${v}}`));
    if (instruction === 'ARG') {
      const [name, def] = rest.split('=');
      vars[name] = def !== undefined ? def : (globalArgs[name] ?? `\${${name}}`);
      continue;
    }
    if (instruction === 'FROM') {
      // FROM sees only the ARGs declared before the first FROM.
      const fromSubst = rest.replace(/\$\{(\w+)\}/g, (_, n) => (n in globalArgs ? globalArgs[n] : `\${${n}}`));
      const fm = /^(\S+)(?:\s+AS\s+(\S+))?$/i.exec(fromSubst);
      stages.push({ image: fm[1], name: fm[2], args: {}, steps: [] });
      continue;
    }
    assert.ok(stage, `${instruction} before FROM`);
    stage.steps.push({ instruction, args: subst(rest), flags });
  }
  return stages;
}

// .dockerignore semantics, enough for the patterns used here.
function ignoredBy(patterns) {
  const res = patterns.map((p) => new RegExp(`^${p.replace(/^\//, '').replace(/[.+^$()|[\]{}]/g, '\\$&')
    .replace(/\*\*\//g, '(.*/)?').replace(/\*/g, '[^/]*')}(/.*)?$`));
  return (rel) => res.some((re) => re.test(rel));
}
const readIgnore = (file) => fs.readFileSync(file, 'utf8').split('\n').map((l) => l.trim())
  .filter((l) => l && !l.startsWith('#'));

function makeRecipes() {
  const recipes = {};
  let target = null;
  for (const line of fs.readFileSync(path.join(root, 'Makefile'), 'utf8').split('\n')) {
    const t = /^([\w-]+):/.exec(line);
    if (t) { target = t[1]; recipes[target] = []; continue; }
    if (line.startsWith('\t') && target) recipes[target].push(line.trim());
    else if (line.trim() === '') target = null;
  }
  return recipes;
}

const chartValues = YAML.parse(fs.readFileSync(path.join(root, 'helm/pdserve/values.yaml'), 'utf8'));
const readme = fs.readFileSync(path.join(root, 'README.md'), 'utf8');
const topLevelModules = /pdserve_add_subdirs\(([^)]*)\)/.exec(fs.readFileSync(path.join(root, 'CMakeLists.txt'), 'utf8'))[1]
  .trim().split(/\s+/);

const variants = [
  { file: 'Dockerfile', build: /^nvidia\/cuda:[\d.]+-devel-ubuntu\d+\.\d+$/, final: /^nvidia\/cuda:[\d.]+-runtime-ubuntu\d+\.\d+$/, cuda: 'ON' },
  { file: 'Dockerfile.cpu', build: /^debian:12$/, final: /^debian:12-slim$/, cuda: 'OFF' },
];

for (const v of variants) {
  describe(`deploy/docker/${v.file}`, () => {
    const dockerfile = path.join(root, 'deploy/docker', v.file);
    const stages = parseDockerfile(dockerfile);
    const [build, final] = [stages[0], stages[stages.length - 1]];
    const ignored = ignoredBy(readIgnore(`${dockerfile}.dockerignore`));
    const runs = (stage) => stage.steps.filter((s) => s.instruction === 'RUN').map((s) => s.args);

    test('multi-stage: devel base to build, runtime base to run', () => {
      assert.ok(stages.length >= 2);
      assert.match(build.image, v.build);
      assert.match(final.image, v.final);
      assert.equal(build.name, 'build');
    });

    test('every COPY source from the context exists and passes .dockerignore', () => {
      const copies = stages.flatMap((s) => s.steps).filter((s) => s.instruction === 'COPY' && !s.flags.from);
      assert.ok(copies.length >= 2);
      for (const c of copies) {
        const parts = c.args.split(/\s+/);
        for (const src of parts.slice(0, -1)) {
          const rel = path.normalize(src).replace(/\/$/, '');
          assert.ok(fs.existsSync(path.join(root, rel)), `COPY ${src}: no such path in the repository`);
          if (rel !== '.') assert.ok(!ignored(rel), `COPY ${src} is excluded by the .dockerignore`);
        }
      }
      // `COPY . .` must still carry everything the build reads.
      for (const p of ['CMakeLists.txt', 'CMakePresets.json', 'Makefile', 'cmake', ...topLevelModules,
        'deploy/docker/runtime-packages.sh', 'deploy/local/install-deps.sh']) {
        if (fs.existsSync(path.join(root, p))) assert.ok(!ignored(p), `${p} is excluded by the .dockerignore`);
      }
      for (const p of ['.deps', '.git', 'build', 'build-asan', 'build-foo/x', '.pdserve/cluster-secret', '.gpu-kit.tar.xz']) assert.ok(ignored(p), `${p} enters the context`);
    });

    test('the build stage runs the documented commands', () => {
      const recipes = makeRecipes();
      const buildRuns = runs(build);
      // `make deps` / `make up` / `make test` install with this script ...
      assert.ok(recipes.deps.includes('./deploy/local/install-deps.sh'), 'Makefile deps recipe changed');
      assert.match(readme, /deploy\/local\/install-deps\.sh/);
      assert.ok(buildRuns.includes('./deploy/local/install-deps.sh'), `build stage RUNs: ${buildRuns}`);
      // ... and build the binary with the Makefile's build-pdserve target
      // (configure with cmake + Ninja, then the pdserve target alone, as
      // `make up` does: an image has no use for the test programs).
      assert.ok(recipes.configure.some((r) => /^cmake -S \. -B \$\(BUILD\) -G Ninja \$\(CMAKE_ARGS\)$/.test(r)), 'Makefile configure recipe changed');
      assert.ok(recipes['build-pdserve'].includes('cmake --build $(BUILD) --target pdserve'), 'Makefile build-pdserve recipe changed');
      const make = buildRuns.find((r) => /^make build-pdserve /.test(r));
      assert.ok(make, 'build stage does not run `make build-pdserve`');
      assert.match(make, new RegExp(`CMAKE_ARGS="-DPDSERVE_CUDA=${v.cuda}\\b`));
      const buildDir = /BUILD=(\S+)/.exec(make)[1];
      const workdir = build.steps.filter((s) => s.instruction === 'WORKDIR').pop().args;
      // The binary the final stage takes is the one this build produces.
      const take = final.steps.find((s) => s.instruction === 'COPY' && s.flags.from === 'build' && /pdserve\s/.test(s.args));
      assert.ok(take, 'final stage does not copy pdserve from the build stage');
      assert.equal(take.args.split(/\s+/)[0], path.posix.join(workdir, buildDir, 'pdserve'));
      assert.ok(buildRuns.some((r) => r.includes(`runtime-packages.sh ${buildDir}/pdserve`)));
      // The CUDA image must carry the NCCL transport (the chart's kvTransfer:
      // nccl): its build stops when CMake did not find NCCL.
      if (v.cuda === 'ON') {
        assert.ok(buildRuns.some((r) => r.startsWith(`grep -q '^NCCL_LIBRARY:FILEPATH=/' ${buildDir}/CMakeCache.txt`)),
          'the CUDA build stage does not check that NCCL was found');
        assert.match(fs.readFileSync(path.join(root, 'transport/nccl/CMakeLists.txt'), 'utf8'), /find_library\(NCCL_LIBRARY\b/,
          'the NCCL check reads a cache variable the build no longer sets');
      }
    });

    test('the final stage: runtime libraries only, non-root, pdserve entrypoint, OCI labels', () => {
      const finalRuns = runs(final).join('\n');
      assert.doesNotMatch(finalRuns, /build-essential|cmake|ninja|-dev\b|install-deps/);
      assert.match(finalRuns, /xargs -a \/tmp\/runtime-packages\.txt apt-get install -y --no-install-recommends/);
      assert.match(finalRuns, /rm -rf \/var\/lib\/apt\/lists/);
      const user = final.steps.filter((s) => s.instruction === 'USER').pop();
      const [uid, gid] = user.args.split(':').map(Number);
      assert.ok(uid > 0 && gid > 0, 'runs as root');
      assert.equal(uid, chartValues.podSecurityContext.runAsUser, 'image user differs from the chart\'s runAsUser');
      assert.equal(gid, chartValues.podSecurityContext.runAsGroup);
      assert.match(finalRuns, new RegExp(`useradd --uid ${uid} --gid ${gid}`));
      const entry = final.steps.filter((s) => s.instruction === 'ENTRYPOINT').pop();
      assert.deepEqual(JSON.parse(entry.args), ['pdserve']);
      const binary = final.steps.find((s) => s.instruction === 'COPY' && s.flags.from === 'build' && /pdserve\s/.test(s.args));
      assert.equal(binary.args.split(/\s+/).pop(), '/usr/local/bin/pdserve', 'pdserve must be on PATH (the chart calls it by name)');
      const labels = final.steps.filter((s) => s.instruction === 'LABEL').map((s) => s.args).join(' ');
      for (const key of ['title', 'description', 'version', 'revision', 'created', 'base.name']) {
        assert.match(labels, new RegExp(`org\\.opencontainers\\.image\\.${key.replace('.', '\\.')}="[^"]+"`), key);
      }
      assert.match(labels, new RegExp(`base\\.name="${final.image.replace(/[.]/g, '\\.')}"`));
      const exposed = final.steps.find((s) => s.instruction === 'EXPOSE').args.split(/\s+/).map(Number);
      assert.deepEqual(exposed, [chartValues.router.httpPort, chartValues.router.controlPort]);
    });
  });
}

describe('runtime-packages.sh', () => {
  const bin = process.env.PDSERVE_BIN;
  test(`maps every library of ${bin ? 'pdserve' : 'cmake'} to an installed package`, () => {
    const target = bin || execFileSync('sh', ['-c', 'command -v cmake'], { encoding: 'utf8' }).trim();
    const out = execFileSync(runtimePackages, [target], { encoding: 'utf8' }).trim().split('\n');
    assert.ok(out.includes('libc6') && out.includes('libstdc++6'), out.join(' '));
    // Independent check: every library ldd lists is in a file list of one of the packages.
    const files = new Set(execFileSync('dpkg-query', ['-L', ...out], { encoding: 'utf8' }).split('\n')
      .map((f) => fs.existsSync(f) ? fs.realpathSync(f) : f));
    for (const line of execFileSync('ldd', [target], { encoding: 'utf8' }).split('\n')) {
      const lib = /=> (\/\S+)/.exec(line)?.[1];
      // The CUDA runtime ships with the CUDA base image, not as a package.
      if (lib && !lib.startsWith('/usr/local/cuda')) assert.ok(files.has(fs.realpathSync(lib)), `${lib} is in none of ${out.join(' ')}`);
    }
  });
  test('refuses a library that belongs to no package', () => {
    const dir = fs.mkdtempSync(path.join(os.tmpdir(), 'pdserve-rtpkg-'));
    try {
      fs.writeFileSync(path.join(dir, 'lib.c'), 'int answer(void) { return 42; }\n');
      fs.writeFileSync(path.join(dir, 'main.c'), 'int answer(void);\nint main(void) { return answer() - 42; }\n');
      execFileSync('cc', ['-shared', '-fPIC', '-o', path.join(dir, 'libanswer.so'), path.join(dir, 'lib.c')]);
      execFileSync('cc', ['-o', path.join(dir, 'main'), path.join(dir, 'main.c'), `-L${dir}`, '-lanswer', `-Wl,-rpath,${dir}`]);
      const r = spawnSync(runtimePackages, [path.join(dir, 'main')], { encoding: 'utf8' });
      assert.equal(r.status, 1);
      assert.match(r.stderr, /libanswer\.so belongs to no installed package/);
      const usage = spawnSync(runtimePackages, [path.join(dir, 'absent')], { encoding: 'utf8' });
      assert.equal(usage.status, 2);
      assert.match(usage.stderr, /is not an executable/);
    } finally {
      fs.rmSync(dir, { recursive: true, force: true });
    }
  });
});
