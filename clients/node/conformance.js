#!/usr/bin/env node
'use strict';
/**
 * Conformance checks of a running Tandem frontend, driven from Node.js with @grpc/grpc-js.
 *
 *   node clients/node/conformance.js 127.0.0.1:50051
 *
 * Prints one JSON line per check ({"check", "ok", "ms", ...}) and exits 1 if any check fails,
 * 2 on bad usage. Every check is independent (none reuses another's result) and bounded in time.
 * The server must be otherwise idle: the cancel check waits for zero in-flight work.
 */

const assert = require('assert/strict');
const { TandemClient, grpc } = require('./tandem_client');

const CHECK_TIMEOUT_MS = 60000; // per check; CPU CI machines are slow and shared
const IDLE_TIMEOUT_MS = 15000; // how long freed resources may take to show in STATS
const POLL_INTERVAL_MS = 50;

const CAPITAL_QUESTION = [{ role: 'user', content: 'What is the capital of France?' }];
// Open-ended, so that sampling at temperature 1 and greedy decoding part ways quickly.
const STORY_PROMPT = 'Once upon a time, in a village at the edge of a forest,';
const LONG_PROMPT = 'Count from one to one thousand:';

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));
const statusName = (code) => Object.keys(grpc.status).find((k) => grpc.status[k] === code) || String(code);

/** Runs `promise` but rejects once `ms` have passed, so no check can hang the script. */
function withTimeout(promise, ms, what) {
  let timer;
  const timeout = new Promise((_, reject) => {
    timer = setTimeout(() => reject(new Error(`${what}: no result after ${ms} ms`)), ms);
  });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** Awaits a call that must fail and asserts its gRPC status code; returns the error. */
async function expectStatus(promise, code) {
  let err = null;
  try {
    await promise;
  } catch (e) {
    err = e;
  }
  assert.ok(err, `expected ${statusName(code)}, but the call succeeded`);
  assert.equal(statusName(err.code), statusName(code), `unexpected status: ${err.details || err.message}`);
  return err;
}

/** Collects a whole stream: concatenated text and token ids of choice 0, and the last message. */
async function collectStream(client, request) {
  const messages = [];
  const call = client.stream(request, (msg) => messages.push(msg));
  await call.done;
  assert.ok(messages.length > 0, 'the stream sent no message');
  const choices = messages.flatMap((m) => m.choices).filter((c) => c.index === 0);
  return {
    text: choices.map((c) => c.text).join(''),
    tokenIds: choices.flatMap((c) => c.token_ids),
    last: messages[messages.length - 1],
    count: messages.length,
  };
}

/** True when STATS shows no request anywhere: frontend in_flight 0, each engine idle with no KV. */
function isIdle(stats) {
  const engines = Object.values(stats.engines || {});
  return (
    stats.frontend != null &&
    stats.frontend.in_flight === 0 &&
    engines.length > 0 &&
    engines.every((e) => e.num_running === 0 && e.kv_blocks_used === 0)
  );
}

/** Polls Utility STATS until idle; bounded by time and by count. Returns the idle stats. */
async function waitIdle(client) {
  const maxPolls = Math.ceil(IDLE_TIMEOUT_MS / POLL_INTERVAL_MS);
  let stats = null;
  for (let i = 0; i < maxPolls; i++) {
    stats = await client.utility('stats', { deadlineMs: 5000 });
    if (isIdle(stats)) return { stats, polls: i + 1 };
    await sleep(POLL_INTERVAL_MS);
  }
  throw new Error(`resources not released within ${IDLE_TIMEOUT_MS} ms: ${JSON.stringify(stats)}`);
}

/**
 * Field numbers present in the SamplingParams of a serialized GenerateRequest, read straight
 * from the wire bytes (a minimal protobuf walk), so presence is checked on what is really sent.
 */
function sentSamplingFields(bytes) {
  function readVarint(buf, pos) {
    let value = 0;
    let shift = 0;
    for (;;) {
      const b = buf[pos++];
      value += (b & 0x7f) * 2 ** shift;
      if (b < 0x80) return [value, pos];
      shift += 7;
    }
  }
  function fields(buf) {
    const out = new Map();
    let pos = 0;
    while (pos < buf.length) {
      let key;
      [key, pos] = readVarint(buf, pos);
      const number = Math.floor(key / 8);
      const wireType = key % 8;
      let value;
      if (wireType === 0) {
        [value, pos] = readVarint(buf, pos);
      } else if (wireType === 1 || wireType === 5) {
        const size = wireType === 1 ? 8 : 4;
        value = buf.subarray(pos, pos + size);
        pos += size;
      } else if (wireType === 2) {
        let len;
        [len, pos] = readVarint(buf, pos);
        value = buf.subarray(pos, pos + len);
        pos += len;
      } else {
        throw new Error(`unexpected wire type ${wireType}`);
      }
      out.set(number, value);
    }
    return out;
  }
  const SAMPLING = 5; // GenerateRequest.sampling
  const top = fields(bytes);
  return top.has(SAMPLING) ? fields(top.get(SAMPLING)) : new Map();
}

// -- the checks --------------------------------------------------------------------------------------

const CHECKS = {
  /** (1) Unary chat Generate: a known answer and self-consistent usage. */
  async generate(client) {
    const reply = await client.generate({ messages: CAPITAL_QUESTION, sampling: { max_tokens: 16, temperature: 0 } });
    assert.equal(reply.choices.length, 1, 'one choice expected');
    const choice = reply.choices[0];
    assert.match(choice.text, /Paris/, `answer without "Paris": ${JSON.stringify(choice.text)}`);
    assert.notEqual(choice.finish_reason, 'FINISH_REASON_UNSPECIFIED', 'finish_reason missing');
    const u = reply.usage;
    assert.ok(u, 'usage missing');
    assert.equal(u.completion_tokens, choice.token_ids.length, 'completion_tokens != number of token_ids');
    assert.ok(u.completion_tokens >= 1 && u.completion_tokens <= 16, `completion_tokens ${u.completion_tokens}`);
    assert.ok(u.prompt_tokens > 0, 'prompt_tokens must be > 0');
    assert.equal(u.total_tokens, u.prompt_tokens + u.completion_tokens, 'total != prompt + completion');
    return { text: choice.text, finish_reason: choice.finish_reason, usage: u };
  },

  /** (2) Greedy Stream: the deltas add up to the Generate answer; the last message has usage. */
  async stream(client) {
    const request = { messages: CAPITAL_QUESTION, sampling: { max_tokens: 16, temperature: 0 } };
    const whole = (await client.generate(request)).choices[0];
    const streamed = await collectStream(client, request);
    assert.equal(streamed.text, whole.text, 'streamed text differs from Generate');
    assert.deepEqual(streamed.tokenIds, whole.token_ids, 'streamed token ids differ from Generate');
    const u = streamed.last.usage;
    assert.ok(u, 'the last stream message carries no usage');
    assert.equal(u.completion_tokens, streamed.tokenIds.length, 'usage.completion_tokens != streamed tokens');
    const final = streamed.last.choices.find((c) => c.index === 0);
    assert.ok(final && final.finish_reason !== 'FINISH_REASON_UNSPECIFIED', 'last message has no finish_reason');
    return { messages: streamed.count, text: streamed.text };
  },

  /** (3) A 300 ms deadline on a long generation ends in DEADLINE_EXCEEDED. */
  async deadline(client) {
    const started = Date.now();
    await expectStatus(
      client.generate({ prompt: LONG_PROMPT, sampling: { max_tokens: 400, ignore_eos: true } }, { deadlineMs: 300 }),
      grpc.status.DEADLINE_EXCEEDED,
    );
    return { after_ms: Date.now() - started };
  },

  /** (4) Cancelling a stream after its first message ends it CANCELLED and frees everything. */
  async cancel(client) {
    await waitIdle(client); // a clean start, so "idle afterwards" means this request was freed
    let received = 0;
    let firstMessage;
    const first = new Promise((resolve) => {
      firstMessage = resolve;
    });
    const call = client.stream({ prompt: LONG_PROMPT, sampling: { max_tokens: 400, ignore_eos: true } }, () => {
      received += 1;
      if (received === 1) firstMessage();
    });
    await Promise.race([first, call.done]);
    assert.ok(received >= 1, 'the stream ended before its first message');
    // Still generating at this point: the idle state polled below is the effect of the cancel.
    const busy = await client.utility('stats', { deadlineMs: 5000 });
    assert.ok(busy.frontend.in_flight >= 1, `request not in flight before the cancel: ${JSON.stringify(busy)}`);
    call.cancel();
    await expectStatus(call.done, grpc.status.CANCELLED);
    const { stats, polls } = await waitIdle(client);
    return { messages_before_cancel: received, polls, engines: Object.keys(stats.engines).length };
  },

  /** (5) A negative temperature is refused with INVALID_ARGUMENT naming the field. */
  async invalid_argument(client) {
    const err = await expectStatus(
      client.generate({ prompt: 'Hi', sampling: { max_tokens: 4, temperature: -1 } }),
      grpc.status.INVALID_ARGUMENT,
    );
    assert.match(err.details, /temperature/, `message does not name the field: ${err.details}`);
    return { details: err.details };
  },

  /**
   * (6) proto3 `optional` presence from JavaScript: an unset temperature is not sent, so the
   * server applies the model's default (GetModelInfo's `sampling_defaults`); an explicit 0
   * is sent (greedy). Holds whatever the server's defaults are: with sampling defaults the unset
   * request must sample, with greedy defaults it must decode greedily.
   */
  async optional_presence(client) {
    const base = { prompt: STORY_PROMPT };
    // On the wire: SamplingParams.temperature is field 2.
    const unsetWire = sentSamplingFields(client.serializeRequest({ ...base, sampling: { max_tokens: 16, seed: 5 } }));
    assert.ok(!unsetWire.has(2), 'an unset temperature was put on the wire');
    const zeroWire = sentSamplingFields(client.serializeRequest({ ...base, sampling: { max_tokens: 16, temperature: 0 } }));
    assert.ok(zeroWire.has(2), 'an explicit temperature 0 was not put on the wire');

    const text = async (sampling) => (await client.generate({ ...base, sampling: { max_tokens: 16, ...sampling } })).choices[0].text;
    const seededA = await text({ seed: 5 });
    const seededB = await text({ seed: 5 });
    // top_k 1 is greedy by definition, independently of how temperature is encoded.
    const greedy = await text({ top_k: 1 });
    const zero = await text({ temperature: 0 });
    assert.equal(seededA, seededB, 'same seed, unset temperature: texts differ');
    assert.equal(zero, greedy, 'explicit temperature 0 is not greedy (was the zero dropped?)');
    const defaults = (await client.getModelInfo({ deadlineMs: 5000 })).sampling_defaults;
    assert.ok(defaults, 'GetModelInfo carries no sampling_defaults');
    const greedyDefaults = defaults.temperature === 0 || defaults.top_k === 1;
    if (greedyDefaults) {
      assert.equal(seededA, greedy, 'greedy defaults, unset temperature: not decoded greedily');
    } else {
      assert.notEqual(seededA, greedy, 'unset temperature decoded greedily (was it sent as 0?)');
    }
    return { seeded: seededA, greedy, greedy_defaults: greedyDefaults };
  },

  /**
   * (7) The typed control plane: integers arrive as integers, GetLoads answers per replica, and
   * Tokenize / Detokenize run no generation (the engines' finished-request counters stay put).
   */
  async control_plane(client) {
    const info = await client.getModelInfo({ deadlineMs: 5000 });
    assert.ok(Number.isInteger(info.max_context_length) && info.max_context_length > 0,
      `max_context_length is not a positive integer: ${JSON.stringify(info.max_context_length)}`);
    assert.ok(Number.isInteger(info.vocab_size) && info.vocab_size > 0, 'vocab_size is not an integer');
    assert.ok(info.eos_token_ids.length >= 1 && info.eos_token_ids.every(Number.isInteger), 'eos_token_ids');
    assert.ok(info.served_model_name, 'served_model_name missing');
    const server = await client.getServerInfo({ deadlineMs: 5000 });
    assert.ok(server.version && server.ready, `server info: ${JSON.stringify(server)}`);
    assert.ok(server.engines.length >= 1, 'no engine replica listed');
    const loads = await client.getLoads({ deadlineMs: 5000 });
    assert.equal(loads.replicas.length, server.engines.length, 'one load per engine replica');
    for (const r of loads.replicas) {
      assert.equal(r.error, '', `replica ${r.address} did not answer: ${r.error}`);
      assert.ok(Number.isInteger(r.num_running) && Number.isInteger(r.num_waiting), 'counts are not integers');
      assert.ok(Number.isInteger(r.kv_blocks_total) && r.kv_blocks_total > 0, 'kv_blocks_total');
      assert.ok(r.kv_usage >= 0 && r.kv_usage <= 1, `kv_usage ${r.kv_usage}`);
    }
    const finished = async () => Object.values((await client.utility('stats', { deadlineMs: 5000 })).engines)
      .reduce((sum, e) => sum + e.finished_requests_total, 0);
    await waitIdle(client); // earlier checks' requests have ended and are counted
    const before = await finished();
    const tok = await client.tokenize({ messages: CAPITAL_QUESTION });
    assert.ok(tok.count === tok.token_ids.length && tok.count > 0, 'token count');
    assert.equal(tok.max_context_length, info.max_context_length, 'max_context_length differs');
    const plain = await client.tokenize({ prompt: 'The capital of France' });
    const back = await client.detokenize({ token_ids: plain.token_ids });
    assert.equal(back.text, 'The capital of France', 'Detokenize(Tokenize(text)) is not the text');
    assert.equal(await finished(), before, 'Tokenize or Detokenize ran a generation');
    return { max_context_length: info.max_context_length, replicas: loads.replicas.length, chat_tokens: tok.count };
  },

  /**
   * (8) Structured output through the `structured_output` oneof: sampled answers (temperature 1)
   * are JSON that fits the schema; a regex that does not compile is INVALID_ARGUMENT naming it.
   */
  async structured_output(client) {
    const schema = {
      type: 'object',
      properties: { color: { enum: ['red', 'green', 'blue'] }, n: { type: 'integer', minimum: 0, maximum: 99 } },
      required: ['color', 'n'],
      additionalProperties: false,
    };
    const reply = await client.generate({
      messages: [{ role: 'user', content: 'A color and a number, as JSON.' }],
      n: 4,
      sampling: { max_tokens: 30, temperature: 1, seed: 3, json_schema: JSON.stringify(schema) },
    });
    for (const c of reply.choices) {
      const value = JSON.parse(c.text);
      assert.deepEqual(Object.keys(value).sort(), ['color', 'n'], `keys of ${c.text}`);
      assert.ok(['red', 'green', 'blue'].includes(value.color), `color of ${c.text}`);
      assert.ok(Number.isInteger(value.n) && value.n >= 0 && value.n <= 99, `n of ${c.text}`);
    }
    const err = await expectStatus(
      client.generate({ prompt: 'Hi', sampling: { max_tokens: 4, regex: 'a(b' } }),
      grpc.status.INVALID_ARGUMENT,
    );
    assert.match(err.details, /structured_output\.regex/, `message does not name the field: ${err.details}`);
    return { answers: reply.choices.map((c) => c.text) };
  },
};

async function main(argv) {
  const address = argv[2];
  if (!address || address.startsWith('-')) {
    process.stderr.write('usage: node conformance.js HOST:PORT\n');
    return 2;
  }
  const client = new TandemClient(address);
  let failed = 0;
  try {
    for (const [name, check] of Object.entries(CHECKS)) {
      const started = Date.now();
      let line;
      try {
        const detail = await withTimeout(check(client), CHECK_TIMEOUT_MS, name);
        line = { check: name, ok: true, ms: Date.now() - started, detail };
      } catch (err) {
        failed += 1;
        const error = err.code !== undefined ? `${statusName(err.code)}: ${err.details}` : String(err.message || err);
        line = { check: name, ok: false, ms: Date.now() - started, error };
      }
      process.stdout.write(`${JSON.stringify(line)}\n`);
    }
  } finally {
    client.close();
  }
  process.stdout.write(`${JSON.stringify({ summary: { passed: Object.keys(CHECKS).length - failed, failed } })}\n`);
  return failed ? 1 : 0;
}

if (require.main === module) {
  main(process.argv).then(
    (code) => process.exit(code),
    (err) => {
      process.stderr.write(`${err.stack || err}\n`);
      process.exit(1);
    },
  );
}

module.exports = { CHECKS, sentSamplingFields, isIdle };
