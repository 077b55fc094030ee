"""Run a tensor_parallel_size=2 engine (multiprocess mode) and print its results as JSON."""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, store, prompts_file = sys.argv[1], sys.argv[2], sys.argv[3]
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # more kv_connector_extra_config
    with open(prompts_file) as f:
        prompts = json.load(f)
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvtier.testing.engine import kv_transfer_config

    ktc = kv_transfer_config(store, **extra) if store != "-" else None
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=2048,
              enforce_eager=True, seed=0, block_size=32, kv_cache_memory_bytes=64 << 20,
              tensor_parallel_size=2, kv_transfer_config=ktc)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, detokenize=False),
                        use_tqdm=False)
    print("RESULT " + json.dumps([[list(o.outputs[0].token_ids), o.num_cached_tokens] for o in outs]),
          flush=True)


if __name__ == "__main__":
    main()
