#!/usr/bin/env node
// The llama.cpp anchor's raw next-token logits at every position of a
// tokenized text (teacher forcing), for comparing engines on one GGUF file.
//
//   NODE_LLAMA_CPP_DIR=~/.cache/kiln/nlc node bench/llamacpp_logits.mjs \
//       --model M.gguf --text-file T.txt --out logits.f32 [--threads 2]
//
// Prints one JSON line: {"tokens": [...ids llama.cpp's tokenizer gives,
// BOS included when the file asks for it], "vocab": N}. Writes the logits
// as little-endian float32, [tokens, vocab], row i = after token i.
import fs from "node:fs";
import path from "node:path";
import {pathToFileURL} from "node:url";

const args = {threads: 2};
for (let i = 2; i < process.argv.length; i += 2) {
    const k = process.argv[i].replace(/^--/, "").replace(/-([a-z])/g, (_, c) => c.toUpperCase());
    args[k] = process.argv[i + 1];
}
const nlcDir = process.env.NODE_LLAMA_CPP_DIR ?? path.join(process.env.HOME, ".cache/kiln/nlc");
const nlc = await import(pathToFileURL(path.join(nlcDir, "node_modules", "node-llama-cpp", "dist", "index.js")).href);
const llama = await nlc.getLlama({gpu: false, build: "never", usePrebuiltBinaries: true, skipDownload: true,
    progressLogs: false, maxThreads: Number(args.threads), logLevel: nlc.LlamaLogLevel.error});
const model = await llama.loadModel({modelPath: args.model, gpuLayers: 0});
const ctx = await model.createContext({contextSize: 2048, threads: {ideal: Number(args.threads), min: 1}, sequences: 1});
const seq = ctx.getSequence();
const text = fs.readFileSync(args.textFile, "utf8");
const bos = model.fileInfo.metadata?.tokenizer?.ggml?.add_bos_token && model.tokens.bos != null ? [model.tokens.bos] : [];
const tokens = [...bos, ...model.tokenize(text, false)];
const vocab = model.fileInfo.metadata.tokenizer.ggml.tokens.length;
const input = tokens.map((t) => [t, {generateNext: {logits: true}}]);
const res = await seq.controlledEvaluate(input);
const out = new Float32Array(tokens.length * vocab);
res.forEach((r, i) => {
    for (const [t, l] of r.next.logits) out[i * vocab + t] = l;
});
fs.writeFileSync(args.out, Buffer.from(out.buffer));
console.log(JSON.stringify({tokens, vocab}));
process.exit(0);
