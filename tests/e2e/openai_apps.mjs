// What applications do with the official `openai` npm client, against
// `pdserve up` (router + prefill + decode workers on the tiny model):
// chat.completions.parse with a zod schema (streamed and not); tool calls
// (tool_choice required, named, auto, none; streamed and not) with the call,
// the tool's answer and the model's reply as a round trip, on a copy of the
// tiny model whose chat template renders tools in the Hermes format; n: 3
// (distinct seeds per choice), streamed and not, and best_of; the Responses
// API (responses.create, .stream, .parse with zod, function calls and their
// outputs as input items) against chat's answers for the same request;
// thoughts apart from the answer (--reasoning-parser), on chat and responses.
// Usage: node openai_apps.mjs PDSERVE_BIN NODE_MODULES_DIR
import { spawn, execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync, openSync, readFileSync, writeFileSync } from 'node:fs';
import { createRequire } from 'node:module';
import os from 'node:os';
import path from 'node:path';
import test, { after } from 'node:test';
import assert from 'node:assert/strict';

const [bin, nodeModules] = process.argv.slice(2);
const require = createRequire(path.join(nodeModules, 'noop.js'));
const OpenAI = require('openai').default ?? require('openai');
const { zodResponseFormat, zodTextFormat } = require('openai/helpers/zod');
const { z } = require('zod');

const dir = mkdtempSync(path.join(os.tmpdir(), 'pdserve-apps-'));
const model = path.join(dir, 'tiny');
execFileSync(bin, ['make-model', '--preset', 'tiny', '--out', model]);
let up = null;
after(async () => {
  if (up && up.exitCode === null) {
    // SIGTERM: `pdserve up` stops its router and workers before it exits.
    const exited = new Promise((r) => up.once('exit', r));
    up.kill('SIGTERM');
    await Promise.race([exited, new Promise((r) => setTimeout(r, 20000))]);
    if (up.exitCode === null) up.kill('SIGKILL');
  }
  rmSync(dir, { recursive: true, force: true });
});

async function waitFor(fn, what, ms = 60000) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    const v = await fn();
    if (v) return v;
    await new Promise((r) => setTimeout(r, 50));
  }
  throw new Error(`timed out waiting for ${what}`);
}

// The tiny model with a chat template that renders tools, calls and tool
// answers (Hermes format: <tool_call>...</tool_call>).
const toolModel = path.join(dir, 'tiny-tools');
execFileSync('cp', ['-r', model, toolModel]);
{
  const configPath = path.join(toolModel, 'tokenizer_config.json');
  const config = JSON.parse(readFileSync(configPath, 'utf8'));
  config.chat_template =
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nTools:\n" +
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}Call one as <tool_call>{\"name\": ..., " +
    "\"arguments\": ...}</tool_call>.<|eot_id|>{% endif %}{% for message in messages %}" +
    "{% if message.role == 'tool' %}<|start_header_id|>user<|end_header_id|>\n\n<tool_response>\n" +
    "{{ message.content }}\n</tool_response><|eot_id|>{% elif message.tool_calls %}" +
    "<|start_header_id|>assistant<|end_header_id|>\n\n{% for c in message.tool_calls %}" +
    "<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n" +
    "</tool_call>{% endfor %}<|eot_id|>{% else %}<|start_header_id|>{{ message.role }}" +
    "<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}{% endfor %}" +
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n" +
    "{% if enable_thinking is defined and enable_thinking %}<think>\n{% endif %}{% endif %}";
  writeFileSync(configPath, JSON.stringify(config));
}

// Prompts over 16 tokens are prefilled remotely, so the first token is
// sampled under the grammar on the prefill worker; random models love
// whitespace, so little of it keeps outputs inside max_tokens.
const upLog = path.join(dir, 'up.log');
up = spawn(bin, ['up', '--model', toolModel, '--dir', path.join(dir, 'up'), '--port', '0', '--control-port', '0',
  '--prefill-metrics-port', '0', '--decode-metrics-port', '0', '--max-local-prefill', '16', '--threads', '1',
  '--kv-cache-bytes', '16MiB', '--grammar-max-whitespace', '2', '--reasoning-parser', 'qwen3'],
{ stdio: ['ignore', openSync(upLog, 'w'), openSync(upLog, 'a')] });
const base = (await waitFor(() => {
  if (up.exitCode !== null) throw new Error(`pdserve up exited: ${readFileSync(upLog, 'utf8')}`);
  return readFileSync(upLog, 'utf8').match(/ready at (http:\/\/\S+)/);
}, 'pdserve up', 120000))[1];

const client = new OpenAI({ baseURL: `${base}/v1`, apiKey: 'unused', maxRetries: 0 });
const modelId = 'pdserve-tiny';

const Event = z.object({
  name: z.string().max(12),
  date: z.string().regex(/^2024-0[1-9]-[0-2][0-9]$/),
  attendees: z.array(z.string().max(8)).max(3),
  kind: z.enum(['meeting', 'party', 'talk']),
  seats: z.number().int().min(1).max(500),
  online: z.boolean(),
});

test('chat.completions.parse with a zod schema', async () => {
  for (const [temperature, seed] of [[0, 1], [1, 2], [1, 3]]) {
    const completion = await client.chat.completions.parse({
      model: modelId, temperature, seed, max_tokens: 500,
      messages: [{ role: 'user', content: 'Describe an event.' }],
      response_format: zodResponseFormat(Event, 'event'),
    });
    const message = completion.choices[0].message;
    assert.equal(completion.choices[0].finish_reason, 'stop');
    assert.ok(message.parsed, message.content);
    assert.deepEqual(Event.parse(JSON.parse(message.content)), message.parsed);
  }
});

test('chat.completions.stream with a zod schema', async () => {
  const stream = client.chat.completions.stream({
    model: modelId, temperature: 1, seed: 9, max_tokens: 500,
    messages: [{ role: 'user', content: 'Describe an event.' }],
    response_format: zodResponseFormat(Event, 'event'),
  });
  let chunks = 0;
  for await (const chunk of stream) chunks += chunk.choices.length;
  const final = await stream.finalChatCompletion();
  assert.ok(chunks > 2, `chunks: ${chunks}`);
  assert.equal(final.choices[0].finish_reason, 'stop');
  assert.ok(final.choices[0].message.parsed);
  Event.parse(final.choices[0].message.parsed);
});

const tools = [
  { type: 'function', function: { name: 'get_weather', description: 'Weather in a city.',
    parameters: { type: 'object', properties: { city: { type: 'string', maxLength: 12 },
      unit: { type: 'string', enum: ['celsius', 'fahrenheit'] } }, required: ['city'],
    additionalProperties: false } } },
  { type: 'function', function: { name: 'get_time', description: 'Time in a zone.',
    parameters: { type: 'object', properties: { zone: { type: 'string', enum: ['UTC', 'CET'] } },
      required: ['zone'], additionalProperties: false } } },
];
const Weather = z.object({ city: z.string().max(12), unit: z.enum(['celsius', 'fahrenheit']).optional() }).strict();
const Time = z.object({ zone: z.enum(['UTC', 'CET']) }).strict();
const question = [{ role: 'user', content: 'What is the weather in Paris?' }];

function checkCall(call) {
  assert.equal(call.type, 'function');
  assert.ok(call.id.length > 0);
  const args = JSON.parse(call.function.arguments);
  if (call.function.name === 'get_weather') Weather.parse(args);
  else if (call.function.name === 'get_time') Time.parse(args);
  else assert.fail(`unknown function ${call.function.name}`);
}

test('tool_choice required: every answer is a valid call; then the round trip', async () => {
  // One call without parallel_tool_calls: the grammar ends after it. With
  // them the (random) model may go on calling until max_tokens, and a turn
  // cut short says "length", its complete calls parsed all the same.
  for (const [temperature, seed, parallel] of [[0, 1, false], [1, 5, false], [1, 6, true]]) {
    const first = await client.chat.completions.create({ model: modelId, messages: question, tools,
      tool_choice: 'required', parallel_tool_calls: parallel, temperature, seed, max_tokens: 300 });
    const choice = first.choices[0];
    if (parallel && choice.finish_reason === 'length') {
      assert.equal(first.usage.completion_tokens, 300);
    } else {
      assert.equal(choice.finish_reason, 'tool_calls');
    }
    if (!parallel) assert.equal(choice.message.tool_calls.length, 1);
    assert.ok(choice.message.tool_calls.length >= 1);
    choice.message.tool_calls.forEach(checkCall);
    // The call and the tool's answer go back; the model answers (auto).
    const history = [...question, choice.message,
      ...choice.message.tool_calls.map((c) => ({ role: 'tool', tool_call_id: c.id, content: '{"temp": 21}' }))];
    const answer = await client.chat.completions.create({ model: modelId, messages: history, tools,
      tool_choice: 'auto', temperature, seed, max_tokens: 20 });
    assert.ok(['stop', 'length', 'tool_calls'].includes(answer.choices[0].finish_reason));
    assert.ok(answer.usage.prompt_tokens > first.usage.prompt_tokens, 'the history was rendered');
  }
});

test('tool_choice naming a function, parallel_tool_calls false; then the round trip', async () => {
  const r = await client.chat.completions.create({ model: modelId, messages: question, tools,
    tool_choice: { type: 'function', function: { name: 'get_time' } }, parallel_tool_calls: false,
    temperature: 1, seed: 3, max_tokens: 300 });
  const calls = r.choices[0].message.tool_calls;
  assert.equal(calls.length, 1);
  assert.equal(calls[0].function.name, 'get_time');
  checkCall(calls[0]);
  // The call and its answer go back; the next call is forced to the other function.
  const history = [...question, r.choices[0].message,
    { role: 'tool', tool_call_id: calls[0].id, content: '{"time": "12:00"}' }];
  const next = await client.chat.completions.create({ model: modelId, messages: history, tools,
    tool_choice: { type: 'function', function: { name: 'get_weather' } }, temperature: 1, seed: 4,
    max_tokens: 300 });
  // OpenAI ends a call it was told to make "stop" (a "required" one "tool_calls").
  assert.equal(r.choices[0].finish_reason, 'stop');
  assert.equal(next.choices[0].finish_reason, 'stop');
  // A named function is called once, parallel_tool_calls or not.
  assert.equal(next.choices[0].message.tool_calls.length, 1);
  assert.equal(next.choices[0].message.tool_calls[0].function.name, 'get_weather');
  next.choices[0].message.tool_calls.forEach(checkCall);
  assert.ok(next.usage.prompt_tokens > r.usage.prompt_tokens, 'the history was rendered');
});

test('a call cut off by max_tokens ends with length, not tool_calls', async () => {
  for (const stream of [false, true]) {
    const r = await client.chat.completions.create({ model: modelId, messages: question, tools,
      tool_choice: 'required', temperature: 0, max_tokens: 6, stream });
    let finish = null;
    if (stream) {
      for await (const chunk of r) finish = chunk.choices[0]?.finish_reason ?? finish;
    } else {
      finish = r.choices[0].finish_reason;
      assert.equal(r.choices[0].message.tool_calls ?? undefined, undefined);
    }
    assert.equal(finish, 'length');
  }
});

test('tool calls streamed as deltas', async () => {
  for (const [choice, ends] of [['required', 'tool_calls'],
    [{ type: 'function', function: { name: 'get_weather' } }, 'stop']]) {
  const stream = await client.chat.completions.create({ model: modelId, messages: question, tools,
    tool_choice: choice, parallel_tool_calls: false, temperature: 1, seed: 11, max_tokens: 300,
    stream: true });
  const calls = [];
  let finish = null;
  for await (const chunk of stream) {
    for (const d of chunk.choices[0]?.delta?.tool_calls ?? []) {
      calls[d.index] ??= { id: '', type: 'function', function: { name: '', arguments: '' } };
      if (d.id) calls[d.index].id = d.id;
      if (d.function?.name) calls[d.index].function.name += d.function.name;
      if (d.function?.arguments) calls[d.index].function.arguments += d.function.arguments;
    }
    finish = chunk.choices[0]?.finish_reason ?? finish;
  }
  assert.equal(finish, ends);
  assert.ok(calls.length >= 1);
  calls.forEach(checkCall);
  }
});

test('tool_choice none and auto answer with content', async () => {
  for (const tool_choice of ['none', 'auto']) {
    const r = await client.chat.completions.create({ model: modelId, messages: question, tools, tool_choice,
      temperature: 0, max_tokens: 16 });
    assert.equal(typeof r.choices[0].message.content, 'string');
  }
});

test('a function whose parameters the server cannot compile is a 400 naming it', async () => {
  const bad = [{ type: 'function', function: { name: 'f', parameters: { type: 'object',
    properties: { n: { type: 'integer', multipleOf: 3 } } } } }];
  await assert.rejects(client.chat.completions.create({ model: modelId, messages: question, tools: bad,
    tool_choice: 'required', max_tokens: 10 }), (e) => e.status === 400 &&
    /tools\[0\]\.function\.parameters.*multipleOf.*\/properties\/n/.test(e.message));
});

test('n: 3 gives three choices with their own seeds; the prompt counts once', async () => {
  const messages = [{ role: 'user', content: 'Tell me three different stories about a robot.' }];
  const one = await client.chat.completions.create({ model: modelId, messages, temperature: 1, seed: 7,
    max_tokens: 12, n: 1 });
  const three = await client.chat.completions.create({ model: modelId, messages, temperature: 1, seed: 7,
    max_tokens: 12, n: 3 });
  assert.deepEqual(three.choices.map((c) => c.index), [0, 1, 2]);
  assert.equal(three.choices[0].message.content, one.choices[0].message.content, 'choice 0 has the seed itself');
  assert.equal(new Set(three.choices.map((c) => c.message.content)).size, 3, 'seed + i differ');
  assert.equal(three.usage.prompt_tokens, one.usage.prompt_tokens);
  assert.equal(three.usage.completion_tokens,
    three.choices.length * one.usage.completion_tokens, 'every choice ran to max_tokens');
  // Streamed: deltas of every index, each finished once.
  const stream = await client.chat.completions.create({ model: modelId, messages, temperature: 1, seed: 7,
    max_tokens: 12, n: 3, stream: true, stream_options: { include_usage: true } });
  const text = ['', '', ''];
  const finished = [0, 0, 0];
  let usage = null;
  for await (const chunk of stream) {
    for (const c of chunk.choices) {
      text[c.index] += c.delta?.content ?? '';
      if (c.finish_reason) finished[c.index] += 1;
    }
    if (chunk.usage) usage = chunk.usage;
  }
  assert.deepEqual(finished, [1, 1, 1]);
  assert.deepEqual(text, three.choices.map((c) => c.message.content));
  assert.equal(usage.prompt_tokens, one.usage.prompt_tokens);
});

test('n: 3 under a schema, and best_of', async () => {
  const r = await client.chat.completions.parse({ model: modelId, temperature: 1, seed: 4, max_tokens: 500, n: 3,
    messages: [{ role: 'user', content: 'Describe an event.' }], response_format: zodResponseFormat(Event, 'event') });
  assert.equal(r.choices.length, 3);
  for (const c of r.choices) Event.parse(c.message.parsed);
  const best = await client.completions.create({ model: modelId, prompt: 'Once upon a time', temperature: 1,
    seed: 2, max_tokens: 8, n: 2, best_of: 4, logprobs: 0 });
  assert.deepEqual(best.choices.map((c) => c.index), [0, 1]);
  const sum = (c) => c.logprobs.token_logprobs.reduce((a, b) => a + b, 0);
  assert.ok(sum(best.choices[0]) >= sum(best.choices[1]), 'the most likely first');
  await assert.rejects(client.completions.create({ model: modelId, prompt: 'x', n: 2, best_of: 1 }),
    (e) => e.status === 400);
});

// The Responses API: the same template, tools and grammars as chat.
const responseTools = tools.map((t) => ({ type: 'function', ...t.function }));
// The text of a response's messages (the client adds output_text to some
// responses only).
const outputText = (r) => r.output.filter((o) => o.type === 'message').flatMap((o) => o.content)
  .filter((c) => c.type === 'output_text').map((c) => c.text).join('');

test('responses.create answers as chat does; streamed, the same response', async () => {
  const input = 'Tell me a story.';
  for (const seed of [1, 2]) {
    const sampling = { model: modelId, temperature: seed === 1 ? 0 : 1, seed };
    const chat = await client.chat.completions.create({ ...sampling, max_tokens: 12,
      messages: [{ role: 'system', content: 'Be brief.' }, { role: 'user', content: input }] });
    const params = { ...sampling, max_output_tokens: 12, instructions: 'Be brief.', input };
    const r = await client.responses.create(params);
    assert.equal(r.object, 'response');
    assert.ok(r.id.startsWith('resp_'), r.id);
    assert.equal(r.output_text, chat.choices[0].message.content);
    const cut = chat.choices[0].finish_reason === 'length';
    assert.equal(r.status, cut ? 'incomplete' : 'completed');
    assert.deepEqual(r.incomplete_details, cut ? { reason: 'max_output_tokens' } : null);
    assert.equal(r.usage.input_tokens, chat.usage.prompt_tokens);
    assert.equal(r.usage.output_tokens, chat.usage.completion_tokens);
    assert.equal(r.instructions, 'Be brief.');
    assert.equal(r.max_output_tokens, 12);
    // The client's stream helper rebuilds the response from the events.
    const stream = client.responses.stream(params);
    const types = [];
    let text = '';
    let last = -1;
    for await (const event of stream) {
      types.push(event.type);
      assert.ok(event.sequence_number > last, `${event.type} after ${last}`);
      last = event.sequence_number;
      if (event.type === 'response.output_text.delta') text += event.delta;
    }
    const final = await stream.finalResponse();
    assert.equal(text, r.output_text);
    assert.equal(outputText(final), r.output_text);
    assert.equal(outputText(r), r.output_text);
    assert.deepEqual(types.slice(0, 4), ['response.created', 'response.in_progress',
      'response.output_item.added', 'response.content_part.added']);
    assert.deepEqual(types.slice(-4), ['response.output_text.done', 'response.content_part.done',
      'response.output_item.done', cut ? 'response.incomplete' : 'response.completed']);
  }
});

test('responses.parse with a zod text format', async () => {
  for (const stream of [false, true]) {
    const params = { model: modelId, temperature: 1, seed: 2, max_output_tokens: 500,
      input: [{ role: 'user', content: 'Describe an event.' }], text: { format: zodTextFormat(Event, 'event') } };
    const r = stream ? await client.responses.stream(params).finalResponse() : await client.responses.parse(params);
    assert.equal(r.status, 'completed');
    assert.deepEqual(Event.parse(JSON.parse(r.output_text)), r.output_parsed);
  }
});

test('responses with function tools: a forced call, then its output as input', async () => {
  for (const stream of [false, true]) {
    const params = { model: modelId, input: question, tools: responseTools, tool_choice: 'required',
      parallel_tool_calls: false, temperature: 1, seed: 5, max_output_tokens: 300 };
    const r = stream ? await client.responses.stream(params).finalResponse() : await client.responses.create(params);
    assert.equal(r.status, 'completed');
    const calls = r.output.filter((o) => o.type === 'function_call');
    assert.equal(calls.length, 1);
    checkCall({ type: 'function', id: calls[0].call_id,
      function: { name: calls[0].name, arguments: calls[0].arguments } });
    // The call and the tool's answer go back as items; the model answers.
    const next = await client.responses.create({ model: modelId, tools: responseTools, temperature: 0,
      max_output_tokens: 16, input: [...question, ...r.output,
        { type: 'function_call_output', call_id: calls[0].call_id, output: '{"temp": 21}' }] });
    assert.ok(next.usage.input_tokens > r.usage.input_tokens, 'the history was rendered');
    // A named function.
    const named = await client.responses.create({ ...params, tool_choice: { type: 'function', name: 'get_time' } });
    const call = named.output.find((o) => o.type === 'function_call');
    assert.equal(call.name, 'get_time');
    Time.parse(JSON.parse(call.arguments));
  }
});

test('responses streamed with tools and logprobs: the items of the unstreamed answer', async () => {
  for (const tool_choice of ['required', 'auto']) {
    const params = { model: modelId, input: question, tools: responseTools, tool_choice,
      parallel_tool_calls: false, temperature: 1, seed: 8, max_output_tokens: 300,
      include: ['message.output_text.logprobs'], top_logprobs: 2 };
    const once = await client.responses.create(params);
    const streamed = await client.responses.stream(params).finalResponse();
    assert.deepEqual(streamed.output.map((o) => o.type), once.output.map((o) => o.type), tool_choice);
    assert.equal(outputText(streamed), outputText(once));
    for (const o of streamed.output.filter((x) => x.type === 'message')) {
      for (const lp of o.content[0].logprobs) assert.ok(lp.top_logprobs.length <= 2);
    }
    // The streamed output goes back as input as it came.
    const next = await client.responses.create({ model: modelId, tools: responseTools, temperature: 0,
      max_output_tokens: 8, input: [...question, ...streamed.output,
        ...streamed.output.filter((o) => o.type === 'function_call')
          .map((c) => ({ type: 'function_call_output', call_id: c.call_id, output: 'ok' }))] });
    assert.ok(next.usage.input_tokens > once.usage.input_tokens);
  }
});

test('responses: what needs a stored response or a hosted tool is a 400 naming the field', async () => {
  const refused = async (extra, param) => assert.rejects(
    client.responses.create({ model: modelId, input: 'x', max_output_tokens: 4, ...extra }),
    (e) => e.status === 400 && e.param === param);
  await refused({ previous_response_id: 'resp_1' }, 'previous_response_id');
  await refused({ tools: [{ type: 'web_search' }] }, 'tools[0].type');
  await refused({ input: [{ role: 'user', content: [{ type: 'input_image', image_url: 'x' }] }] },
    'input[0].content[0].type');
  await refused({ max_output_tokens: 0 }, 'max_output_tokens');
  await assert.rejects(client.responses.retrieve('resp_1'), (e) => e.status === 404);
});

// --reasoning-parser qwen3: the template opens a thought when asked to
// reason (reasoning_effort sets enable_thinking), so the output is
// thoughts; the tiny model never closes them, so all of it is reasoning,
// and it is what the same prompt's tokens complete to.
test('reasoning: thoughts come apart from the answer on chat and responses, streamed and not', async () => {
  const messages = [{ role: 'user', content: 'Think of a story.' }];
  const sampling = { model: modelId, temperature: 0, max_tokens: 10 };
  const chat = await client.chat.completions.create({ ...sampling, messages, reasoning_effort: 'high' });
  const message = chat.choices[0].message;
  const rendered = await (await fetch(`${base}/tokenize`, { method: 'POST',
    headers: { 'content-type': 'application/json' },
    body: JSON.stringify({ model: modelId, messages, chat_template_kwargs: { enable_thinking: true } }) })).json();
  const completion = await client.completions.create({ ...sampling, prompt: rendered.tokens });
  const text = completion.choices[0].text;
  assert.ok(text.length > 0, 'the reference completion is empty');
  assert.equal(message.reasoning, text);
  assert.equal(message.reasoning_content, text);
  assert.equal(message.content, null);
  // Every token was thought.
  assert.equal(chat.usage.completion_tokens_details.reasoning_tokens, chat.usage.completion_tokens);

  const stream = await client.chat.completions.create({ ...sampling, messages, reasoning_effort: 'high',
    stream: true, stream_options: { include_usage: true } });
  let reasoning = '';
  let content = '';
  let usage = null;
  for await (const chunk of stream) {
    const delta = chunk.choices[0]?.delta ?? {};
    reasoning += delta.reasoning ?? '';
    content += delta.content ?? '';
    if (chunk.usage) usage = chunk.usage;
  }
  assert.equal(reasoning, text);
  assert.equal(content, '');
  assert.deepEqual(usage.completion_tokens_details, chat.usage.completion_tokens_details);

  const params = { model: modelId, temperature: 0, max_output_tokens: 10, input: messages, reasoning: { effort: 'high' } };
  const once = await client.responses.create(params);
  const streamed = await client.responses.stream(params).finalResponse();
  for (const r of [once, streamed]) {
    assert.equal(r.output[0].type, 'reasoning', JSON.stringify(r.output));
    assert.equal(r.output[0].content[0].type, 'reasoning_text');
    assert.equal(r.output[0].content[0].text, text);
  }
  // (The stream helper keeps a response.incomplete's usage out of its final
  // response: the unstreamed one carries it.)
  assert.equal(once.usage.output_tokens_details.reasoning_tokens, once.usage.output_tokens);

  // Not asked to reason: the answer, and no thoughts.
  const plain = await client.chat.completions.create({ ...sampling, messages });
  assert.equal(plain.choices[0].message.reasoning, undefined);
  assert.equal(typeof plain.choices[0].message.content, 'string');
  assert.equal(plain.usage.completion_tokens_details.reasoning_tokens, 0);
});
