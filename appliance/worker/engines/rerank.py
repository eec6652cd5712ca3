"""The rerank worker kind: openvino_genai.TextRerankPipeline scores (query, document) pairs with a cross-encoder.

Request body: {"query": str, "documents": [str, ...], "truncate": bool}.
Result: {"scores": [relevance of each document, in the order sent]}; the front sorts them and
applies top_n, so every document is scored (genai's own top_n is the number of documents one pipeline call scores).
"""

from __future__ import annotations

import math
from typing import Any

from appliance.worker.engines.base import ResultEngine, UnusableOutput
from appliance.worker.engines.embedding import check_token_limit, input_token_limit, token_counts

BATCH_SIZE = 32  # documents per pipeline call (see embedding.BATCH_SIZE)


class RerankEngine(ResultEngine):
    def __init__(self, spec: dict[str, Any], channel):
        import openvino_genai
        super().__init__(spec, channel)
        self.limit = input_token_limit(spec)
        config = openvino_genai.TextRerankPipeline.Config()
        config.top_n = BATCH_SIZE
        config.max_length = self.limit  # genai truncates each pair to it; a longer pair is refused unless asked
        self.pipe = openvino_genai.TextRerankPipeline(spec["path"], spec["device"], config, **spec["properties"])
        self.tokenizer = openvino_genai.Tokenizer(spec["path"])
        self.pipe.rerank("openarc", ["openarc"])  # the first call's one-off costs, paid before `ready`

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        query, documents = body["query"], body["documents"]
        counts = token_counts(self.tokenizer, [query], documents)
        check_token_limit(counts, self.limit, body.get("truncate", False), "documents")
        scores = [0.0] * len(documents)
        for start, batch in self.in_batches(documents, BATCH_SIZE):
            for index, score in self.pipe.rerank(query, batch):
                scores[start + index] = float(score)
        if not all(math.isfinite(score) for score in scores):  # a broken model: no client can parse NaN
            raise UnusableOutput("the model returned non-finite scores (NaN or infinity)")
        return {"scores": scores}, {"prompt_tokens": sum(min(count, self.limit) for count in counts)}
