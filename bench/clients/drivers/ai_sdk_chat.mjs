// A Vercel AI SDK program, as its users write one: generateText on an @ai-sdk/openai-compatible provider, a text
// turn, or a tool the SDK runs on the model's call before asking again (stopWhen). Run by bench.clients from the
// release's own prefix, so that `ai` resolves there: `node ai_sdk_chat.mjs PROMPT` with OPENAI_BASE_URL, MODEL and
// (for the round trip) WITH_TOOL=1.
import { readFileSync } from "node:fs";
import { generateText, jsonSchema, stepCountIs, tool } from "ai";
import { createOpenAICompatible } from "@ai-sdk/openai-compatible";

const provider = createOpenAICompatible({ name: "openarc", baseURL: process.env.OPENAI_BASE_URL, apiKey: "unused" });
const tools = process.env.WITH_TOOL ? {
  read_file: tool({
    description: "Read a text file and return its contents.",
    inputSchema: jsonSchema({ type: "object", properties: { path: { type: "string" } }, required: ["path"] }),
    execute: async ({ path }) => readFileSync(path, "utf8"),
  }),
} : undefined;
const result = await generateText({ model: provider.chatModel(process.env.MODEL), prompt: process.argv[2], tools,
                                    stopWhen: stepCountIs(3), maxRetries: 0 });
console.log(result.text);
