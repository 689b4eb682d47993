"""Greedy token ids of a model on fixed prompts, as JSON, for before/after comparisons of two
trees (run it with each tree first on PYTHONPATH; it uses only the public API):

    PYTHONPATH=path/to/tree python3 scripts/greedy_tokens.py [key=value engine args ...]

Text prompts (and a chat) for a model with a tokenizer; random token ids for one without.
"""

import json
import random
import sys

from pagedserve import LLM, SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):",
           "The three primary colors are", "Water boils at", "In 1492, Columbus",
           "Photosynthesis is the process by which plants convert sunlight into"]


def main() -> None:
    llm = LLM(**dict(arg.split("=", 1) for arg in sys.argv[1:]))
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    if llm.tokenizer is None:
        rng = random.Random(0)
        vocab = llm.engine.runner.vocab_size
        prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(8, 200))]}
                   for _ in range(64)]
        outs = llm.generate(prompts, params, use_tqdm=False)
        print(json.dumps({"prompts": [o.outputs[0].token_ids for o in outs]}))
        return
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    chat = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)
    print(json.dumps({"prompts": [o.outputs[0].token_ids for o in outs],
                      "chat": chat[0].outputs[0].token_ids,
                      "chat_text": chat[0].outputs[0].text}))


if __name__ == "__main__":
    main()
