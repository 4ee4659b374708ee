'use strict';
/**
 * A small Node.js client for the public `tandem.v1.Frontend` service.
 *
 *   const { TandemClient } = require('./tandem_client');
 *   const client = new TandemClient('127.0.0.1:50051');
 *   const reply = await client.generate({
 *     messages: [{ role: 'user', content: 'What is the capital of France?' }],
 *     sampling: { max_tokens: 16, temperature: 0 },
 *   });
 *   console.log(reply.choices[0].text);
 *
 * The contract is loaded at run time from the repository's own `protos/` folder, so this client
 * never drifts from the server's `.proto` files. Field names are the proto names (snake_case).
 *
 * Optional fields: every SamplingParams scalar is proto3 `optional`. Leave a field out of the
 * object (or set it to undefined/null) to leave it unset; set it to 0 to send an explicit zero.
 * The two are different requests (unset temperature = 1.0, temperature 0 = greedy).
 */

const path = require('path');
const grpc = require('@grpc/grpc-js');
const protoLoader = require('@grpc/proto-loader');

/** Where the repository keeps its `.proto` files, relative to this file. */
const DEFAULT_PROTO_ROOT = path.resolve(__dirname, '..', '..', 'protos');

/**
 * The folder that holds protobufjs's bundled `google/protobuf/*.proto` files. protobufjs is
 * resolved from proto-loader's own location, not ours, so the lookup does not rely on npm
 * hoisting a transitive dependency. (struct.proto itself is also compiled into protobufjs.)
 */
function bundledProtoIncludeDir() {
  const fromLoader = { paths: [path.dirname(require.resolve('@grpc/proto-loader'))] };
  return path.dirname(require.resolve('protobufjs/package.json', fromLoader));
}

/** Options shared by every load: proto names, 64-bit integers as Numbers, oneof markers. */
const LOADER_OPTIONS = Object.freeze({
  keepCase: true,
  longs: Number,
  enums: String,
  defaults: true,
  oneofs: true,
});

/**
 * Loads `tandem/v1/frontend.proto` (and its imports) into a gRPC package definition.
 * @param {string} [protoRoot] the folder that contains `tandem/v1/`.
 */
function loadFrontendPackage(protoRoot = DEFAULT_PROTO_ROOT) {
  const definition = protoLoader.loadSync('tandem/v1/frontend.proto', {
    ...LOADER_OPTIONS,
    includeDirs: [protoRoot, bundledProtoIncludeDir()],
  });
  return grpc.loadPackageDefinition(definition);
}

// -- google.protobuf.Struct <-> plain JavaScript ----------------------------------------------------

/** Converts a decoded google.protobuf.Value (with `oneofs: true`) to a plain JS value. */
function valueToJs(value) {
  if (value == null) return null;
  switch (value.kind) {
    case 'nullValue':
      return null;
    case 'numberValue':
      return value.numberValue;
    case 'stringValue':
      return value.stringValue;
    case 'boolValue':
      return value.boolValue;
    case 'structValue':
      return structToObject(value.structValue);
    case 'listValue':
      return (value.listValue.values || []).map(valueToJs);
    default:
      // No kind set: the protobuf JSON mapping treats an empty Value as null.
      return null;
  }
}

/** Converts a decoded google.protobuf.Struct to a plain JS object. */
function structToObject(struct) {
  const out = {};
  if (struct == null || struct.fields == null) return out;
  for (const [key, value] of Object.entries(struct.fields)) {
    out[key] = valueToJs(value);
  }
  return out;
}

/** Converts a plain JS value to a google.protobuf.Value object for serialization. */
function jsToValue(value) {
  if (value === null || value === undefined) return { nullValue: 'NULL_VALUE' };
  if (typeof value === 'number') return { numberValue: value };
  if (typeof value === 'string') return { stringValue: value };
  if (typeof value === 'boolean') return { boolValue: value };
  if (Array.isArray(value)) return { listValue: { values: value.map(jsToValue) } };
  if (typeof value === 'object') return { structValue: objectToStruct(value) };
  throw new TypeError(`cannot encode ${typeof value} in a google.protobuf.Struct`);
}

/** Converts a plain JS object to a google.protobuf.Struct object for serialization. */
function objectToStruct(obj) {
  const fields = {};
  for (const [key, value] of Object.entries(obj || {})) fields[key] = jsToValue(value);
  return { fields };
}

// -- the client ---------------------------------------------------------------------------------------

/** Accepts 'stats', 'STATS' or 'UTILITY_COMMAND_STATS' and returns the enum name. */
function utilityCommandName(command) {
  const upper = String(command).toUpperCase();
  return upper.startsWith('UTILITY_COMMAND_') ? upper : `UTILITY_COMMAND_${upper}`;
}

/** grpc-js call options for an optional deadline in milliseconds from now. */
function callOptions(deadlineMs) {
  return deadlineMs == null ? {} : { deadline: new Date(Date.now() + deadlineMs) };
}

/** Call metadata: `authorization: Bearer <token>` when the server was started with a token. */
function callMetadata(token) {
  const metadata = new grpc.Metadata();
  if (token) metadata.set('authorization', `Bearer ${token}`);
  return metadata;
}

/**
 * Promise-based client for one frontend address. Errors are grpc-js ServiceErrors: compare
 * `err.code` with `grpc.status.*`; `err.details` is the server's message.
 */
class TandemClient {
  /**
   * @param {string} address host:port of a Tandem frontend.
   * @param {object} [opts]
   * @param {grpc.ChannelCredentials} [opts.credentials] default: insecure
   *   (e.g. `grpc.credentials.createSsl(caPem)` for a frontend started with TLS).
   * @param {string} [opts.token] bearer token, for a frontend that requires one.
   * @param {string} [opts.protoRoot] folder that contains `tandem/v1/*.proto`.
   */
  constructor(address, { credentials, token, protoRoot } = {}) {
    const pkg = loadFrontendPackage(protoRoot);
    this.token = token;
    this.Frontend = pkg.tandem.v1.Frontend;
    this.stub = new this.Frontend(address, credentials || grpc.credentials.createInsecure(), {
      // Long generations with logprobs can exceed the 4 MiB default.
      'grpc.max_receive_message_length': 64 * 1024 * 1024,
    });
  }

  /** Bytes of a GenerateRequest exactly as this client puts them on the wire. */
  serializeRequest(request) {
    return this.Frontend.service.Generate.requestSerialize(request);
  }

  /**
   * Unary Generate.
   * @param {object} request a GenerateRequest object (proto field names).
   * @param {{deadlineMs?: number}} [opts]
   * @returns {Promise<object>} the GenerateResponse.
   */
  generate(request, { deadlineMs } = {}) {
    return new Promise((resolve, reject) => {
      this.stub.Generate(request, callMetadata(this.token), callOptions(deadlineMs), (err, reply) =>
        err ? reject(err) : resolve(reply),
      );
    });
  }

  /**
   * Server-streaming Generate. `onMessage` gets each GenerateStreamResponse. Returns the grpc-js
   * call (`call.cancel()` aborts the request on the server) with `call.done`, a Promise that
   * resolves with the final status when the stream ends OK and rejects with the ServiceError
   * otherwise (CANCELLED after `call.cancel()`).
   * @param {object} request a GenerateRequest object.
   * @param {(msg: object) => void} onMessage
   * @param {{deadlineMs?: number}} [opts]
   */
  stream(request, onMessage, { deadlineMs } = {}) {
    const call = this.stub.Stream(request, callMetadata(this.token), callOptions(deadlineMs));
    call.on('data', onMessage);
    call.done = new Promise((resolve, reject) => {
      call.on('error', reject);
      call.on('status', (status) => {
        if (status.code === grpc.status.OK) resolve(status);
      });
    });
    // The 'error' listener above keeps an unobserved failure from crashing the process; this
    // keeps an un-awaited `done` from becoming an unhandled rejection. Awaiting it still throws.
    call.done.catch(() => {});
    return call;
  }

  /**
   * Utility call. Returns the decoded result Struct as a plain object.
   * @param {string} command e.g. 'stats', 'health', 'abort', 'flush_prefix_cache'.
   * @param {{requestId?: string, args?: object, deadlineMs?: number}} [opts]
   */
  utility(command, { requestId, args, deadlineMs } = {}) {
    const request = { command: utilityCommandName(command) };
    if (requestId != null) request.request_id = requestId;
    if (args != null) request.args = objectToStruct(args);
    return new Promise((resolve, reject) => {
      this.stub.Utility(request, callMetadata(this.token), callOptions(deadlineMs), (err, reply) =>
        err ? reject(err) : resolve(structToObject(reply.result)),
      );
    });
  }

  /** One unary call of `method` on the Frontend service, as a Promise of its reply. */
  unary(method, request = {}, { deadlineMs } = {}) {
    return new Promise((resolve, reject) => {
      this.stub[method](request, callMetadata(this.token), callOptions(deadlineMs), (err, reply) =>
        err ? reject(err) : resolve(reply),
      );
    });
  }

  // The typed control plane: int64 fields arrive as Numbers (integers), never as doubles of a Struct.

  /** GetModelInfo: served_model_name, max_context_length, vocab_size, eos_token_ids, sampling_defaults, ... */
  getModelInfo(opts) {
    return this.unary('GetModelInfo', {}, opts);
  }

  /** GetServerInfo: version, disaggregated, engine_transport, engines [{address, role, ready, kv_role}], ready. */
  getServerInfo(opts) {
    return this.unary('GetServerInfo', {}, opts);
  }

  /** GetLoads: replicas [{address, role, num_running, num_waiting, kv_usage, in_flight, ...}]. */
  getLoads(opts) {
    return this.unary('GetLoads', {}, opts);
  }

  /**
   * Tokenize (no generation): `{prompt}` or `{messages, add_generation_prompt?}`, optional `model`.
   * @returns {Promise<{token_ids: number[], count: number, max_context_length: number}>}
   */
  tokenize(request, opts) {
    return this.unary('Tokenize', request, opts);
  }

  /** Detokenize: `{token_ids, skip_special_tokens?}` -> `{text}`. */
  detokenize(request, opts) {
    return this.unary('Detokenize', request, opts);
  }

  /** Closes the channel. */
  close() {
    this.stub.close();
  }
}

module.exports = {
  TandemClient,
  loadFrontendPackage,
  structToObject,
  objectToStruct,
  grpc,
};
